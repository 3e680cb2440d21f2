// End-to-end security: access control by peer credentials, exercised from two real uids
// (the tests run as root; `nobody` through setpriv), and every limit with its error code,
// checked not to affect other clients.

import Foundation
import ObsClient
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Runs `obsctl` as `nobody` (uid 65534), with no supplementary groups.
func obsctlAsNobody(_ arguments: [String], socket: String) throws -> CommandResult {
    try run(which("setpriv")!, ["--reuid=nobody", "--regid=nogroup", "--clear-groups", BuildProducts.path("obsctl"), "--socket", socket] + arguments)
}

/// A daemon whose directory `nobody` can reach, with a configuration file.
func daemonForTwoUsers(_ config: String, _ arguments: [String] = []) async throws -> TestDaemon {
    let dir = TestDaemon.makeTemporaryDirectory()
    chmod(dir, 0o755)
    try ("[socket]\nmode = \"0666\"\n" + config).write(toFile: dir + "/obsd.toml", atomically: true, encoding: .utf8)
    return try await TestDaemon.start(["--config", dir + "/obsd.toml"] + arguments, directory: dir)
}

let canSwitchUsers = getuid() == 0 && which("setpriv") != nil

@Suite(.mayBlock, .serialized, .timeLimit(.minutes(5)), .enabled(if: canSwitchUsers, "needs root and setpriv to act as nobody"))
struct AccessControlTests {
    static let policy = """
        [[access.rule]]
        repos = ["public.*"]
        users = ["nobody"]
        allow = "read"

        [[access.rule]]
        repos = ["nobody.*", "shared"]
        groups = ["nogroup"]
        allow = "write"
        """

    @Test func allowedAndDeniedOperationsFromTwoUIDs() async throws {
        let d = try await daemonForTwoUsers(Self.policy)
        let s = d.socketPath
        // root (privileged) may do everything.
        #expect(try obsctl(["set", "public.news", "headline", "hello"], socket: s).status == 0)
        #expect(try obsctl(["set", "secret", "k", "1"], socket: s).status == 0)

        // nobody: read public.*, write nobody.* and shared (through its group), nothing else.
        #expect(try obsctlAsNobody(["get", "public.news", "headline"], socket: s).stdout == "\"hello\"\n")
        let denied = try obsctlAsNobody(["set", "public.news", "headline", "bye"], socket: s)
        #expect(denied.status == 3, "forbidden exits 3")
        #expect(denied.stderr.contains("uid 65534 (nobody)") && denied.stderr.contains("may not write repository public.news"))
        #expect(try obsctlAsNobody(["get", "secret", "k"], socket: s).status == 3)
        #expect(try obsctlAsNobody(["list", "secret"], socket: s).status == 3)
        #expect(try obsctlAsNobody(["watch", "secret"], socket: s).status == 3)
        #expect(try obsctlAsNobody(["set", "nobody.box", "k", "mine"], socket: s).status == 0)
        #expect(try obsctlAsNobody(["set", "shared", "k", "ours"], socket: s).status == 0)
        #expect(try obsctl(["get", "public.news", "headline"], socket: s).stdout == "\"hello\"\n", "the denied write changed nothing")

        // repos and stats show nobody only what it may read.
        #expect(try obsctlAsNobody(["repos"], socket: s).stdout.split(separator: "\n").dropFirst().map { $0.split(separator: " ")[0] } == ["nobody.box", "public.news", "shared"])
        let theirStats = try JSONParser.parse(try obsctlAsNobody(["stats", "--json"], socket: s).stdout)
        #expect(theirStats.objectValue?["peer"]?.objectValue?["uid"] == 65534)
        #expect(theirStats.objectValue?["peer"]?.objectValue?["privileged"] == false)
        #expect(theirStats.objectValue?["repos"] == 3 && theirStats.objectValue?["clients"] == nil && theirStats.objectValue?["writes"] == nil)
        #expect(theirStats.objectValue?["pid"] == nil && theirStats.objectValue?["reloads"] == nil, "nor the daemon's pid and reloads")
        let rootStats = try JSONParser.parse(try obsctl(["stats", "--json"], socket: s).stdout)
        #expect(rootStats.objectValue?["repos"] == 4 && rootStats.objectValue?["denied"]?.int64Value == 4)
        #expect(rootStats.objectValue?["peer"]?.objectValue?["privileged"] == true)
        #expect(rootStats.objectValue?["clients"]?.arrayValue?.isEmpty == false)

        // Every denial is logged with the peer's credentials (journal fields OBSD_PEER_*).
        let log = d.log
        #expect(log.contains("access denied") && log.contains("peer.uid=65534") && log.contains("peer.gid=65534") && log.contains("peer.pid="))
    }

