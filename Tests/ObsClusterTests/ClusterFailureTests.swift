// ObsClusterTests, failures: etcd losing its quorum, its leader killed under a write loop,
// a daemon killed -9 and restarted, and an etcd compaction.

import ObsClient
import ObsEtcd
import ObsProtocol
import ObservableKit
import Synchronization
import Testing
import TestSupport

extension ClusterTests {
    @Test func withTwoOfThreeMembersStoppedAWriteErrorsWithinTenSecondsAndSucceedsOnceTheyReturn() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let log = EventLog(try await b.subscribe(to: "q"))
        #expect(try await a.set("k", to: int(1), in: "q").revision == 1)
        #expect(await log.wait(forRevision: 1), "\(pair.diagnostics)")

        pair.etcd.stop(1)
        pair.etcd.stop(2)
        let started = ContinuousClock.now
        let failed = await refusal { () async throws(ObsClientError) in try await a.set("k", to: int(2), in: "q") }
        let took = ContinuousClock.now - started
        #expect(failed?.code == .internalError, "a write without quorum: \(String(describing: failed))")
        #expect(took < .seconds(10), "the error reply took \(took)")
        print("ClusterTests: without quorum, a write's error reply came after \(took): \(failed.map { "\($0)" } ?? "none")")
        // Reads are answered from the state the daemon holds, quickly.
        let readStarted = ContinuousClock.now
        let read = try await b.get("k", in: "q")
        #expect(read?.value == int(1) || read?.value == int(2))
        #expect(ContinuousClock.now - readStarted < .seconds(2), "a read without quorum took \(ContinuousClock.now - readStarted)")

