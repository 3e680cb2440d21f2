// End-to-end: `obsctl stats --prometheus` against the real obsd. The text read back by the
// reference parser (Python's prometheus_client, Debian's python3-prometheus-client) and by
// the format's line rules; counters after writes and each repository's revision; the
// reduced reply of an unprivileged caller; no repository named unless `--per-repository`
// asks; `obsd_up 0` and exit 0 when the daemon is down; `--output` replacing its file
// atomically, never leaving a temporary file.

import Foundation
import ObsProtocol
import Synchronization
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The interpreter Debian's python3-prometheus-client installs for (`make test-deps`); another
/// `python3` earlier on PATH (pyenv, a venv) would not see it.
let systemPython = "/usr/bin/python3"

/// Whether the reference parser can be run.
let hasPrometheusParser: Bool = {
    guard access(systemPython, X_OK) == 0 else { return false }
    return (try? run(systemPython, ["-c", "import prometheus_client.parser"]))?.status == 0
}()

/// One metric family as prometheus_client's parser reads it.
struct ParsedFamily {
    struct Sample {
        let name: String
        let labels: [String: String]
        let value: Double
    }
    let name: String
    let type: String
    let help: String
    let samples: [Sample]
}

/// Parses exposition text with `prometheus_client.parser.text_string_to_metric_families`.
/// Throws with the parser's message if it refuses the text.
func parseWithPrometheusClient(_ text: String) throws -> [String: ParsedFamily] {
    let dir = TestDaemon.makeTemporaryDirectory()
    defer { try? FileManager.default.removeItem(atPath: dir) }
    try text.write(toFile: dir + "/metrics.prom", atomically: true, encoding: .utf8)
    let script = """
        import json, sys
        from prometheus_client.parser import text_string_to_metric_families
        text = open(sys.argv[1], encoding="utf-8").read()
        print(json.dumps([
            {"name": f.name, "type": f.type, "help": f.documentation,
             "samples": [{"name": s.name, "labels": s.labels, "value": repr(s.value)} for s in f.samples]}
            for f in text_string_to_metric_families(text)]))
        """
    let result = try run(systemPython, ["-c", script, dir + "/metrics.prom"])
    guard result.status == 0 else { throw TestFailure("prometheus_client refused the text: \(result.stderr)\n\(text)") }
    var families: [String: ParsedFamily] = [:]
    for item in try JSONParser.parse(result.stdout).arrayValue ?? [] {
        guard let f = item.objectValue, let name = f["name"]?.stringValue else { continue }
        guard families[name] == nil else { throw TestFailure("the parser read two families named \(name)") }
        let samples = (f["samples"]?.arrayValue ?? []).compactMap { s -> ParsedFamily.Sample? in
            guard let o = s.objectValue, let sampleName = o["name"]?.stringValue, let value = o["value"]?.stringValue.flatMap(Double.init)
            else { return nil }
            let labels = (o["labels"]?.objectValue?.members ?? []).reduce(into: [String: String]()) { $0[$1.name] = $1.value.stringValue }
            return .init(name: sampleName, labels: labels, value: value)
        }
        families[name] = ParsedFamily(
            name: name, type: f["type"]?.stringValue ?? "", help: f["help"]?.stringValue ?? "", samples: samples)
    }
    return families
}

