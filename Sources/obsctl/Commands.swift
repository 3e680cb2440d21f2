// obsctl — the key and repository commands: set (with a TTL or a lease), get, del, list,
// repos, stats; and how a VALUE argument is read.

import ArgumentParser
import ObsClient
import ObsProtocol
import ObservableKit

extension Obsctl {
    struct Set: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Set a key.",
            discussion: """
                VALUE is parsed as JSON when it is valid JSON (42, true, {"a":1}, "quoted"), else taken as a string.
                A VALUE that starts like JSON ({, [ or ") but is not valid JSON is refused: it is almost always a typo;
                pass --string to store such text as a string. An equal value changes nothing unless --force.
                A negative number is a VALUE as it is (obsctl set ui n -5); any other VALUE that starts with
                a dash goes after -- (obsctl set ui k -- -x).
                --ttl SECONDS attaches the key to a lease with that TTL: it is deleted unless set again within
                SECONDS (watchers see "(expired)"). Setting it again with the same --ttl keeps that lease alive and
                stays on it; a key set without --ttl or --lease is attached to no lease. --lease ID attaches it to a
                lease granted with "obsctl lease grant" (or held by "obsctl hold").
                """)

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Key.") var key: String
        /// VALUE as given: every input not recognized as an option, so that `-5` is one (the
        /// parser would take a lone `@Argument` starting with `-` for an unknown option); a
        /// leading `--` is the terminator. `validate` requires exactly one value.
        @Argument(parsing: .allUnrecognized, help: ArgumentHelp("Value.", valueName: "value")) var inputs: [String]
        @Flag(help: "Take VALUE as a string, even if it is valid JSON.") var string = false
        @Flag(help: "Require VALUE to be valid JSON.") var json = false
        @Option(help: ArgumentHelp("Write only if the key is at this revision (0: only if absent).", valueName: "rev"))
        var ifRev: UInt64?
        @Flag(help: "Count an equal value as a change (revision raised, event sent).") var force = false
        @Option(help: ArgumentHelp("Delete the key unless it is set again within this many seconds (1 to 31536000).", valueName: "seconds"))
        var ttl: UInt32?
        @Option(help: ArgumentHelp("Attach the key to this lease (obsctl lease grant).", valueName: "id")) var lease: UInt64?
        @Flag(name: .shortAndLong, help: "Print nothing on success.") var quiet = false

        /// The VALUE inputs, without the terminator.
        private var values: ArraySlice<String> { inputs.first == "--" ? inputs.dropFirst() : inputs[...] }
        /// The VALUE (`validate` checked there is exactly one).
        var value: String { values.first ?? "" }

        func validate() throws {
            guard let first = values.first else { throw ValidationError("Missing expected argument '<value>'") }
            // Before `--`, an input with a dash is an option this command does not have — unless
            // it is a (negative) number.
            if inputs.first != "--", let unknown = values.first(where: { $0.hasPrefix("-") && !Self.isNumber($0) }) {
                throw ValidationError(
                    "Unknown option '\(unknown)' (a VALUE that starts with a dash goes after --: obsctl set \(repo) \(key) -- \(unknown))")
            }
            if values.count > 1 { throw ValidationError("Unexpected argument '\(values.dropFirst().first ?? first)' (one VALUE; quote it if it has spaces)") }
            if string && json { throw ValidationError("use at most one of --string and --json") }
            _ = try Self.parse(value, string: string, json: json)
            if ttl != nil && lease != nil { throw ValidationError("use at most one of --ttl and --lease") }
            if let ttl, ttl < 1 || ttl > 31_536_000 { throw ValidationError("--ttl is from 1 to 31536000 seconds, not \(ttl)") }
            if lease == 0 { throw ValidationError("--lease is a lease id (1 or more)") }
        }

        /// A VALUE argument as a JSON value: JSON when it parses, else a string (`string`:
        /// always a string; `json`: JSON or an error). Text that starts like JSON but is not
        /// valid JSON is an error: almost always a typo.
        static func parse(_ value: String, string: Bool = false, json: Bool = false) throws(ValidationError) -> JSONValue {
            if string { return .string(value) }
            if let parsed = try? JSONParser.parse(value) { return parsed }
            if json { throw ValidationError("VALUE is not valid JSON: \(value)") }
            if let first = value.first(where: { !$0.isWhitespace }), "{[\"".contains(first) {
                do {
                    _ = try JSONParser.parse(value)
                } catch {
                    throw ValidationError(
                        "VALUE starts like JSON but is not valid JSON (\(error)); fix it, or pass --string to store the text as a string")
                }
            }
            return .string(value)
        }

        private static func isNumber(_ text: String) -> Bool {
            switch try? JSONParser.parse(text) {
            case .int?, .double?: return true
            default: return false
            }
        }

        func run() async throws {
            let parsed = try Self.parse(value, string: string, json: json)
            try await global.withClient { client in
                var attach = lease.map(Lease.ID.init(rawValue:))
                if let ttl { attach = try await Self.lease(for: Key(key), in: repo, ttl: ttl, on: client) }
                let reply = try await client.set(Key(key), to: parsed, in: repo, ifRevision: ifRev, force: force, lease: attach)
                if !quiet { emit(reply.changed ? "rev \(reply.revision)" : "rev \(reply.revision) (unchanged)") }
            }
        }

        /// A lease with `ttl` for `key`: the one it is attached to, kept alive, when that one has
        /// the same TTL — so that a key set again and again holds one lease, not one per set —
        /// else a new one.
        static func lease(for key: Key, in repo: String, ttl: UInt32, on client: ObsConnection) async throws(ObsClientError) -> Lease.ID {
            if let current = try await client.lease(of: key, in: repo) {
                do throws(ObsClientError) {
                    if try await client.keepAlive(current) == .seconds(ttl) { return current }
                } catch where error.code == .notFound || error.code == .forbidden {
                    // it ended meanwhile, or is another user's: grant one of our own
                }
            }
            return try await client.grant(ttl: .seconds(ttl)).id
        }
    }

    struct Get: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Print a key's value as JSON (exit 1 if the key does not exist).")

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Key.") var key: String
        @Flag(help: "Print a string value without JSON quotes.") var raw = false
        @Flag(help: "Print {\"value\":…,\"rev\":…}.") var json = false

        func run() async throws {
            try await global.withClient { client in
                guard let entry = try await client.get(Key(key), in: repo) else {
                    printError("key \(JSONValue.string(key).jsonText) does not exist in repository \(repo)")
                    throw Exit.notFound
                }
                if json {
                    emit(JSONValue.object(JSONObject(uniqueMembers: [("value", entry.value), ("rev", .number(entry.revision))])).jsonText)
                } else if raw, case .string(let s) = entry.value {
                    emit(s)
                } else {
                    emit(entry.value.jsonText)
                }
            }
        }
    }

    struct Del: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Delete a key (deleting an absent key is not an error).")

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Key.") var key: String
        @Option(help: ArgumentHelp("Delete only if the key is at this revision.", valueName: "rev")) var ifRev: UInt64?
        @Flag(name: .shortAndLong, help: "Print nothing on success.") var quiet = false

        func run() async throws {
            try await global.withClient { client in
                let reply = try await client.delete(Key(key), in: repo, ifRevision: ifRev)
                if !quiet { emit(reply.changed ? "rev \(reply.revision)" : "rev \(reply.revision) (absent)") }
            }
        }
    }

    struct List: AsyncParsableCommand {
        static let configuration = CommandConfiguration(abstract: "List a repository's keys in byte order.")

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Option(help: ArgumentHelp("Only keys starting with this prefix.", valueName: "prefix")) var prefix: String?
        @Flag(help: "Print each key's value after a tab.") var values = false
        @Flag(help: "Print the reply as one JSON object.") var json = false

        func run() async throws {
            try await global.withClient { client in
                let listing = try await client.list(repo, prefix: prefix, includingValues: values || json)
                if json {
                    var o = JSONObject()
                    o["rev"] = .number(listing.revision)
                    o["epoch"] = .string(listing.epoch)
                    o["keys"] = .array(listing.keys.map { .string($0.string) })
                    if values {
                        o["values"] = .object(JSONObject(uniqueMembers: listing.keys.map { ($0.string, listing.values?[$0] ?? .null) }))
                    }
                    emit(JSONValue.object(o).jsonText)
                    return
                }
                for key in listing.keys {
                    if values, let value = listing.values?[key] {
                        emit("\(key.string)\t\(value.jsonText)")
                    } else {
                        emit(key.string)
                    }
                }
            }
        }
    }

    struct Repos: AsyncParsableCommand {
        static let configuration = CommandConfiguration(abstract: "List repositories with their revision and number of keys.")

        @OptionGroup var global: GlobalOptions
        @Flag(help: "Print a JSON array.") var json = false

        func run() async throws {
            try await global.withClient { client in
                let repos = try await client.repositories()
                if json {
                    emit(JSONValue.array(repos.map {
                        .object(JSONObject(uniqueMembers: [
                            ("name", .string($0.name)), ("rev", .number($0.revision)), ("keys", .int(Int64($0.keys))),
                            ("epoch", .string($0.epoch)),
                        ]))
                    }).jsonText)
                    return
                }
                let width = max(4, repos.map(\.name.count).max() ?? 0)
                emit(pad("NAME", width) + "  " + pad("REV", 10) + "  KEYS")
                for r in repos { emit(pad(r.name, width) + "  " + pad(String(r.revision), 10) + "  \(r.keys)") }
            }
        }

        private func pad(_ s: String, _ width: Int) -> String {
            s.count >= width ? s : s + String(repeating: " ", count: width - s.count)
        }
    }

    struct Stats: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Print the daemon's counters.",
            discussion: """
                --prometheus prints them in the Prometheus text format (version 0.0.4), for node_exporter's textfile \
                collector (README, "Metrics"): the daemon's totals only. --per-repository adds each repository's revision \
                and number of keys, labelled with its name: every repository the caller may read is then named in the \
                output, which node_exporter serves to whoever can scrape it, and each repository adds two series. When \
                obsd cannot be reached or the connection fails, --prometheus prints obsd_up 0, says why on standard error \
                and exits 0: the collector then shows the daemon down instead of the last numbers it read.

                --output FILE replaces FILE atomically instead of printing: a reader sees the old file or the new one, \
                whole, and no temporary file is left behind.
                """)

        @OptionGroup var global: GlobalOptions
        @Flag(help: "Print one JSON object.") var json = false
        @Flag(help: "Print the Prometheus text exposition format (0.0.4).") var prometheus = false
        @Flag(help: "With --prometheus: also each repository's revision and keys, labelled with its name.")
        var perRepository = false
        @Option(help: ArgumentHelp("Write to this file, replaced atomically, instead of standard output.", valueName: "file"))
        var output: String?

        func validate() throws {
            if json && prometheus { throw ValidationError("use at most one of --json and --prometheus") }
            if perRepository && !prometheus { throw ValidationError("--per-repository goes with --prometheus") }
            if let output, output.isEmpty || output.hasSuffix("/") { throw ValidationError("--output needs a file name") }
        }

        func run() async throws {
            if prometheus {
                try deliver(await scrape().text)
                return
            }
            try await global.withClient { client in
                let stats = try await client.statistics().jsonObject
                if json {
                    try deliver(JSONValue.object(stats).jsonText + "\n")
                } else {
                    try deliver(stats.members.map { "\($0.name): \($0.value.jsonText)\n" }.joined())
                }
            }
        }

        /// The daemon's metrics, read with `stats` (and, with `--per-repository`, `repos`) on one
        /// connection; `obsd_up 0` (and the reason on standard error) if either fails.
        private func scrape() async -> PrometheusExposition {
            let client: ObsConnection
            do {
                client = try await ObsConnection.connect(socketPath: global.socket)
            } catch {
                printError("\(error) (reported as obsd_up 0)")
                return StatsExposition.down()
            }
            do {
                let stats = try await client.statistics()
                let repos = perRepository ? try await client.repositories() : []
                await client.close()
                return StatsExposition.metrics(stats: stats, repos: repos) { printError($0) }
            } catch {
                await client.close()
                printError("\(error) (reported as obsd_up 0)")
                return StatsExposition.down()
            }
        }

        /// Prints `text` (lines, each ending with a line feed), or writes it to `--output`.
        private func deliver(_ text: String) throws {
            guard let output else {
                if !text.isEmpty { emit(String(text.dropLast())) }
                return
            }
            do {
                try writeAtomically(text, to: output)
            } catch {
                printError(error.description)
                throw Exit.ioError
            }
        }
    }
}
