// End-to-end: obsctl's lease verbs against the real obsd and obsctl binaries — `set --ttl`
// and `--lease`, `lease grant|keepalive|revoke`, `hold` (with and without a command, its exit
// status and signals, SIGKILL seen by another client), `wait` (and its latency from the write's
// reply to its exit) and `watch` showing why a key went away. `watch --exec` is in
// WatchExecTests. Every wait has a deadline; background obsctl processes are awaited.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A test's obsctl running in the background, its output in files of `directory`.
final class BackgroundObsctl: Sendable {
    let process: ChildProcess
    let stdoutPath: String
    let stderrPath: String

    init(_ arguments: [String], socket: String, directory: String, name: String) throws {
        stdoutPath = "\(directory)/\(name).out"
        stderrPath = "\(directory)/\(name).err"
        process = try ChildProcess(
            BuildProducts.path("obsctl"), ["--socket", socket] + arguments, stdout: .file(stdoutPath), stderr: .file(stderrPath))
    }

    var stdout: String { (try? String(contentsOfFile: stdoutPath, encoding: .utf8)) ?? "" }
    var stderr: String { (try? String(contentsOfFile: stderrPath, encoding: .utf8)) ?? "" }

    /// The status (as a shell reports it) once it exited within `timeout`.
    func status(within timeout: Duration = .seconds(20)) throws -> Int32 {
        guard process.wait(timeout: timeout) != nil else { throw TestFailure("obsctl did not exit within \(timeout): \(stderr)") }
        return process.terminationStatus
    }
}

extension TestDaemon {
    /// Waits until the daemon counts `count` live subscriptions (the test runs as the daemon's uid: privileged stats).
    func waitForSubscriptions(_ count: Int64) throws {
        let c = try connect()
        let reached = try eventually { try c.call(["op": "stats"])["subscriptions"]?.int64Value == count }
        if !reached { throw TestFailure("the daemon never counted \(count) subscriptions") }
    }

