// obsctl — `hold`: a key that exists while obsctl (or the command it runs) runs, on a lease
// bound to obsctl's connection; and `wait`: return as soon as a key exists, has a value, or
// is absent, from one subscription that reads and watches at once.

import ArgumentParser
import Dispatch
import ObsClient
import ObsProtocol
import ObservableKit
import Subprocess

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

extension Obsctl {
    struct Hold: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Hold a key at a value while obsctl, or a command it runs, runs.",
            discussion: """
                The key is written on a lease bound to obsctl's connection: when obsctl ends, however it ends (even by \
                SIGKILL), obsd deletes the key, and watchers see why ("(closed)", or "(revoked)" when obsctl released it). \
                If the connection drops (obsd restarted), the key is absent until obsctl has reconnected and written it \
                again.

                Without a command, obsctl holds the key until SIGTERM, SIGINT or SIGHUP, then releases it and ends by \
                that signal. With a command (after --), obsctl runs it with its own standard input, output and error, \
                relays to it the signals it receives (HUP, INT, QUIT, TERM, USR1, USR2, WINCH, CONT; not those the \
                terminal sent to the whole process group, which the command got too), releases the key when it exits, \
                and exits as it did: with its exit status, or by the same signal. A command that cannot be run: 127 (not \
                found) or 126. Presence for a service:  ExecStart=obsctl hold svc indexer/up true -- /usr/bin/indexer

                VALUE is read as by set (JSON when it parses, else a string).
                """)

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Key.") var key: String
        @Argument(help: "Value.") var value: String
        @Argument(parsing: .postTerminator, help: ArgumentHelp("The command to run while the key is held.", valueName: "command"))
        var command: [String] = []

        func validate() throws {
            _ = try Set.parse(value)
        }

        func run() async throws {
            let parsed = try Set.parse(value)
            // Without a command, the signals that end the hold are caught from the start: one
            // that arrives while the key is being written releases it once written.
            let signals = command.isEmpty ? SignalWatch([SIGTERM, SIGINT, SIGHUP]) : nil
            let session = ObsSession(socketPath: global.socket)
            if let reason = await session.firstConnection() {
                printError(reason)
                throw Exit.unavailable
            }
            let hold: HeldKey
            do {
                hold = try await session.hold(Key(key), as: parsed, in: repo)
            } catch {
                await session.close()
                throw fail(error)
            }
            if let signals {
                let sig = await signals.first()
                await hold.release()
                await session.close()
                ChildCommand.exit(like: .signaled(sig))
            }
            SignalRelay.install()
            let status: TerminationStatus
            do {
                status = try await ChildCommand.run(command, relayingSignals: true)
            } catch {
                printError(error.message)
                await hold.release()
                await session.close()
                throw ExitCode(Int32(error.status))
            }
            await hold.release()
            await session.close()
            ChildCommand.exit(like: status)
        }
    }

    struct Wait: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Wait until a key exists (or has a value, or is absent).",
            discussion: """
                Returns as soon as the key exists — with --value, as soon as it equals VALUE (equal as JSON: members in \
                any order, 1 equals 1.0); with --absent, as soon as it does not exist — printing its value (nothing with \
                --absent or --quiet), exit 0. A condition that holds already returns at once. Reading and watching are \
                one subscription (a snapshot, then every change after it), so no write is missed between them. \
                --timeout SECONDS gives up after that long: exit 124, as timeout(1). Without it, obsctl waits for ever. \
                For ExecStartPre=:  ExecStartPre=obsctl wait svc db/up --timeout 30
                """)

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Key.") var key: String
        @Option(help: ArgumentHelp("Wait until the key equals this value (JSON when it parses, else a string).", valueName: "json"))
        var value: String?
        @Flag(help: "Wait until the key does not exist.") var absent = false
        @Option(help: ArgumentHelp("Give up after this many seconds (exit 124).", valueName: "seconds")) var timeout: Double?
        @Flag(name: .shortAndLong, help: "Print nothing.") var quiet = false

        func validate() throws {
            if value != nil && absent { throw ValidationError("use at most one of --value and --absent") }
            if let value { _ = try Set.parse(value) }
            if let timeout, !(timeout.isFinite && timeout >= 0 && timeout <= 31_536_000) {
                throw ValidationError("--timeout is a number of seconds from 0 to 31536000")
            }
        }

        /// Whether the key's value (nil: absent) is what the command waits for.
        private func satisfied(_ current: JSONValue?, wanted: JSONValue?) -> Bool {
            if absent { return current == nil }
            guard let current else { return false }
            return wanted.map { $0 == current } ?? true
        }

        func run() async throws {
            let wanted = try value.map { text throws(ValidationError) in try Set.parse(text) }
            let deadline = timeout.map { Duration.milliseconds(Int64(($0 * 1000).rounded(.up))) }
            try await global.withClient { client in
                let subscription = try await client.subscribe(to: repo, selecting: .keys([Key(key)]), initial: true)
                let outcome = try await withThrowingTaskGroup(of: JSONValue??.self) { group in
                    group.addTask {
                        for try await event in subscription {
                            let current: JSONValue?
                            switch event {
                            case .snapshot(_, let values): current = values[Key(key)]
                            case .change(let change): current = change.change(for: Key(key))?.new
                            case .synced, .catchUp: continue  // (no catch-up: it starts with a snapshot)
                            }
                            if satisfied(current, wanted: wanted) { return .some(current) }
                        }
                        throw ObsClientError.connectionClosed(path: client.socketPath)
                    }
                    if let deadline {
                        group.addTask {
                            try await Task.sleep(for: deadline)
                            return .none
                        }
                    }
                    defer { group.cancelAll() }
                    return try await group.next() ?? .none
                }
                guard let found = outcome else {
                    printError("timed out after \(timeout ?? 0) s waiting for \(repo)/\(key)")
                    throw Exit.timedOut
                }
                if !quiet, let found { emit(found.jsonText) }
            }
        }
    }
}

/// The client library's hold (`Hold` inside `Obsctl` is the command).
typealias HeldKey = Hold

extension ObsSession {
    /// Waits for the session's first connection attempt to settle: nil once connected, else
    /// why it failed (obsctl then exits 69 instead of waiting for obsd to appear).
    func firstConnection() async -> String? {
        for await state in connectionStates() {
            switch state {
            case .connecting: continue
            case .connected: return nil
            case .waiting(_, let reason): return reason
            case .closed: return "the session was closed"
            }
        }
        return "the session was closed"
    }
}

/// Waiting for a signal, for `hold` without a command: from its creation on, `signals` no
/// longer end obsctl; the first one received is kept until `first` asks.
final class SignalWatch {
    private let stream: AsyncStream<Int32>
    private let sources: [any DispatchSourceSignal]

    init(_ signals: [Int32]) {
        let (stream, continuation) = AsyncStream.makeStream(of: Int32.self)
        self.stream = stream
        sources = signals.map { sig in
            signal(sig, SIG_IGN)
            let source = DispatchSource.makeSignalSource(signal: sig, queue: .global())
            source.setEventHandler { continuation.yield(sig) }
            source.resume()
            return source
        }
    }

    /// The first signal received (at once if one came already).
    func first() async -> Int32 {
        let received = await stream.first { _ in true }
        for source in sources { source.cancel() }
        return received ?? SIGTERM
    }
}