        try pair.etcd.restart(1)
        try pair.etcd.restart(2)
        #expect(await pair.etcd.waitHealthy(timeout: .seconds(30)), "\(pair.etcd.diagnostics())")
        // The first write once the quorum is back succeeds (the loop guards against a member
        // that is healthy to /health a moment before obsd's connection to it is).
        var reply: WriteReply<JSONValue>? = nil
        var errors: [String] = []
        let deadline = ContinuousClock.now + .seconds(20)
        while reply == nil && ContinuousClock.now < deadline {
            do throws(ObsClientError) {
                reply = try await a.set("k", to: int(3), in: "q")
            } catch {
                errors.append("\(error)")
            }
        }
        guard let reply else {
            Issue.record("no write succeeded after the quorum came back: \(errors)\n\(pair.diagnostics)")
            return
        }
        print("ClusterTests: after the quorum came back, \(errors.count) write(s) failed before one succeeded")
        #expect(errors.count <= 1, "writes failed after the quorum was back: \(errors)")
        // The subscription stayed open and continues with no gap (the write that failed may
        // have been applied after all: its outcome was reported unknown, or not at all).
        #expect(await log.wait(forRevision: reply.revision), "\(pair.diagnostics)")
        #expect(log.failure == nil)
        #expect(log.changes.map(\.revision) == Array(1...reply.revision))
        #expect(log.changes.last?.changes.first?.new == int(3))
    }

    @Test func theLeaderKilledMidWriteLoopLosesNoAcknowledgedWriteAndBsStreamStaysDense() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let etcd = try pair.etcdClient()
        defer { Task { await etcd.shutdown() } }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let log = EventLog(try await b.subscribe(to: "load"))

        var acknowledged: [(i: Int, revision: UInt64)] = []
        var failures: [String] = []
        var killed: Int? = nil
        var acknowledgedAtKill = 0
        let deadline = ContinuousClock.now + .seconds(60)
        var i = 0
        while ContinuousClock.now < deadline && (killed == nil || acknowledged.count < acknowledgedAtKill + 30) {
            i += 1
            do throws(ObsClientError) {
                let reply = try await a.set(Key("k\(i)"), to: int(i), in: "load")
                acknowledged.append((i, reply.revision))
            } catch {
                failures.append("write \(i): \(error)")
            }
            if killed == nil && acknowledged.count == 30 {
                guard let leader = await pair.leader(using: etcd) else {
                    Issue.record("no etcd leader found")
                    return
                }
                pair.etcd.kill(leader)
                killed = leader
                acknowledgedAtKill = acknowledged.count
            }
        }
        #expect(killed != nil && acknowledged.count >= acknowledgedAtKill + 30, "writes after the kill: \(failures)")
        print("ClusterTests: leader m\(killed ?? -1) killed after \(acknowledgedAtKill) writes; \(acknowledged.count) acknowledged, \(failures.count) failed: \(failures)")
        if let killed {
            try pair.etcd.restart(killed)
            #expect(await pair.etcd.waitHealthy(timeout: .seconds(30)), "\(pair.etcd.diagnostics())")
        }
        let revisions = acknowledged.map(\.revision)
        #expect(Set(revisions).count == revisions.count && revisions == revisions.sorted(), "acknowledged revisions: \(revisions)")
        let last = revisions.last ?? 0

        // Every acknowledged write is readable through B, at its revision in B's stream.
        #expect(await log.wait(forRevision: last), "\(pair.diagnostics)")
        let listing = try await b.list("load", includingValues: true)
        let values = listing.values ?? [:]  // (built on each read of `values`: read once)
        #expect(listing.revision >= last)
        let events = Dictionary(log.changes.map { ($0.revision, $0) }, uniquingKeysWith: { first, _ in first })
        for (i, revision) in acknowledged {
            #expect(values[Key("k\(i)")] == int(i), "acknowledged write \(i) (revision \(revision)) is not readable via B")
            #expect(events[revision]?.changes.map(\.key) == [Key("k\(i)")] && events[revision]?.changes.first?.new == int(i))
        }
        // B's stream is dense and holds no duplicate: 1, 2, … up to B's revision.
        let streamed = log.changes.map(\.revision)
        #expect(streamed == Array(1...(streamed.last ?? 0)), "B's stream: \(streamed)")
        #expect((streamed.last ?? 0) >= last)
    }

    @Test func aDaemonKilledWithSigkillAndRestartedServesTheCurrentState() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        var a = try await pair.a.client()
        let b = try await pair.b.client()
        for i in 1...3 { try await a.set(Key("a\(i)"), to: int(i), in: "app") }
        let epoch = try await a.list("app").epoch

        pair.a.kill9()
        for i in 4...5 { try await b.set(Key("b\(i)"), to: int(i), in: "app") }
        try await b.delete("a1", in: "app")
        try await pair.a.launch()
        a = try await pair.a.client()

        let listing = try await a.list("app", includingValues: true)
        #expect(listing.revision == 6 && listing.epoch == epoch)
        #expect(listing.values == ["a2": int(2), "a3": int(3), "b4": int(4), "b5": int(5)])
        #expect(try await a.get("b5", in: "app")?.revision == 5)
        // The restarted daemon's history reaches back too, and its next write is revision 7.
        let replay = EventLog(try await a.subscribe(to: "app", since: 2, epoch: epoch))
        #expect(await replay.wait { events in events.contains { if case .synced = $0 { true } else { false } } }, "\(pair.diagnostics)")
        #expect(replay.changes.map(\.revision) == [3, 4, 5, 6])
        #expect(try await a.set("a1", to: int(1), in: "app").revision == 7)
        #expect(try await b.get("a1", in: "app")?.value == int(1))
    }

    @Test func afterAnEtcdCompactionSinceReplaysFromObsdsOwnLogAndBeyondItIsCompacted() async throws {
        // obsd keeps its own change log in etcd (history.limit records per repository), so an
        // etcd compaction loses no replay; `compacted` is about that log's reach.
        let pair = try await ClusterPair.start(extra: ["--history-limit", "4"])
        defer { pair.stop() }
        let etcd = try pair.etcdClient()
        defer { Task { await etcd.shutdown() } }
        let a = try await pair.a.client()
        for i in 1...8 { try await a.set("n", to: int(i), in: "h") }
        let epoch = try await a.list("h").epoch
        let now = try await etcd.range(Array("/obsd-test/epoch".utf8)).revision
        _ = try await etcd.compact(now, physical: true)

        // B starts afresh after the compaction: it reads the log, not etcd's history.
        pair.b.stop()
        try await pair.b.launch()
        let b = try await pair.b.client()
        for client in [a, b] {
            let replay = EventLog(try await client.subscribe(to: "h", since: 4, epoch: epoch))
            #expect(await replay.wait { events in events.contains { if case .synced = $0 { true } else { false } } }, "\(pair.diagnostics)")
            #expect(replay.changes.map(\.revision) == [5, 6, 7, 8])
            #expect(replay.changes.first?.changes.first?.old == int(4))
            let tooOld = await refusal { () async throws(ObsClientError) in try await client.subscribe(to: "h", since: 3, epoch: epoch) }
            #expect(tooOld?.code == .compacted, "since 3 with 4 revisions kept: \(String(describing: tooOld))")
        }
        // Writes go on from where they were, on both.
        #expect(try await b.set("n", to: int(9), in: "h").revision == 9)
        #expect(try await a.get("n", in: "h")?.value == int(9))
    }

    @Test func aDaemonStartedWhileTheClusterIsDownWaitsThenServesOnceItIsUp() async throws {
        let etcd = try await EtcdCluster.start()
        let daemon = ClusterDaemon(name: "A", endpoints: etcd.clientURLs, prefix: "/obsd-test/")
        defer {
            daemon.stop()
            for i in etcd.members.indices { etcd.kill(i) }
        }
        for i in etcd.members.indices { etcd.stop(i) }
        try daemon.spawn()
        // It says why it waits, and does not listen meanwhile.
        let waiting = await eventually(timeout: .seconds(20)) { () async -> Bool in daemon.log.contains("waiting for the etcd cluster") }
        #expect(waiting, "\(daemon.log)")
        #expect(daemon.isRunning)
        #expect(!(await daemon.isServing), "obsd listens before it has reached the cluster")

        for i in etcd.members.indices { try etcd.restart(i) }
        try await daemon.waitUntilServing(timeout: .seconds(30))
        let client = try await daemon.client()
        #expect(try await client.set("k", to: int(1), in: "late").revision == 1)
    }

    @Test func etcdEndpointsWithInMemoryIsAUsageError() async throws {
        let daemon = ClusterDaemon(name: "A", endpoints: ["http://127.0.0.1:9"], prefix: "/obsd-test/", extra: ["--in-memory"])
        defer { daemon.kill9() }
        try daemon.spawn()
        let exited = await eventually(timeout: .seconds(20)) { () async -> Bool in !daemon.isRunning }
        #expect(exited)
        #expect(daemon.exitCode == 64, "\(daemon.log)")
        #expect(daemon.log.contains("--etcd-endpoints"))
    }
}