/// Checks exposition text against the format's line rules, as this suite reads them: every
/// line ends with a line feed; each family has one `# HELP` then one `# TYPE` line, then its
/// samples, all together; a sample's name is its family's. Returns each family's type and
/// its samples as `(line without the value, value)`, in order.
func checkExpositionLines(_ text: String) throws -> [(name: String, type: String, samples: [(series: String, value: Double)])] {
    guard text.hasSuffix("\n") else { throw TestFailure("the text does not end with a line feed") }
    var families: [(name: String, type: String, samples: [(series: String, value: Double)])] = []
    var expecting: String? = nil  // a family whose HELP was read, waiting for its TYPE
    for line in text.dropLast().split(separator: "\n", omittingEmptySubsequences: false).map(String.init) {
        if line.hasPrefix("# HELP ") {
            let name = String(line.dropFirst(7).prefix { $0 != " " })
            guard expecting == nil, !families.contains(where: { $0.name == name }) else { throw TestFailure("a second or misplaced HELP: \(line)") }
            expecting = name
        } else if line.hasPrefix("# TYPE ") {
            let parts = line.split(separator: " ")
            guard parts.count == 4, String(parts[2]) == expecting, ["counter", "gauge", "untyped"].contains(parts[3]) else {
                throw TestFailure("a TYPE line not right after its HELP: \(line)")
            }
            families.append((String(parts[2]), String(parts[3]), []))
            expecting = nil
        } else {
            guard expecting == nil, let current = families.last else { throw TestFailure("a sample outside a family: \(line)") }
            guard let space = line.lastIndex(of: " "), let value = Double(line[line.index(after: space)...]) else {
                throw TestFailure("a sample without a value: \(line)")
            }
            let series = String(line[..<space])
            guard series.prefix(while: { $0 != "{" }) == current.name else { throw TestFailure("a sample of another family under \(current.name): \(line)") }
            families[families.count - 1].samples.append((series, value))
        }
    }
    guard expecting == nil else { throw TestFailure("a HELP line without its TYPE") }
    return families
}

/// Every family obsctl writes by default for a privileged caller of a daemon with a store,
/// in order: the daemon's totals, nothing per repository.
let everyFamily = [
    "obsd_up", "obsd_info", "obsd_connections", "obsd_subscriptions", "obsd_repositories", "obsd_uptime_seconds",
    "obsd_connections_accepted_total", "obsd_connections_refused_total", "obsd_requests_total", "obsd_writes_total",
    "obsd_events_sent_total", "obsd_sent_bytes_total", "obsd_overflows_total", "obsd_writers_held_total", "obsd_repositories_held", "obsd_leases", "obsd_errors_total", "obsd_denied_total",
    "obsd_storage_commits_total", "obsd_storage_fsyncs_total", "obsd_storage_records_total", "obsd_storage_failures_total",
    "obsd_storage_checkpoints_total", "obsd_storage_checkpoint_failures_total", "obsd_reloads_total", "obsd_reload_failures_total",
]

/// The families `--per-repository` adds after those (a series per repository each).
let perRepositoryFamilies = ["obsd_repository_revision", "obsd_repository_keys"]