    @Test func reloadRevokesSubscriptionsThatLostAccessWithoutDroppingConnections() async throws {
        let d = try await daemonForTwoUsers(Self.policy)
        let s = d.socketPath
        _ = try obsctl(["set", "public.news", "headline", "hello"], socket: s)
        // nobody watches public.news, and holds a connection to shared.
        let errPath = d.directory + "/watch.err"
        let watch = try ChildProcess(
            which("setpriv")!,
            ["--reuid=nobody", "--regid=nogroup", "--clear-groups", BuildProducts.path("obsctl"), "--socket", s, "watch", "public.news"],
            stderr: .file(errPath))
        defer { watch.stop() }
        let probe = try d.connect()
        #expect(try eventually { try probe.call(["op": "stats"])["subscriptions"] == 1 })

        // The new policy drops nobody's read access to public.*.
        try ("[socket]\nmode = \"0666\"\n[[access.rule]]\nrepos = [\"nobody.*\"]\nusers = [\"nobody\"]\nallow = \"write\"\n")
            .write(toFile: d.directory + "/obsd.toml", atomically: true, encoding: .utf8)
        d.signal(SIGHUP)
        #expect(await watch.exit(timeout: .seconds(20)) != nil, "the watch ended")
        #expect(watch.terminationStatus == 3)
        #expect(try String(contentsOfFile: errPath, encoding: .utf8).contains("may no longer read repository public.news"))
        #expect(try probe.call(["op": "ping"]).ok, "other connections were not dropped")
        #expect(try obsctlAsNobody(["set", "nobody.box", "k", "v"], socket: s).status == 0, "the new rule applies")
        #expect(try obsctlAsNobody(["get", "public.news", "headline"], socket: s).status == 3)
    }

    @Test func defaultPolicyLetsOthersDoNothingUnlessConfigured() async throws {
        let d = try await daemonForTwoUsers("")
        #expect(try obsctlAsNobody(["get", "any", "k"], socket: d.socketPath).status == 3)
        #expect(try obsctlAsNobody(["repos"], socket: d.socketPath).stdout == "NAME  REV         KEYS\n")
        let read = try await daemonForTwoUsers("[access]\ndefault = \"read\"\n")
        _ = try obsctl(["set", "any", "k", "1"], socket: read.socketPath)
        #expect(try obsctlAsNobody(["get", "any", "k"], socket: read.socketPath).status == 0)
        #expect(try obsctlAsNobody(["set", "any", "k", "2"], socket: read.socketPath).status == 3)
    }

