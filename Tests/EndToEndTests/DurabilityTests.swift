// End-to-end durability: what obsd acknowledged survives restarts and kill -9; history
// resumes across restarts; damaged or foreign files stop it with a clear error; storage
// failures fail the affected writes, keep reads and subscriptions working, and heal.

import Foundation
import ObsClient
import ObsProtocol
import ObsStore
import ObservableKit
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .serialized, .timeLimit(.minutes(5))) struct DurabilityTests {
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
            if restart == "graceful" { #expect(await d.stop() == 0) } else { d.kill9() }
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
            let client = try await ObsConnection.connect(socketPath: d.socketPath)
            let listing = try await client.list("k", includingValues: true)
            let values = listing.values ?? [:]  // (built on each read of `values`: read once)
            var missing = 0
            for (key, ack) in acknowledged {
                guard let value = values[key], value == .int(ack.value) else {
                    missing += 1
                    continue
                }
                #expect(try await client.get(key, in: "k")?.revision == ack.rev)
            }
            #expect(missing == 0, "round \(round): \(missing) acknowledged writes lost")
            await client.close()
        }
    }

    @Test func killsAtRandomPointsOfCommitsNeitherLoseNorInventWrites() async throws {
        // Each round kills the daemon at a random moment while 64 writes are in flight — in
        // the middle of a group's write, its fsync, a checkpoint, a segment roll-over.
        let d = try await TestDaemon.start()
        var acknowledged: [Key: (value: Int64, rev: UInt64)] = [:]
        for round in 0..<12 {
            let delay = UInt32.random(in: 0..<25_000)
            let (acks, _) = try await writeUntilStopped(d, round: round, writers: 4, inFlight: 16) { daemon in
                usleep(delay)
                daemon.kill9()
            }
            acknowledged.merge(acks) { $1 }
            try await d.launch()
            let client = try await ObsConnection.connect(socketPath: d.socketPath)
            let listing = try await client.list("k", includingValues: true)
            let values = listing.values ?? [:]  // (built on each read of `values`: read once)
            let lost = acknowledged.filter { values[$0.key] != .int($0.value.value) }
            #expect(lost.isEmpty, "round \(round) (kill after \(delay) µs): \(lost.count) acknowledged writes lost")
            // Every write adds one key: a revision per key means no revision was lost from
            // the middle or replayed twice.
            #expect(listing.revision == UInt64(listing.keys.count), "round \(round): revision \(listing.revision), \(listing.keys.count) keys")
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
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        let listing = try await client.list("k", includingValues: true)
        let values = listing.values ?? [:]  // (built on each read of `values`: read once)
        #expect(acks.allSatisfy { values[$0.key] == .int($0.value.value) }, "every acknowledged write is kept")
        let unanswered = listing.keys.filter { acks[$0] == nil }
        #expect(unanswered.isEmpty, "\(unanswered.count) writes became durable at shutdown but their replies never reached the client")
        await client.close()
    }

    @Test func relaxedSyncLosesNothingWhenOnlyTheProcessDies() async throws {
        let d = try await TestDaemon.start(["--sync", "relaxed", "--sync-interval", "1000"])
        let acks = try await writeUntilKilled(d, round: 0, writers: 4, inFlight: 16)
        try await d.launch()
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        let listing = try await client.list("k", includingValues: true)
        let values = listing.values ?? [:]  // (built on each read of `values`: read once)
        #expect(acks.allSatisfy { values[$0.key] == .int($0.value.value) })
        let stats = try await client.statistics()
        #expect(stats.storage?.contains("relaxed (1000 ms)") == true)
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
        #expect(await d.stop() == 0)
        try await d.launch()
        #expect(try d.connect().call(["op": "subscribe", "repo": "a", "since": 0]).errorCode == "compacted")
        #expect(try d.connect().call(["op": "get", "repo": "a", "key": "k"])["value"] == 3, "values do not expire")
    }

    @Test func damagedForeignTornOrMissingFilesStopTheDaemonWithAClearError() async throws {
        let d = try await TestDaemon.start()
        _ = try d.connect().call(["op": "set", "repo": "r", "key": "k", "value": 1])
        #expect(await d.stop() == 0)
        let snapshot = d.dataDirectory! + "/obsd.snapshot"
        let original = try Data(contentsOf: URL(fileURLWithPath: snapshot))

        // Garbage: not a snapshot at all.
        try Data(repeating: 0x5A, count: 8192).write(to: URL(fileURLWithPath: snapshot))
        var result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(snapshot) is not an obsd snapshot"), "\(result.stderr)")

        // Truncated: torn.
        try original.prefix(original.count - 10).write(to: URL(fileURLWithPath: snapshot))
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(snapshot) is torn"), "\(result.stderr)")

        // A byte flipped inside: damaged, with the offset of its block.
        var flipped = original
        // The last byte of the last entry, before the repository's 24-byte TOMB block (no
        // tombstone), the 24-byte LEAS block (no lease) and the 32-byte end block.
        flipped[flipped.count - 81] ^= 0x01
        try flipped.write(to: URL(fileURLWithPath: snapshot))
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(snapshot) is damaged") && result.stderr.contains("ENTR block at offset"), "\(result.stderr)")

        // Gone, while the log it is the base of is there.
        try FileManager.default.removeItem(atPath: snapshot)
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(snapshot) is missing"), "\(result.stderr)")

        // An earlier obsd's database that is another program's SQLite file.
        let db = d.dataDirectory! + "/obsd.db"
        let foreign = try run("/usr/bin/env", ["python3", "-c", "import sqlite3; c = sqlite3.connect('\(db)'); c.execute('create table t(x)'); c.commit()"])
        #expect(foreign.status == 0)
        result = try d.runToCompletion()
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(db) is not an obsd database"), "\(result.stderr)")

        // The snapshot back in place: the daemon starts, with the value.
        try FileManager.default.removeItem(atPath: db)
        try original.write(to: URL(fileURLWithPath: snapshot))
        try await d.launch()
        #expect(try d.connect().call(["op": "get", "repo": "r", "key": "k"])["value"] == 1)
    }

    /// A record damaged in the middle of the log: the daemon refuses to start, naming it and
    /// the repair; `obsd --repair-log` cuts the log there, and the daemon starts with the
    /// state before it, in a new epoch.
    @Test func aDamagedLogIsRefusedThenRepairedByTheOperator() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        for i in 1...20 { _ = try c.call(["op": "set", "repo": "t", "key": .string("k\(i)"), "value": .int(Int64(i))]) }
        let epoch = try #require(try c.call(["op": "list", "repo": "t"])["epoch"]?.stringValue)
        d.kill9()
        _ = await d.waitForExit()
        let wal = d.dataDirectory! + "/wal"
        let segment = wal + "/" + (try FileManager.default.contentsOfDirectory(atPath: wal).filter { $0.hasSuffix(".wal") }.sorted().last!)
        // A byte flipped in revision 10's record, with ten records after it.
        let starts = try walRecordStarts(segment)
        try #require(starts.count == 20)
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: segment))
        try file.seek(toOffset: UInt64(starts[9] + 12))
        let byte = try #require(try file.read(upToCount: 1)?.first)
        try file.seek(toOffset: UInt64(starts[9] + 12))
        try file.write(contentsOf: Data([byte ^ 0x40]))
        try file.close()

        let refused = try d.runToCompletion()
        #expect(refused.status != 0)
        #expect(
            refused.stderr.contains("\(segment): damaged record at offset \(starts[9])") && refused.stderr.contains("--repair-log"), "\(refused.stderr)")

        let repair = try run(BuildProducts.path("obsd"), ["--repair-log", "--data-dir", d.dataDirectory!])
        #expect(repair.status == 0, "\(repair.stderr)")
        #expect(repair.stdout.contains("repaired the write-ahead log") && repair.stdout.contains("offset \(starts[9])"), "\(repair.stdout)")
        let again = try run(BuildProducts.path("obsd"), ["--repair-log", "--data-dir", d.dataDirectory!])
        #expect(again.status == 0 && again.stdout.contains("nothing was cut"), "\(again.stdout)")

        try await d.launch()
        let r = try d.connect()
        let listed = try r.call(["op": "list", "repo": "t"])
        #expect(listed["rev"] == 9, "revisions 10 to 20 are gone")
        #expect(try d.value("t", "k9") == 9)
        #expect(listed["epoch"]?.stringValue != epoch && listed["epoch"]?.stringValue != nil, "a new epoch: no client resumes across the cut")
        #expect(try r.call(["op": "set", "repo": "t", "key": "after", "value": 1]).ok)
    }

    /// Acknowledged writes (`sync = always`) the log lost outside obsd after a kill -9 — its
    /// segment cut in half, or removed — are never numbered again in the same epoch: the daemon
    /// refuses to start, naming the file and `--repair-log` (before: it started at an earlier
    /// revision in the same epoch, the next write reusing a number a client had seen);
    /// repaired, it starts in a new epoch, and a client resuming from the old one is told to
    /// resync.
    @Test(arguments: ["cut in half", "removed"])
    func acknowledgedWritesTheLogLostAreNeverNumberedAgainInTheSameEpoch(_ loss: String) async throws {
        let d = try await TestDaemon.start(["--sync", "always"])
        let c = try d.connect()
        for i in 1...100 { _ = try c.call(["op": "set", "repo": "a", "key": .string("k\(i % 9)"), "value": .int(Int64(i))]) }
        let before = try c.call(["op": "list", "repo": "a"])
        #expect(before["rev"] == 100)
        let epoch = try #require(before["epoch"]?.stringValue)
        d.kill9()
        _ = await d.waitForExit()
        let wal = d.dataDirectory! + "/wal"
        let segment = wal + "/" + (try FileManager.default.contentsOfDirectory(atPath: wal).filter { $0.hasSuffix(".wal") }.sorted().last!)
        if loss == "removed" {
            try FileManager.default.removeItem(atPath: segment)
        } else {
            #expect(truncate(segment, off_t(try lastFrame(segment).end / 2)) == 0)
        }

        let refused = try d.runToCompletion()
        #expect(refused.status != 0)
        let named = loss == "removed" ? wal : segment
        #expect(refused.stderr.contains(named) && refused.stderr.contains("obsd --repair-log"), "\(refused.stderr)")

        let repair = try run(BuildProducts.path("obsd"), ["--repair-log", "--data-dir", d.dataDirectory!])
        #expect(repair.status == 0, "\(repair.stderr)")
        #expect(repair.stdout.contains("repaired the write-ahead log") && repair.stdout.contains(named), "\(repair.stdout)")
        try await d.launch()
        let r = try d.connect()
        let after = try r.call(["op": "list", "repo": "a"])
        let rev = after["rev"]?.uint64Value ?? 0
        #expect(rev < 100, "revisions were lost (revision \(rev))")
        #expect(after["epoch"]?.stringValue != epoch, "a new epoch: \(after)")
        #expect(try r.call(["op": "subscribe", "repo": "a", "since": 100, "epoch": .string(epoch)]).errorCode == "compacted")
        #expect(try r.call(["op": "set", "repo": "a", "key": "next", "value": 1])["rev"] == .number(rev + 1))
    }

    @Test func aTornWriteAtTheEndOfTheLogIsCutOff() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        for i in 1...50 { _ = try c.call(["op": "set", "repo": "t", "key": .string("k\(i % 7)"), "value": .int(Int64(i))]) }
        d.kill9()
        // Tear the last record: keep its first bytes only, as a crash in mid-write would.
        let wal = d.dataDirectory! + "/wal"
        let segment = wal + "/" + (try FileManager.default.contentsOfDirectory(atPath: wal).filter { $0.hasSuffix(".wal") }.sorted().last!)
        let (start, end) = try lastFrame(segment)
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: segment))
        try file.seek(toOffset: UInt64(start + 12))
        try file.write(contentsOf: Data(count: end - start - 12))
        try file.close()
        try await d.launch()
        #expect(d.log.contains("cut ") && d.log.contains("torn write"), "\(d.log)")
        let r = try d.connect()
        let rev = try r.call(["op": "list", "repo": "t"])["rev"]?.uint64Value ?? 0
        #expect(rev == 49 || rev == 50, "only the torn last write is lost, unless the compacted state already held it (revision \(rev))")
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

    // `.outcomeUnknown` (a failed write the log could not undo) stops a real store until a
    // restart; here it only checks what the replies say: never "undone".
    @Test(arguments: [StorageError.Kind.readOnly, .io, .full, .outcomeUnknown])
    func storageFailuresFailTheWritesAndHeal(_ kind: StorageError.Kind) async throws {
        let directory = TestDaemon.makeTemporaryDirectory()
        let storage = try FailingStorage(directory: directory)
        let d = try await InProcessDaemon.start(storage: storage)
        let c = try d.connect()
        let watcher = try d.connect()
        _ = try watcher.call(["op": "subscribe", "repo": "f"])
        _ = try c.call(["op": "set", "repo": "f", "key": "a", "value": 1])  // 1
        #expect(try watcher.receive()["rev"] == 1)

        storage.fail(with: StorageError(kind, "test: the disk fails (\(kind))"))
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
                let message = reply["error"]?.objectValue?["message"]?.stringValue ?? ""
                #expect(message.contains("the disk fails"), "\(reply)")
                #expect(message.contains("undone") == (kind != .outcomeUnknown) && message.contains("outcome is unknown") == (kind == .outcomeUnknown), "\(message)")
            } else {
                #expect(reply.errorCode == "internal" || reply["value"] == 1, "a read showed \(reply)")
            }
        }
        // Reads still work and see no trace of the failed writes.
        let a = try c.call(["op": "get", "repo": "f", "key": "a"])
        #expect(a["value"] == 1 && a["rev"] == 1)
        #expect(try c.call(["op": "stats"])["storageFailures"]?.uint64Value ?? 0 >= 1)

        storage.fail(with: nil)
        // Writes succeed again, continuing the revision sequence; the watcher sees only real revisions.
        #expect(try c.call(["op": "set", "repo": "f", "key": "a", "value": 2])["rev"] == 2)
        let event = try watcher.receive()
        #expect(event["rev"] == 2 && event["changes"] == [["key": "a", "old": 1, "new": 2]])
        c.close()
        watcher.close()
        try await d.stop()
        let again = try await InProcessDaemon.start(storage: try FailingStorage(directory: directory))
        #expect(try again.connect().call(["op": "get", "repo": "f", "key": "a"])["rev"] == 2)
        try await again.stop()
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
        #expect(await d.stop() == 0)
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
    let clients = try await (0..<writers).asyncMap { _ in try await ObsConnection.connect(socketPath: d.socketPath) }
    await withTaskGroup(of: Void.self) { group in
        for (w, client) in clients.enumerated() {
            for lane in 0..<inFlight {
                group.addTask {
                    var i = Int64(lane)
                    while true {
                        let key = Key("w\(w)/\(round)/\(i)")
                        do throws(ObsClientError) {
                            let reply = try await client.set(key, to: .int(i), in: "k")
                            acks.withLock { $0[key] = (i, reply.revision) }
                        } catch where error.serverError != nil {
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

/// Where the last frame of a log segment's log starts and ends (frames: u32 length, u32 CRC,
/// payload, zero padding to 8 bytes; after the segment's header, up to the frame that names
/// the next segment).
func lastFrame(_ path: String) throws -> (start: Int, end: Int) {
    let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
    var at = walHeaderSize(bytes)
    var last = (at, at)
    while at + 8 <= bytes.count {
        let length = Int(bytes[at]) | Int(bytes[at + 1]) << 8 | Int(bytes[at + 2]) << 16 | Int(bytes[at + 3]) << 24
        if length == 0 || (length == 9 && at + 8 < bytes.count && bytes[at + 8] == 0xFE) { break }
        last = (at, (at + 8 + length + 7) & ~7)
        at = last.1
    }
    return last
}
