// obsctl — `lease grant|keepalive|revoke`: leases for scripts, whose keys are written with
// `set --lease ID` and deleted when the lease ends.

import ArgumentParser
import ObsClient
import ObsProtocol
import ObservableKit

extension Obsctl {
    struct Leases: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "lease",
            abstract: "Grant, keep alive or revoke a lease (keys set with --lease ID are deleted when it ends).",
            discussion: """
                A script's lease has a TTL: it ends that many seconds after it was granted or last kept alive, and its \
                keys are deleted (watchers see "(expired)"). A lease without a TTL would end with obsctl's connection, at \
                once: to hold a key while a process runs, use obsctl hold.
                  L=$(obsctl lease grant --ttl 30)
                  obsctl set jobs worker/7 busy --lease "$L"
                  while sleep 10; do obsctl lease keepalive "$L" || break; done
                A lease that has ended: exit 1 (not found); another user's: exit 3.
                """,
            subcommands: [Grant.self, Keepalive.self, Revoke.self])

        struct Grant: AsyncParsableCommand {
            static let configuration = CommandConfiguration(abstract: "Grant a lease with a TTL and print its id.")

            @OptionGroup var global: GlobalOptions
            @Option(help: ArgumentHelp("The lease's TTL (1 to 31536000 seconds).", valueName: "seconds")) var ttl: UInt32

            func validate() throws {
                if ttl < 1 || ttl > 31_536_000 { throw ValidationError("--ttl is from 1 to 31536000 seconds, not \(ttl)") }
            }

            func run() async throws {
                try await global.withClient { client in
                    emit(String(try await client.grant(ttl: .seconds(ttl)).id.rawValue))
                }
            }
        }

        struct Keepalive: AsyncParsableCommand {
            static let configuration = CommandConfiguration(abstract: "Start a lease's TTL again in full (prints nothing).")

            @OptionGroup var global: GlobalOptions
            @Argument(help: "The lease's id.") var lease: UInt64

            func run() async throws {
                try await global.withClient { client in
                    try await client.keepAlive(Lease.ID(rawValue: lease))
                }
            }
        }

        struct Revoke: AsyncParsableCommand {
            static let configuration = CommandConfiguration(
                abstract: "End a lease now, deleting its keys; prints, per repository, the revision that deleted them.")

            @OptionGroup var global: GlobalOptions
            @Argument(help: "The lease's id.") var lease: UInt64

            func run() async throws {
                try await global.withClient { client in
                    let revisions = try await client.revoke(Lease.ID(rawValue: lease))
                    for (repo, rev) in revisions.sorted(by: { Key($0.key) < Key($1.key) }) { emit("\(repo)\trev \(rev)") }
                }
            }
        }
    }
}