/// A durable daemon with three writes to `ui` (three keys) and one to `cfg`.
func daemonWithFourWrites() async throws -> TestDaemon {
    let d = try await TestDaemon.start()
    let c = try d.connect()
    for (repo, key) in [("ui", "theme"), ("ui", "lang"), ("ui", "size"), ("cfg", "k")] {
        #expect(try c.call(["op": "set", "repo": .string(repo), "key": .string(key), "value": 1]).ok)
    }
    c.close()
    return d
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct PrometheusMetricsTests {
    @Test func everyCounterOnceWithHelpAndTypeInTheFormatsLineOrder() async throws {
        let d = try await daemonWithFourWrites()
        let result = try obsctl(["stats", "--prometheus"], socket: d.socketPath)
        #expect(result.status == 0 && result.stderr.isEmpty, "\(result.status) \(result.stderr)")
        let families = try checkExpositionLines(result.stdout)
        // Every numeric field of today's stats reply is one this obsctl knows: no generic gauges.
        #expect(families.map(\.name) == everyFamily, "\(result.stdout)")
        let types = Dictionary(uniqueKeysWithValues: families.map { ($0.name, $0.type) })
        for name in everyFamily {
            #expect(types[name] == (name.hasSuffix("_total") ? "counter" : "gauge"), "\(name)")
        }
        let samples = Dictionary(uniqueKeysWithValues: families.flatMap(\.samples).map { ($0.series, $0.value) })
        #expect(samples["obsd_up"] == 1)
        #expect(samples["obsd_info{version=\"\(ObsRelease.version)\"}"] == 1)
        #expect((samples["obsd_writes_total"] ?? 0) >= 4)
        #expect((samples["obsd_storage_records_total"] ?? 0) >= 4)
        #expect(samples["obsd_repositories"] == 2)
        // At least obsctl's own.
        #expect((samples["obsd_connections"] ?? 0) >= 1)
    }

    /// The textfile is world-readable and node_exporter serves it to anyone who can scrape
    /// it: by default it names no repository (the access policy promises a peer learns
    /// nothing of repositories it may not read) and holds a fixed number of series.
    @Test func theDefaultExpositionNamesNoRepositoryAndPerRepositoryOptsIn() async throws {
        let d = try await daemonWithFourWrites()
        let plain = try obsctl(["stats", "--prometheus"], socket: d.socketPath)
        #expect(plain.status == 0 && plain.stderr.isEmpty, "\(plain.status) \(plain.stderr)")
        let families = try checkExpositionLines(plain.stdout)
        #expect(!families.contains { $0.name.hasPrefix("obsd_repository_") }, "\(plain.stdout)")
        #expect(families.allSatisfy { $0.samples.allSatisfy { !$0.series.contains("repo=") } })
        #expect(!plain.stdout.contains("\"ui\"") && !plain.stdout.contains("\"cfg\""), "\(plain.stdout)")

        let opted = try obsctl(["stats", "--prometheus", "--per-repository"], socket: d.socketPath)
        #expect(opted.status == 0 && opted.stderr.isEmpty, "\(opted.status) \(opted.stderr)")
        let all = try checkExpositionLines(opted.stdout)
        #expect(all.map(\.name) == everyFamily + perRepositoryFamilies, "\(opted.stdout)")
        let samples = Dictionary(uniqueKeysWithValues: all.flatMap(\.samples).map { ($0.series, $0.value) })
        #expect(samples["obsd_repository_revision{repo=\"ui\"}"] == 3 && samples["obsd_repository_keys{repo=\"ui\"}"] == 3)
        #expect(samples["obsd_repository_revision{repo=\"cfg\"}"] == 1 && samples["obsd_repository_keys{repo=\"cfg\"}"] == 1)
        // Only with --prometheus.
        #expect(try obsctl(["stats", "--per-repository"], socket: d.socketPath).status == 64)
        #expect(try obsctl(["stats", "--json", "--per-repository"], socket: d.socketPath).status == 64)
    }

    @Test(.enabled(if: hasPrometheusParser, "needs python3-prometheus-client for /usr/bin/python3 (make test-deps)"))
    func theReferenceParserReadsFamiliesTypesAndValues() async throws {
        let d = try await daemonWithFourWrites()
        let result = try obsctl(["stats", "--prometheus", "--per-repository"], socket: d.socketPath)
        #expect(result.status == 0)
        let families = try parseWithPrometheusClient(result.stdout)
        // The parser names a counter's family without `_total`; its sample keeps it.
        let written = everyFamily + perRepositoryFamilies
        #expect(Set(families.keys) == Set(written.map { $0.hasSuffix("_total") ? String($0.dropLast(6)) : $0 }))
        for name in written {
            let family = try #require(families[name.hasSuffix("_total") ? String(name.dropLast(6)) : name])
            #expect(family.type == (name.hasSuffix("_total") ? "counter" : "gauge"), "\(name)")
            #expect(!family.help.isEmpty, "\(name) has help")
            #expect(family.samples.allSatisfy { $0.name == name }, "\(name): \(family.samples.map(\.name))")
        }
        let writes = try #require(families["obsd_writes"]?.samples.first)
        #expect(writes.name == "obsd_writes_total" && writes.value >= 3)
        #expect(families["obsd_up"]?.samples.first?.value == 1)
        #expect(families["obsd_info"]?.samples.first?.labels == ["version": ObsRelease.version])
        let revisions = try #require(families["obsd_repository_revision"]?.samples)
        #expect(revisions.map(\.labels) == [["repo": "cfg"], ["repo": "ui"]])
        #expect(revisions.first { $0.labels["repo"] == "ui" }?.value == 3)
        #expect(families["obsd_repository_keys"]?.samples.first { $0.labels["repo"] == "ui" }?.value == 3)
    }

    @Test(.enabled(if: canSwitchUsers, "needs root and setpriv to act as nobody"))
    func anUnprivilegedCallerGetsOnlyWhatItsReplyHas() async throws {
        let d = try await daemonForTwoUsers(AccessControlTests.policy)
        let s = d.socketPath
        #expect(try obsctl(["set", "public.news", "headline", "hello"], socket: s).status == 0)
        #expect(try obsctl(["set", "secret", "k", "1"], socket: s).status == 0)
        let result = try obsctlAsNobody(["stats", "--prometheus"], socket: s)
        #expect(result.status == 0 && result.stderr.isEmpty, "\(result.status) \(result.stderr)")
        let families = try checkExpositionLines(result.stdout)
        #expect(families.map(\.name) == [
            "obsd_up", "obsd_info", "obsd_connections", "obsd_subscriptions", "obsd_repositories",
        ], "\(result.stdout)")
        // Only what nobody may read.
        #expect(result.stdout.contains("obsd_repositories 1\n"))
        let opted = try obsctlAsNobody(["stats", "--prometheus", "--per-repository"], socket: s)
        #expect(Array(try checkExpositionLines(opted.stdout).map(\.name).suffix(2)) == perRepositoryFamilies)
        #expect(opted.stdout.contains("obsd_repository_revision{repo=\"public.news\"} 1\n") && !opted.stdout.contains("secret"))
    }

    @Test func whenTheDaemonIsDownPrometheusPrintsUpZeroAndExitsZero() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let upZero = "# HELP obsd_up Whether obsctl read obsd's counters (1) or not (0: obsd is down, or the connection failed).\n"
            + "# TYPE obsd_up gauge\nobsd_up 0\n"
        // No socket file.
        let absent = try obsctl(["stats", "--prometheus"], socket: dir + "/none.sock")
        #expect(absent.status == 0)
        #expect(absent.stdout == upZero)
        #expect(absent.stderr == "obsctl: cannot connect to obsd at \(dir)/none.sock: no such file — is obsd running? (reported as obsd_up 0)\n")
        // Without --prometheus, the exit status says it, as before.
        #expect(try obsctl(["stats"], socket: dir + "/none.sock").status == 69)
        #expect(try obsctl(["stats", "--json"], socket: dir + "/none.sock").status == 69)

        // A socket nobody serves any more (obsd killed): refused, the same.
        let d = try await TestDaemon.start(inMemory: true)
        d.kill9()
        let stale = try obsctl(["stats", "--prometheus", "--output", dir + "/obsd.prom"], socket: d.socketPath)
        #expect(stale.status == 0 && stale.stdout.isEmpty)
        #expect(stale.stderr.contains("cannot connect") && stale.stderr.contains("obsd_up 0"), "\(stale.stderr)")
        #expect(try String(contentsOfFile: dir + "/obsd.prom", encoding: .utf8) == upZero)
        if hasPrometheusParser {
            let parsed = try parseWithPrometheusClient(upZero)
            #expect(parsed.count == 1 && parsed["obsd_up"]?.type == "gauge" && parsed["obsd_up"]?.samples.first?.value == 0)
        }
    }

    @Test func outputReplacesTheFileAtomicallyAndLeavesNoTemporaryFile() async throws {
        let d = try await daemonWithFourWrites()
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = dir + "/obsd.prom"
        try "old\n".write(toFile: path, atomically: false, encoding: .utf8)
        let before = try #require(try FileManager.default.attributesOfItem(atPath: path)[.systemFileNumber] as? UInt64)
        // A reader that opened the old file keeps reading the old file: replaced, not rewritten.
        let old = open(path, O_RDONLY)
        #expect(old >= 0)
        defer { close(old) }

        // --per-repository: the reader below checks that the last family is there too.
        let command = ["stats", "--prometheus", "--per-repository", "--output", path]
        let result = try obsctl(command, socket: d.socketPath)
        #expect(result.status == 0 && result.stdout.isEmpty && result.stderr.isEmpty, "\(result.stderr)")
        let text = try String(contentsOfFile: path, encoding: .utf8)
        #expect(try checkExpositionLines(text).map(\.name) == everyFamily + perRepositoryFamilies)
        var buffer = [UInt8](repeating: 0, count: 16)
        #expect(pread(old, &buffer, 16, 0) == 4 && Array(buffer.prefix(4)) == Array("old\n".utf8))
        let attributes = try FileManager.default.attributesOfItem(atPath: path)
        #expect(attributes[.systemFileNumber] as? UInt64 != before, "a new file took the name")
        #expect((attributes[.posixPermissions] as? Int) == 0o644, "node_exporter (another user) can read it")
        #expect(try FileManager.default.contentsOfDirectory(atPath: dir) == ["obsd.prom"], "no temporary file is left")

        // While obsctl replaces the file again and again, a reader only ever sees a whole one.
        let reader = AtomicReader(path: path)
        let thread = Thread { reader.run() }
        thread.start()
        for _ in 0..<15 {
            #expect(try obsctl(command, socket: d.socketPath).status == 0)
        }
        let seen = reader.finish()
        #expect(seen.reads > 0)
        #expect(seen.partial.isEmpty, "a reader saw an incomplete file: \(seen.partial.prefix(1))")
        #expect(try FileManager.default.contentsOfDirectory(atPath: dir) == ["obsd.prom"], "no temporary file is left")

        // A directory that does not exist: exit 74, nothing written anywhere.
        let missing = try obsctl(["stats", "--prometheus", "--output", dir + "/no/such/dir/obsd.prom"], socket: d.socketPath)
        #expect(missing.status == 74)
        #expect(missing.stderr == "obsctl: cannot create a temporary file in \(dir)/no/such/dir: No such file or directory\n")
        // --output works for the other formats too, and is checked like any option.
        #expect(try obsctl(["stats", "--json", "--output", dir + "/stats.json"], socket: d.socketPath).status == 0)
        #expect(try JSONParser.parse(String(contentsOfFile: dir + "/stats.json", encoding: .utf8)).objectValue?["repos"] == 2)
        #expect(try obsctl(["stats", "--json", "--prometheus"], socket: d.socketPath).status == 64)
        #expect(try obsctl(["stats", "--prometheus", "--output", ""], socket: d.socketPath).status == 64)
    }
}

