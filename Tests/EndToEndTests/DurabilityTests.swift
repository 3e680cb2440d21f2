// End-to-end durability: what obsd acknowledged survives restarts and kill -9; history
// resumes across restarts; damaged or foreign files stop it with a clear error; storage
// failures fail the affected writes, keep reads and subscriptions working, and heal.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.serialized, .timeLimit(.minutes(5))) struct DurabilityTests {
    @Test func restartKeepsValuesRevisionsAndHistory() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        _ = try c.call(["op": "set", "repo": "ui", "key": "theme", "value": "light"])  // 1
        _ = try c.call(["op": "batch", "repo": "ui", "ops": [["op": "set", "key": "lang", "value": "fr"], ["op": "set", "key": "n", "value": nil]]])  // 2
        _ = try c.call(["op": "set", "repo": "ui", "key": "theme", "value": "dark"])  // 3
        _ = try c.call(["op": "delete", "repo": "ui", "key": "lang"])  // 4
        _ = try c.call(["op": "set", "repo": "other", "key": "k", "value": ["a": [1, 2]]])  // other: 1
        let listBefore = try c.call(["op": "list", "repo": "ui", "values": true]).withoutID
        let reposBefore = try c.call(["op": "repos"]).withoutID

        for restart in ["graceful", "kill -9"] {
            if restart == "graceful" { #expect(d.stop() == 0) } else { d.kill9() }
            try await d.launch()
            let r = try d.connect()
            #expect(try r.call(["op": "list", "repo": "ui", "values": true]).withoutID == listBefore, "\(restart)")
            #expect(try r.call(["op": "repos"]).withoutID == reposBefore, "\(restart)")
            let theme = try r.call(["op": "get", "repo": "ui", "key": "theme"])
            #expect(theme["value"] == "dark" && theme["rev"] == 3, "key revisions survive \(restart)")
            #expect(try r.call(["op": "get", "repo": "ui", "key": "n"])["rev"] == 2)
            // since across the restart replays exactly the missed changes, then goes live.
            let sub = try r.call(["op": "subscribe", "repo": "ui", "since": 1])
            #expect(sub["rev"] == 4)
            #expect(try r.receive()["changes"] == [["key": "lang", "new": "fr"], ["key": "n", "new": nil]])
            #expect(try r.receive()["changes"] == [["key": "theme", "old": "light", "new": "dark"]])
            #expect(try r.receive()["changes"] == [["key": "lang", "old": "fr"]])
            #expect(try r.receive()["event"] == "synced")
        }
        // New writes continue the revision sequence.
        let r = try d.connect()
        #expect(try r.call(["op": "set", "repo": "ui", "key": "theme", "value": "blue"])["rev"] == 5)
    }

    @Test func killNineNeverLosesAnAcknowledgedWrite() async throws {
        let d = try await TestDaemon.start()
        var acknowledged: [Key: (value: Int64, rev: UInt64)] = [:]
        for round in 0..<5 {
            let acks = try await writeUntilKilled(d, round: round, writers: 4, inFlight: 16)
            #expect(acks.count >= 200, "round \(round) wrote something")
            acknowledged.merge(acks) { $1 }
            try await d.launch()
            let client = try await ObsClient.connect(socketPath: d.socketPath)
            let listing = try await client.list("k", values: true)
            var missing = 0
            for (key, ack) in acknowledged {
                guard let value = listing.values?[key], value == .int(ack.value) else {
                    missing += 1
                    continue
                }
                #expect(try await client.get("k", key)?.revision == ack.rev)
            }
            #expect(missing == 0, "round \(round): \(missing) acknowledged writes lost")
            await client.close()
        }
    }

    @Test func aGracefulStopUnderLoadAnswersWhatItMadeDurableAndExitsZero() async throws {
        // SIGTERM while writes pipeline in: requests stop being taken, storage makes durable
        // what it holds, those replies reach their clients, then the daemon exits 0.
        let d = try await TestDaemon.start()
        let (acks, errors) = try await writeUntilStopped(d, round: 0, writers: 4, inFlight: 16) { $0.signal(SIGTERM) }
        #expect(await d.waitForExit(timeout: .seconds(20)) == 0, "the daemon stopped, exit 0")
        #expect(errors.isEmpty, "no write was refused or failed at shutdown: \(errors.prefix(3))")
        #expect(acks.count >= 400)
        try await d.launch()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        let listing = try await client.list("k", values: true)
        #expect(acks.allSatisfy { listing.values?[$0.key] == .int($0.value.value) }, "every acknowledged write is kept")
        let unanswered = listing.keys.filter { acks[$0] == nil }
        #expect(unanswered.isEmpty, "\(unanswered.count) writes became durable at shutdown but their replies never reached the client")
        await client.close()
    }

    @Test func relaxedSyncLosesNothingWhenOnlyTheProcessDies() async throws {
        let d = try await TestDaemon.start(["--sync", "relaxed", "--sync-interval", "1000"])
        let acks = try await writeUntilKilled(d, round: 0, writers: 4, inFlight: 16)
        try await d.launch()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        let listing = try await client.list("k", values: true)
        #expect(acks.allSatisfy { listing.values?[$0.key] == .int($0.value.value) })
        let stats = try await client.stats()
        #expect(stats["storage"]?.stringValue?.contains("relaxed (1000 ms)") == true)
        await client.close()
    }

    @Test func historyRetentionHoldsAcrossRestarts() async throws {
        let d = try await TestDaemon.start(["--history-limit", "5"])
        let c = try d.connect()
        for i in 1...20 { _ = try c.call(["op": "set", "repo": "h", "key": "k", "value": .int(Int64(i))]) }
        d.kill9()
        try await d.launch()
        let r = try d.connect()
        #expect(try r.call(["op": "subscribe", "repo": "h", "since": 14]).errorCode == "compacted")
        #expect(try r.call(["op": "subscribe", "repo": "h", "since": 15]).ok)
        #expect((16...20).map { _ in (try? r.receive())?["rev"] } == [16, 17, 18, 19, 20])
    }

    @Test func historyExpiresByAge() async throws {
        let d = try await TestDaemon.start(["--history-max-age", "1"])
        let c = try d.connect()
        for i in 1...3 { _ = try c.call(["op": "set", "repo": "a", "key": "k", "value": .int(Int64(i))]) }
        #expect(try c.call(["op": "subscribe", "repo": "a", "since": 0]).ok)
        // Wait (bounded) for the records to age out, then for a restart to agree.
        let deadline = ContinuousClock.now + .seconds(20)
        var code: String? = nil
        while code != "compacted", ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(200))
            code = try d.connect().call(["op": "subscribe", "repo": "a", "since": 0]).errorCode
        }
        #expect(code == "compacted")
        #expect(d.stop() == 0)
        try await d.launch()
        #expect(try d.connect().call(["op": "subscribe", "repo": "a", "since": 0]).errorCode == "compacted")
        #expect(try d.connect().call(["op": "get", "repo": "a", "key": "k"])["value"] == 3, "values do not expire")
    }

    @Test func damagedOrForeignFilesStopTheDaemonWithAClearError() async throws {
        let d = try await TestDaemon.start()
        _ = try d.connect().call(["op": "set", "repo": "r", "key": "k", "value": 1])
        #expect(d.stop() == 0)
        let db = d.dataDirectory! + "/obsd.db"
        let original = try Data(contentsOf: URL(fileURLWithPath: db))

        // Garbage.
        try Data(repeating: 0x5A, count: 8192).write(to: URL(fileURLWithPath: db))
        var result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains(db) && result.stderr.contains("not an obsd database or is damaged"), "\(result.stderr)")

        // Truncated.
        try original.prefix(original.count / 2).write(to: URL(fileURLWithPath: db))
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains(db), "\(result.stderr)")

        // A healthy SQLite database of some other program.
        try? FileManager.default.removeItem(atPath: db)
        let foreign = try run("/usr/bin/env", ["python3", "-c", "import sqlite3; c = sqlite3.connect('\(db)'); c.execute('create table t(x)'); c.commit()"])
        #expect(foreign.status == 0)
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(db) is not an obsd database"), "\(result.stderr)")
    }

    @Test func tornWALTailIsDiscarded() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        for i in 1...50 { _ = try c.call(["op": "set", "repo": "t", "key": .string("k\(i % 7)"), "value": .int(Int64(i))]) }
        d.kill9()
        let wal = d.dataDirectory! + "/obsd.db-wal"
        let size = try FileManager.default.attributesOfItem(atPath: wal)[.size] as? Int ?? 0
        #expect(size > 1000)
        #expect(truncate(wal, off_t(size - 100)) == 0)
        try await d.launch()
        let r = try d.connect()
        let rev = try r.call(["op": "list", "repo": "t"])["rev"]?.uint64Value ?? 0
        #expect(rev >= 40 && rev < 50, "only the torn last commit is lost (revision \(rev))")
        // The state is the exact prefix: replay from 0 is contiguous and ends at rev.
        _ = try r.call(["op": "subscribe", "repo": "t", "since": 0])
        var revisions: [UInt64] = []
        while true {
            let m = try r.receive()
            if m["event"] == "synced" { break }
            revisions.append(m["rev"]?.uint64Value ?? 0)
        }
        #expect(revisions == Array(1...rev))
        #expect(try r.call(["op": "set", "repo": "t", "key": "new", "value": 1])["rev"] == .number(rev + 1))
    }

    @Test(arguments: ["commit readonly", "commit io", "commit full"])
    func storageFailuresFailTheWritesAndHeal(_ fault: String) async throws {
        let faultFile = TestDaemon.makeTemporaryDirectory() + "/fault"
        let d = try await TestDaemon.start(environment: ["OBSD_FAULT_FILE": faultFile])
        let c = try d.connect()
        let watcher = try d.connect()
        _ = try watcher.call(["op": "subscribe", "repo": "f"])
        _ = try c.call(["op": "set", "repo": "f", "key": "a", "value": 1])  // 1
        #expect(try watcher.receive()["rev"] == 1)

        try fault.write(toFile: faultFile, atomically: true, encoding: .utf8)
        // Pipelined writes during the failure all fail, with a message naming the cause; reads
        // between them never show a value that was undone.
        for i in 0..<40 {
            try c.request(["op": "set", "repo": "f", "key": "a", "value": .int(Int64(10 + i))])
            try c.request(["op": "get", "repo": "f", "key": "a"])
        }
        for i in 0..<80 {
            let reply = try c.receive()
            if i % 2 == 0 {
                #expect(reply.errorCode == "internal")
                #expect(reply["error"]?.objectValue?["message"]?.stringValue?.contains("injected fault") == true)
            } else {
                #expect(reply.errorCode == "internal" || reply["value"] == 1, "a read showed \(reply)")
            }
        }
        // Reads still work and see no trace of the failed writes.
        let a = try c.call(["op": "get", "repo": "f", "key": "a"])
        #expect(a["value"] == 1 && a["rev"] == 1)
        #expect(try c.call(["op": "stats"])["storageFailures"]?.uint64Value ?? 0 >= 1)

        try FileManager.default.removeItem(atPath: faultFile)
        // Writes succeed again, continuing the revision sequence; the watcher sees only real revisions.
        #expect(try c.call(["op": "set", "repo": "f", "key": "a", "value": 2])["rev"] == 2)
        let event = try watcher.receive()
        #expect(event["rev"] == 2 && event["changes"] == [["key": "a", "old": 1, "new": 2]])
        d.kill9()
        try await d.launch()
        #expect(try d.connect().call(["op": "get", "repo": "f", "key": "a"])["rev"] == 2)
    }

    @Test func aCommitThatReachedTheFileDespiteAnErrorIsAcknowledged() async throws {
        let faultFile = TestDaemon.makeTemporaryDirectory() + "/fault"
        let d = try await TestDaemon.start(environment: ["OBSD_FAULT_FILE": faultFile])
        let c = try d.connect()
        try "after-commit".write(toFile: faultFile, atomically: true, encoding: .utf8)
        let reply = try c.call(["op": "set", "repo": "g", "key": "k", "value": 1])
        #expect(reply.ok && reply["rev"] == 1, "the file holds it, so it is durable")
        try FileManager.default.removeItem(atPath: faultFile)
        d.kill9()
        try await d.launch()
        #expect(try d.connect().call(["op": "get", "repo": "g", "key": "k"])["value"] == 1)
    }

    @Test(.enabled(if: Tmpfs.available, "needs root and permission to mount tmpfs"))
    func diskFullFailsWritesThenHeals() async throws {
        let mount = try Tmpfs(megabytes: 4)
        defer { mount.unmount() }
        let d = try await TestDaemon.start(dataDirectory: mount.path + "/data")
        let c = try d.connect()
        let watcher = try d.connect()
        _ = try watcher.call(["op": "subscribe", "repo": "disk"])
        _ = try c.call(["op": "set", "repo": "disk", "key": "small", "value": "kept"])
        #expect(try watcher.receive()["rev"] == 1)

        // Fill the file system, then write until storage refuses.
        let filler = mount.path + "/filler"
        _ = try? run("/bin/dd", ["if=/dev/zero", "of=\(filler)", "bs=64k"])
        let big = JSONValue.string(String(repeating: "x", count: 200_000))
        var failure: JSONObject? = nil
        for i in 0..<40 {
            let reply = try c.call(["op": "set", "repo": "disk", "key": .string("big\(i)"), "value": big])
            if !reply.ok {
                failure = reply
                break
            }
        }
        #expect(failure?.errorCode == "internal")
        #expect(failure?["error"]?.objectValue?["message"]?.stringValue?.contains("full") == true, "\(String(describing: failure))")
        let before = try c.call(["op": "get", "repo": "disk", "key": "small"])
        #expect(before["value"] == "kept")
        let rev = try c.call(["op": "list", "repo": "disk"])["rev"]?.uint64Value ?? 0

        // Free the space: writes succeed again and continue the sequence.
        try FileManager.default.removeItem(atPath: filler)
        let after = try c.call(["op": "set", "repo": "disk", "key": "small", "value": "again"])
        #expect(after.ok && after["rev"] == .number(rev + 1))
        var last: UInt64 = 0
        while last < rev + 1 { last = try watcher.receive()["rev"]?.uint64Value ?? 0 }
        #expect(last == rev + 1, "the watcher sees a gap-free sequence")
        #expect(d.stop() == 0)
        try await d.launch()
        #expect(try d.connect().call(["op": "get", "repo": "disk", "key": "small"])["value"] == "again")
    }
}