    @Test func connectionsPerUIDAreLimitedButRootIsNot() async throws {
        let d = try await daemonForTwoUsers("[limits]\nmax-connections-per-uid = 2\n[access]\ndefault = \"read\"\n")
        var watches: [ChildProcess] = []
        defer { for w in watches { w.stop() } }
        for _ in 0..<2 {
            watches.append(
                try ChildProcess(
                    which("setpriv")!,
                    ["--reuid=nobody", "--regid=nogroup", "--clear-groups", BuildProducts.path("obsctl"), "--socket", d.socketPath, "watch", "r"]))
        }
        let probe = try d.connect()
        #expect(try eventually { try probe.call(["op": "stats"])["subscriptions"] == 2 })
        let third = try obsctlAsNobody(["get", "r", "k"], socket: d.socketPath)
        #expect(third.status != 0 && third.stderr.contains("too many connections from uid 65534 (limit 2)"), "\(third.status): \(third.stderr)")
        let rootConnections = try (0..<5).map { _ in try d.connect() }
        for c in rootConnections { #expect(try c.call(["op": "ping"]).ok, "root is not limited per uid") }
        #expect(try probe.call(["op": "stats"])["connectionsRefused"] == 1)
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct LimitTests {
    @Test func sizeLimitsAreTooLargeAndCountLimitsOverloaded() async throws {
        let d = try await TestDaemon.start(
            [
                "--max-value-bytes", "100", "--max-keys-per-request", "3", "--max-subscriptions", "2",
                "--max-keys-per-repository", "3", "--max-repositories", "2",
            ], inMemory: true)
        let c = try d.connect()
        let other = try d.connect()
        let big = JSONValue.string(String(repeating: "v", count: 150))

        #expect(try c.call(["op": "set", "repo": "a", "key": "k", "value": big]).errorCode == "too_large")
        #expect(try c.call(["op": "batch", "repo": "a", "ops": [["op": "set", "key": "x", "value": 1], ["op": "set", "key": "y", "value": big]]]).errorCode == "too_large")
        #expect(try c.call(["op": "get", "repo": "a", "key": "x"]).errorCode == "not_found", "nothing of the refused batch applied")
        #expect(try c.call(["op": "batch", "repo": "a", "ops": [["op": "delete", "key": "1"], ["op": "delete", "key": "2"], ["op": "delete", "key": "3"], ["op": "delete", "key": "4"]]]).errorCode == "too_large")
        #expect(try c.call(["op": "subscribe", "repo": "a", "keys": ["1", "2", "3", "4"]]).errorCode == "too_large")

        #expect(try c.call(["op": "subscribe", "repo": "a"]).ok)
        let second = try c.call(["op": "subscribe", "repo": "b"])
        #expect(try c.call(["op": "subscribe", "repo": "c"]).errorCode == "overloaded")
        #expect(try other.call(["op": "subscribe", "repo": "c"]).ok, "the limit is per connection")
        _ = try c.call(["op": "unsubscribe", "sub": second["sub"]!])
        #expect(try c.call(["op": "subscribe", "repo": "c"]).ok)

        for k in ["k1", "k2", "k3"] { #expect(try c.call(["op": "set", "repo": "a", "key": .string(k), "value": 1]).ok) }
        #expect(try c.call(["op": "set", "repo": "a", "key": "k4", "value": 1]).errorCode == "overloaded")
        #expect(try c.call(["op": "set", "repo": "a", "key": "k1", "value": 2]).ok, "updating an existing key is fine")
        #expect(try c.call(["op": "batch", "repo": "a", "ops": [["op": "delete", "key": "k1"], ["op": "set", "key": "k4", "value": 1]]]).ok)

        #expect(try c.call(["op": "set", "repo": "b", "key": "k", "value": 1]).ok)
        #expect(try c.call(["op": "set", "repo": "c", "key": "k", "value": 1]).errorCode == "overloaded")
        // The write rules come first: what would not create the repository is answered as usual.
        let absent = try c.call(["op": "delete", "repo": "c", "key": "k"])
        #expect(absent.ok && absent["changed"] == false && absent["rev"] == 0)
        #expect(try c.call(["op": "set", "repo": "c", "key": "k", "value": 1, "ifRev": 5]).errorCode == "conflict")
        #expect(try c.call(["op": "batch", "repo": "c", "ops": [["op": "delete", "key": "x"]]])["changed"] == false)
        #expect(try other.call(["op": "set", "repo": "b", "key": "k", "value": 2]).ok, "existing repositories still take writes")
    }

    @Test func aRevisionCarryingTooManyOldAndNewBytesIsRefusedBeforeAnythingIsApplied() async throws {
        // On a durable store: the values are within max-value-bytes, their sum is not within
        // max-revision-bytes — 1 MiB here, so that the test writes 1.25 MiB, not the 20 MiB
        // the default 16 MiB takes (forty 500 KiB writes to the debug daemon took over 10 s
        // each on a busy machine).
        let d = try await TestDaemon.start(["--max-revision-bytes", "1048576"])
        let c = try d.connect()
        let other = try d.connect()
        let half = JSONValue.string(String(repeating: "v", count: 32 * 1024))
        for i in 0..<40 { #expect(try c.call(["op": "set", "repo": "big", "key": .string("k\(i)"), "value": half]).ok) }
        let deleteAll: [JSONValue] = (0..<40).map { ["op": "delete", "key": .string("k\($0)")] }
        let refused = try c.call(["op": "batch", "repo": "big", "ops": .array(deleteAll)])
        #expect(refused.errorCode == "too_large", "\(refused)")
        #expect(refused["error"]?.objectValue?["message"]?.stringValue?.contains("max-revision-bytes") == true)
        #expect(try c.call(["op": "list", "repo": "big"])["keys"]?.arrayValue?.count == 40, "nothing of it was applied")
        #expect(try c.call(["op": "get", "repo": "big", "key": "k0"])["rev"] == 1)
        // The daemon and everyone else's writes go on; half of it fits.
        #expect(try other.call(["op": "set", "repo": "small", "key": "k", "value": 1]).ok)
        let fits = try c.call(["op": "batch", "repo": "big", "ops": .array(Array(deleteAll.prefix(20)))])
        #expect(fits.ok && fits["rev"] == 41)
        #expect(await d.stop() == 0)
        try await d.launch()
        #expect(try d.connect().call(["op": "list", "repo": "big"])["keys"]?.arrayValue?.count == 20)
    }

    @Test func pipelinedRequestsWithoutReadingAreHeldBackByTheQueueLimit() async throws {
        let d = try await TestDaemon.start(["--queue-bytes", "1048576"], inMemory: true)
        let c = try d.connect()
        let value = JSONValue.string(String(repeating: "v", count: 64 * 1024))
        #expect(try c.call(["op": "set", "repo": "r", "key": "big", "value": value]).ok)
        let before = try peakResidentKiB(d.pid)
        // 4,000 gets of a 64 KiB value, sent at once (they fit in a few reads) and not read:
        // 250 MiB of replies if every request of a read were handled.
        let count = 4000
        let request = #"{"op":"get","repo":"r","key":"big"}"# + "\n"
        try c.sendRaw(Array(String(repeating: request, count: count).utf8))
        var replies = 0
        while replies < count, let line = try c.receiveLine() {
            #expect(line.count > 64 * 1024, "every get is answered with the value")
            replies += 1
        }
        #expect(replies == count)
        let grown = try peakResidentKiB(d.pid) - before
        #expect(grown < 64 * 1024, "the daemon's peak RSS grew \(grown) KiB for a 1 MiB queue limit")
    }

    @Test func totalConnectionsAreLimitedAndRefusedClientsGetOneMessage() async throws {
        let d = try await TestDaemon.start(["--max-connections", "3"], inMemory: true)
        let first = try d.connect()
        // Count connections one at a time. The start-up probe's connection may be admitted
        // after `first` (two event loops) and its close is asynchronous: wait until it has
        // been both admitted and let go.
        func waitForConnections(_ n: Int, total: Int? = nil) throws {
            let reached = try eventually(timeout: .seconds(10)) {
                let stats = try first.call(["op": "stats"])
                return stats["connections"] == .number(UInt64(n)) && (total.map { stats["connectionsTotal"] == .number(UInt64($0)) } ?? true)
            }
            if !reached { throw TestFailure("the daemon did not reach \(n) connections") }
        }
        try waitForConnections(1, total: 2)
        let held = try (0..<2).map { _ in try d.connect() }
        try waitForConnections(3)
        let refused = try d.connect()
        let message = try refused.receive()
        #expect(message.errorCode == "overloaded" && message["id"] == .null)
        #expect(message["error"]?.objectValue?["message"] == "too many connections (limit 3)")
        #expect(try refused.receiveLine() == nil, "then the connection is closed")
        for c in held + [first] { #expect(try c.call(["op": "ping"]).ok, "admitted clients are unaffected") }
        held[0].close()
        try waitForConnections(2)
        #expect(try d.connect().call(["op": "ping"]).ok, "a slot frees up when a client leaves")
    }
}