/// Reads a file over and over on its own thread, keeping any read that is not a whole
/// exposition (`obsd_up 1` first, the repository families last, a final line feed).
final class AtomicReader: Sendable {
    let path: String
    private let stop = Atomic<Bool>(false)
    private let stopped = Atomic<Bool>(false)
    private let state = Mutex<(reads: Int, partial: [String])>((0, []))

    init(path: String) { self.path = path }

    func run() {
        defer { stopped.store(true, ordering: .releasing) }
        while !stop.load(ordering: .acquiring) {
            guard let text = try? String(contentsOfFile: path, encoding: .utf8) else {
                state.withLock { $0.partial.append("(unreadable)") }
                continue
            }
            let whole = text.hasPrefix("# HELP obsd_up ") && text.contains("\nobsd_up 1\n") && text.hasSuffix("\n")
                && text.contains("\nobsd_repository_keys{repo=\"ui\"} 3\n")
            state.withLock {
                $0.reads += 1
                if !whole { $0.partial.append(text) }
            }
        }
    }

    /// Stops the reader, waits (up to 10 s) for its last read to end, and returns what it saw.
    func finish() -> (reads: Int, partial: [String]) {
        stop.store(true, ordering: .releasing)
        let deadline = ContinuousClock.now + .seconds(10)
        while !stopped.load(ordering: .acquiring), ContinuousClock.now < deadline { usleep(1000) }
        return state.withLock { $0 }
    }
}