/// Writes keys `w<n>/<round>/<i>` = i from `writers` connections with `inFlight` writes
/// each until the daemon is killed (after at least 400 acknowledgements); returns what was
/// acknowledged.
func writeUntilKilled(_ d: TestDaemon, round: Int, writers: Int, inFlight: Int) async throws -> [Key: (value: Int64, rev: UInt64)] {
    try await writeUntilStopped(d, round: round, writers: writers, inFlight: inFlight) { $0.kill9() }.acks
}

/// Writes from `writers` connections with `inFlight` writes each until `stop` ends the
/// daemon (once 400 are acknowledged); the acknowledged writes, and the error replies seen.
func writeUntilStopped(
    _ d: TestDaemon, round: Int, writers: Int, inFlight: Int, stop: @escaping @Sendable (TestDaemon) -> Void
) async throws -> (acks: [Key: (value: Int64, rev: UInt64)], errors: [String]) {
    let acks = Locked<[Key: (value: Int64, rev: UInt64)]>([:])
    let errors = Locked<[String]>([])
    let clients = try await (0..<writers).asyncMap { _ in try await ObsClient.connect(socketPath: d.socketPath) }
    await withTaskGroup(of: Void.self) { group in
        for (w, client) in clients.enumerated() {
            for lane in 0..<inFlight {
                group.addTask {
                    var i = Int64(lane)
                    while true {
                        let key = Key("w\(w)/\(round)/\(i)")
                        do throws(ObsClientError) {
                            let reply = try await client.set("k", key, .int(i))
                            acks.withLock { $0[key] = (i, reply.revision) }
                        } catch .server(let error) {
                            errors.withLock { $0.append(error.description) }
                            return
                        } catch {
                            return  // the connection ended
                        }
                        i += Int64(inFlight)
                    }
                }
            }
        }
        group.addTask {
            while acks.withLock({ $0.count }) < 400 { try? await Task.sleep(for: .milliseconds(1)) }
            stop(d)
        }
    }
    for client in clients { await client.close() }
    return (acks.withLock { $0 }, errors.withLock { $0 })
}

/// A size-limited tmpfs mounted for one test.
struct Tmpfs {
    let path: String

    static var available: Bool {
        guard getuid() == 0, let probe = try? Tmpfs(megabytes: 1) else { return false }
        probe.unmount()
        return true
    }

    init(megabytes: Int) throws {
        path = TestDaemon.makeTemporaryDirectory()
        let result = try run("/bin/mount", ["-t", "tmpfs", "-o", "size=\(megabytes)m", "tmpfs", path])
        guard result.status == 0 else { throw TestFailure("mount tmpfs: \(result.stderr)") }
    }

    func unmount() {
        _ = try? run("/bin/umount", ["-l", path])
        try? FileManager.default.removeItem(atPath: path)
    }
}