    /// The value of `key` in `repo`, nil if absent.
    func value(_ repo: String, _ key: String) throws -> JSONValue? {
        let reply = try connect().call(["op": "get", "repo": .string(repo), "key": .string(key)])
        return reply.ok ? reply["value"] : nil
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct LeaseCommandTests {
    @Test func setWithATTLExpiresUnlessSetAgainAndStaysOnOneLease() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "t"]).ok)
        // TTLs no pause between two commands reaches, however busy the machine (with 2 s, a
        // fresh clone's run saw the lease expire between the two sets of `k`).
        #expect(try obsctl(["set", "t", "k", "1", "--ttl", "600"], socket: d.socketPath).stdout == "rev 1\n")
        let first = try #require(try d.connect().call(["op": "get", "repo": "t", "key": "k"])["lease"])
        #expect(try obsctl(["set", "t", "k", "2", "--ttl", "600"], socket: d.socketPath).status == 0)
        #expect(try d.connect().call(["op": "get", "repo": "t", "key": "k"])["lease"] == first, "set again with that TTL: the same lease, kept alive")
        #expect(try obsctl(["set", "t", "other", "1", "--ttl", "600"], socket: d.socketPath).status == 0)
        #expect(try d.connect().call(["op": "get", "repo": "t", "key": "other"])["lease"] != first, "another key: a lease of its own")
        // Not set again: the key goes when its lease expires.
        #expect(try obsctl(["set", "t", "brief", "1", "--ttl", "1"], socket: d.socketPath).status == 0)
        for rev in 1...4 { #expect(try watcher.receive()["rev"] == .int(Int64(rev))) }
        let expired = try watcher.receive(timeout: .seconds(30))
        #expect(expired["changes"] == [["key": "brief", "old": 1]] && expired["lease"]?.objectValue?["end"] == "expired")
        let bad = try obsctl(["set", "t", "k", "1", "--ttl", "0"], socket: d.socketPath)
        #expect(bad.status == 64 && bad.stderr.contains("--ttl"))
        #expect(try obsctl(["set", "t", "k", "1", "--ttl", "5", "--lease", "3"], socket: d.socketPath).status == 64)
    }

    @Test func leaseVerbsForScripts() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let granted = try obsctl(["lease", "grant", "--ttl", "30"], socket: d.socketPath)
        let id = try #require(UInt64(granted.stdout.trimmingCharacters(in: .whitespacesAndNewlines)), "prints the id alone: \(granted)")
        #expect(try obsctl(["set", "jobs", "w/1", "busy", "--lease", "\(id)"], socket: d.socketPath).status == 0)
        #expect(try obsctl(["set", "other", "w/2", "busy", "--lease", "\(id)"], socket: d.socketPath).status == 0)
        let kept = try obsctl(["lease", "keepalive", "\(id)"], socket: d.socketPath)
        #expect(kept.status == 0 && kept.stdout.isEmpty)
        let revoked = try obsctl(["lease", "revoke", "\(id)"], socket: d.socketPath)
        #expect(revoked.status == 0 && revoked.stdout == "jobs\trev 2\nother\trev 2\n")
        #expect(try d.value("jobs", "w/1") == nil)
        for verb in ["keepalive", "revoke"] {
            let gone = try obsctl(["lease", verb, "\(id)"], socket: d.socketPath)
            #expect(gone.status == 1 && gone.stderr.contains("not_found"), "\(verb) of an ended lease: not found")
        }
        #expect(try obsctl(["set", "jobs", "w/1", "busy", "--lease", "\(id)"], socket: d.socketPath).status == 1)
        #expect(try obsctl(["lease", "grant"], socket: d.socketPath).status == 64, "a script's lease needs a TTL")
        #expect(try obsctl(["lease", "grant", "--ttl", "31536001"], socket: d.socketPath).status == 64)
    }

    @Test func holdWithACommandPassesItsExitStatusAndTheKeyIsGone() async throws {
        let d = try await TestDaemon.start()
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "svc"]).ok)
        let marker = d.directory + "/ran"
        let held = try obsctl(["hold", "svc", "job/up", "true", "--", "sh", "-c", "obsd_probe=1; touch \(marker); exit 3"], socket: d.socketPath)
        #expect(held.status == 3, "the command's status: \(held.stderr)")
        #expect(FileManager.default.fileExists(atPath: marker))
        #expect(try d.value("svc", "job/up") == nil, "gone when obsctl has exited")
        #expect(try watcher.receive()["changes"] == [["key": "job/up", "new": true]])
        let end = try watcher.receive()
        #expect(end["changes"] == [["key": "job/up", "old": true]] && end["lease"]?.objectValue?["end"] == "revoked")

        let missing = try obsctl(["hold", "svc", "x", "1", "--", "/nonexistent/command"], socket: d.socketPath)
        #expect(missing.status == 127 && missing.stderr.contains("cannot run /nonexistent/command"))
        #expect(try d.value("svc", "x") == nil)
        let killed = try obsctl(["hold", "svc", "x", "1", "--", "sh", "-c", "kill -TERM $$"], socket: d.socketPath)
        #expect(killed.status == 128 + SIGTERM, "killed by a signal: obsctl ends by the same one")
        let down = try obsctl(["hold", "svc", "x", "1"], socket: d.directory + "/none.sock")
        #expect(down.status == 69 && down.stderr.contains("cannot connect"))
    }

    @Test func holdRelaysSignalsToItsCommandAndReleasesWhenItExits() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let ready = d.directory + "/ready"
        let script = "trap 'exit 7' TERM; sleep 60 & p=$!; touch \(ready); wait $p; exit 1"
        let hold = try BackgroundObsctl(["hold", "svc", "w", "1", "--", "sh", "-c", script], socket: d.socketPath, directory: d.directory, name: "hold")
        #expect(eventually { FileManager.default.fileExists(atPath: ready) }, "the command runs: \(hold.stderr)")
        #expect(try d.value("svc", "w") == 1, "held while the command runs")
        hold.process.signal(SIGTERM)
        #expect(try hold.status() == 7, "the command trapped the relayed SIGTERM and exited 7")
        #expect(try d.value("svc", "w") == nil)
    }

    @Test func holdWithoutACommandEndsBySignalOrWithItsProcess() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        var events = session.watch("svc", selecting: .keys(["up"]), initial: true).makeAsyncIterator()
        guard case .snapshot(0, [:], false)? = try await events.next() else { throw TestFailure("expected an empty snapshot") }
        let hold = try BackgroundObsctl(["hold", "svc", "up", "{\"pid\":1}"], socket: d.socketPath, directory: d.directory, name: "hold")
        guard case .change(let created)? = try await events.next() else { throw TestFailure("expected the key's creation") }
        #expect(created.changes == [Change(key: "up", old: JSONValue?.none, new: ["pid": 1])])
        hold.process.signal(SIGTERM)
        #expect(try hold.status() == 128 + SIGTERM)
        guard case .change(let released)? = try await events.next() else { throw TestFailure("expected the key's deletion") }
        #expect(released.lease?.reason == .revoked)

        // SIGKILL: obsctl cannot release anything; its connection's end deletes the key, and
        // another client (this session) sees why.
        let killed = try BackgroundObsctl(["hold", "svc", "up", "2"], socket: d.socketPath, directory: d.directory, name: "killed")
        guard case .change(let again)? = try await events.next() else { throw TestFailure("expected the key again") }
        #expect(again.changes.first?.new == 2)
        killed.process.kill9()
        guard case .change(let closed)? = try await events.next() else { throw TestFailure("expected the deletion") }
        #expect(closed.changes == [Change(key: "up", old: 2, new: JSONValue?.none)] && closed.lease?.reason == .closed)
        await session.close()
    }

    @Test func waitReturnsAtOnceOrWhenTheConditionHoldsOrTimesOut() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let writer = try d.connect()
        #expect(try writer.call(["op": "set", "repo": "w", "key": "up", "value": ["port": 80]]).ok)
        let now = try obsctl(["wait", "w", "up"], socket: d.socketPath)
        #expect(now.status == 0 && now.stdout == "{\"port\":80}\n", "exists already: at once, printing the value")
        #expect(try obsctl(["wait", "w", "up", "--value", "{\"port\": 80.0}", "-q"], socket: d.socketPath).stdout.isEmpty)
        let timedOut = try obsctl(["wait", "w", "up", "--absent", "--timeout", "0.2"], socket: d.socketPath)
        #expect(timedOut.status == 124 && timedOut.stderr.contains("timed out"))
        #expect(try obsctl(["wait", "w", "up", "--absent", "--value", "1"], socket: d.socketPath).status == 64)
        #expect(try obsctl(["wait", "w", "up", "--value", "{bad"], socket: d.socketPath).status == 64)
        #expect(try obsctl(["wait", "w", "up", "--timeout", "-1"], socket: d.socketPath).status == 64)
        try d.waitForSubscriptions(0)

        let absent = try BackgroundObsctl(["wait", "w", "up", "--absent"], socket: d.socketPath, directory: d.directory, name: "absent")
        try d.waitForSubscriptions(1)
        let value = try BackgroundObsctl(["wait", "w", "mode", "--value", "dark"], socket: d.socketPath, directory: d.directory, name: "value")
        try d.waitForSubscriptions(2)
        #expect(try writer.call(["op": "set", "repo": "w", "key": "mode", "value": "light"]).ok)
        #expect(try writer.call(["op": "delete", "repo": "w", "key": "up"]).ok)
        #expect(try absent.status() == 0 && absent.stdout.isEmpty)
        #expect(value.process.isRunning, "light is not dark")
        #expect(try writer.call(["op": "set", "repo": "w", "key": "mode", "value": "dark"]).ok)
        #expect(try value.status() == 0 && value.stdout == "\"dark\"\n")
    }

    /// `obsctl wait` exits 0 once the key is written, and not before — run after run, each
    /// ending its connection before the next starts.
    @Test func waitReturnsOnceTheWriteIsMade() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let writer = try d.connect()
        for run in 1...5 {
            let wait = try BackgroundObsctl(["wait", "r", "k\(run)"], socket: d.socketPath, directory: d.directory, name: "wait\(run)")
            try d.waitForSubscriptions(1)
            #expect(wait.process.isRunning, "run \(run): waiting while the key is absent")
            #expect(try writer.call(["op": "set", "repo": "r", "key": .string("k\(run)"), "value": 1]).ok)
            #expect(try wait.status() == 0 && wait.stdout == "1\n", "run \(run)")
            try d.waitForSubscriptions(0)  // its connection's end reached the daemon: the next run starts clean
        }
    }

    @Test func watchShowsWhyAKeyWentAway() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let human = try BackgroundObsctl(["watch", "svc"], socket: d.socketPath, directory: d.directory, name: "human")
        let json = try BackgroundObsctl(["watch", "svc", "--json"], socket: d.socketPath, directory: d.directory, name: "json")
        try d.waitForSubscriptions(2)
        let holder = try d.connect()
        let lease = try #require(try holder.call(["op": "grant"])["lease"])
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "up", "value": true, "lease": lease]).ok)
        holder.close()
        #expect(try eventually { try d.value("svc", "up") == nil }, "the lease ended with its connection")
        #expect(try obsctl(["set", "svc", "t", "1", "--ttl", "1"], socket: d.socketPath).status == 0)
        // Both watchers print the fourth event in their own time: wait for each.
        #expect(eventually { human.stdout.components(separatedBy: "\n").count > 4 }, "\(human.stdout)")
        #expect(eventually { json.stdout.components(separatedBy: "\n").count > 4 }, "\(json.stdout)")
        #expect(human.stdout == "1  svc/up  (none) → true\n2  svc/up  true → (closed)\n3  svc/t  (none) → 1\n4  svc/t  1 → (expired)\n")
        let lines = json.stdout.split(separator: "\n").map { try? JSONParser.parse(String($0)).objectValue }
        #expect(lines.count == 4 && lines[1]?["lease"] == ["id": lease, "end": "closed"] && lines[1]?["new"] == nil)
        #expect(lines[0]?["lease"] == nil)
        human.process.kill9()
        json.process.kill9()
    }
}
