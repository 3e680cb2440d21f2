// ObsEtcdTests: the etcd client against a real 3-member cluster on loopback — reads and
// writes, compare-and-set, watches (one revision per response, replay then live, compaction),
// and failures: the leader killed, quorum lost, a member restarted under a watch, a watch on
// a member cut off from its leader, a hung member. Each test starts its own cluster (about a second) and the
// suite runs one test at a time: the failure tests kill members, and every bound below must
// hold on a 2-core machine that is also building.

import ObsEtcd
import Testing
import TestSupport

@Suite(.mayBlock, .serialized, .enabled(if: EtcdCluster.isAvailable, etcdMissing), .timeLimit(.minutes(2)))
struct EtcdClientTests {
    @Test func putThenRangeReadsBackKeyValueAndRevisions() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client()
        defer { Task { await client.shutdown() } }

        let first = try await client.put(bytes("/t/a"), bytes("1"))
        let second = try await client.put(bytes("/t/a"), bytes("2"), prevKV: true)
        #expect(second.revision == first.revision + 1)
        #expect(second.prevKV.map { text($0.value) } == "1")
        try await client.put(bytes("/t/b"), bytes("3"))

        let a = try await client.range(bytes("/t/a"))
        #expect(a.kvs.count == 1)
        #expect(text(a.kvs[0].value) == "2")
        #expect(a.kvs[0].createRevision == first.revision)
        #expect(a.kvs[0].modRevision == second.revision)
        #expect(a.kvs[0].version == 2)
        #expect(a.revision == second.revision + 1)

        let prefix = try await client.range(bytes("/t/"), rangeEnd: EtcdKey.prefixEnd(bytes("/t/")), limit: 1)
        #expect(prefix.kvs.map { text($0.key) } == ["/t/a"])
        #expect(prefix.more && prefix.count == 2)

        let old = try await client.range(bytes("/t/a"), revision: first.revision, serializable: true)
        #expect(old.kvs.map { text($0.value) } == ["1"])
        let missing = try await client.range(bytes("/t/none"))
        #expect(missing.kvs.isEmpty && missing.count == 0)

        let nothing = try await client.delete(bytes("/t/none"))
        #expect(nothing.deleted == 0 && nothing.revision == a.revision, "deleting nothing is no revision")
        let deleted = try await client.delete(bytes("/t/"), rangeEnd: EtcdKey.prefixEnd(bytes("/t/")))
        #expect(deleted.deleted == 2)
        #expect(try await client.range(bytes("/t/a")).kvs.isEmpty)
    }

    @Test func txnCompareAndSetSucceedsOnceAndFailsWithTheCurrentState() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client()
        defer { Task { await client.shutdown() } }
        let key = bytes("/cas/k")

        // Create only if absent (version 0), twice: the second one fails.
        let create = try await client.txn(
            compare: [.version(key, .equal, 0)], success: [.put(key: key, value: bytes("v1"))])
        #expect(create.succeeded)
        let again = try await client.txn(
            compare: [.version(key, .equal, 0)], success: [.put(key: key, value: bytes("x"))],
            failure: [.range(EtcdRangeRequest(key: key))])
        #expect(!again.succeeded)
        #expect(again.revision == create.revision, "a txn that wrote nothing leaves the revision")
        guard case .range(let current)? = again.responses.first else {
            Issue.record("the failure branch's range is missing: \(again.responses)")
            return
        }
        #expect(current.kvs.map { text($0.value) } == ["v1"])

        // Compare-and-set on the mod revision: the first writer wins, the stale one fails.
        let swap = try await client.txn(
            compare: [.modRevision(key, .equal, create.revision)], success: [.put(key: key, value: bytes("v2"), prevKV: true)])
        #expect(swap.succeeded)
        #expect(swap.revision == create.revision + 1)
        #expect(swap.responses == [.put(prevKV: current.kvs.first)])
        let stale = try await client.txn(
            compare: [.modRevision(key, .equal, create.revision)], success: [.put(key: key, value: bytes("v3"))],
            failure: [.range(EtcdRangeRequest(key: key))])
        #expect(!stale.succeeded)
        guard case .range(let now)? = stale.responses.first else {
            Issue.record("the failure branch's range is missing")
            return
        }
        #expect(now.kvs.first?.modRevision == swap.revision)

        // Value, create revision and version compares.
        let byValue = try await client.txn(
            compare: [.value(key, .equal, bytes("v2")), .createRevision(key, .equal, create.revision), .version(key, .greater, 1)],
            success: [.deleteRange(key: key, prevKV: true)])
        #expect(byValue.succeeded)
        #expect(byValue.responses.first == .deleteRange(deleted: 1, prevKVs: now.kvs))
        let wrongValue = try await client.txn(compare: [.value(key, .equal, bytes("v2"))], success: [.put(key: key, value: [])])
        #expect(!wrongValue.succeeded, "a value compare on a missing key is false")
    }

    @Test func txnOfThreePutsReachesAWatcherOnAnotherMemberAsOneRevisionWithOldValues() async throws {
        let cluster = try await EtcdCluster.started()
        let writer = try cluster.client([0])
        let reader = try cluster.client([2])
        defer { Task { await writer.shutdown(); await reader.shutdown() } }

        var revision: Int64 = 0
        for name in ["a", "b", "c"] { revision = try await writer.put(bytes("/g/\(name)"), bytes("old-\(name)")).revision }
        let recorder = WatchRecorder(
            reader.watch(bytes("/g/"), rangeEnd: EtcdKey.prefixEnd(bytes("/g/")), startRevision: revision + 1, prevKV: true))
        let txn = try await writer.txn(
            compare: [.modRevision(bytes("/g/a"), .equal, revision - 2)],
            success: ["a", "b", "c"].map { .put(key: bytes("/g/\($0)"), value: bytes("new-\($0)")) })
        #expect(txn.succeeded)
        #expect(txn.revision == revision + 1, "three puts, one revision")

        #expect(await recorder.wait(forCount: 1), "no watch response: \(String(describing: recorder.error))")
        let responses = recorder.responses
        #expect(responses.count == 1)
        let response = try #require(responses.first)
        #expect(response.revision == txn.revision)
        #expect(response.events.map { text($0.kv.key) } == ["/g/a", "/g/b", "/g/c"])
        #expect(response.events.allSatisfy { $0.kind == .put && $0.kv.modRevision == txn.revision })
        #expect(response.events.map { text($0.kv.value) } == ["new-a", "new-b", "new-c"])
        #expect(response.events.map { $0.prevKV.map { text($0.value) } } == ["old-a", "old-b", "old-c"])
    }

    @Test func watchFromAPastRevisionReplaysOneRevisionPerResponseThenContinuesLiveWithoutGap() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client()
        defer { Task { await client.shutdown() } }
        let key = bytes("/r/k")

        var written: [Int64] = []
        for i in 0..<5 { written.append(try await client.put(key, bytes("\(i)")).revision) }
        // A 2-key txn among the replayed ones: one revision, two events.
        let pair = try await client.txn(success: [.put(key: key, value: bytes("5")), .put(key: bytes("/r/l"), value: bytes("x"))])
        written.append(pair.revision)

        let recorder = WatchRecorder(client.watch(bytes("/r/"), rangeEnd: EtcdKey.prefixEnd(bytes("/r/")), startRevision: written[0]))
        #expect(await recorder.wait(forCount: written.count), "replay incomplete: \(recorder.revisions)")
        #expect(recorder.revisions == written, "one element per revision, in order")
        #expect(recorder.responses.last?.events.count == 2)
        #expect(recorder.responses.dropFirst().allSatisfy { $0.events.first?.prevKV != nil })

        for i in 6..<9 { written.append(try await client.put(key, bytes("\(i)")).revision) }
        #expect(await recorder.wait(forCount: written.count), "live events missing: \(recorder.revisions)")
        #expect(recorder.revisions == written, "no gap, no duplicate between replay and live")
        #expect(recorder.responses.map { text($0.events[0].kv.value) } == (0..<9).map { "\($0)" })

        // Without a start revision: the changes after the stream opened, nothing before.
        let fromNow = WatchRecorder(client.watch(key))
        let opened = await eventually(timeout: .seconds(10), every: .milliseconds(5)) { () async -> Bool in
            client.statistics.watchStreamsOpened >= 2
        }
        #expect(opened)
        let next = try await client.put(key, bytes("9")).revision
        #expect(await fromNow.wait(forCount: 1))
        #expect(fromNow.revisions == [next])

        // With progress reports: after a quiet second the probe's answer, at the member's revision.
        let progress = WatchRecorder(client.watch(bytes("/r/quiet"), reportProgress: true))
        #expect(await progress.wait(forCount: 1, timeout: .seconds(10)))
        #expect(progress.responses.first?.isProgress == true)
        #expect(progress.responses.first?.revision == next)
    }

    @Test func compactedStartRevisionEndsTheWatchWithCompactedAndItsRevision() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client()
        defer { Task { await client.shutdown() } }
        let key = bytes("/c/k")
        let first = try await client.put(key, bytes("1")).revision
        try await client.put(key, bytes("2"))
        let last = try await client.put(key, bytes("3")).revision
        try await client.compact(last)

        let recorder = WatchRecorder(client.watch(key, startRevision: first))
        #expect(await recorder.waitEnded())
        #expect(recorder.error == .compacted(compactRevision: last))
        #expect(recorder.responses.isEmpty)

        await #expect(throws: EtcdError.compacted(compactRevision: nil)) {
            try await client.range(key, revision: first)
        }
        // From the compact revision on, the history is there.
        let fromCompaction = WatchRecorder(client.watch(key, startRevision: last))
        #expect(await fromCompaction.wait(forCount: 1))
        #expect(fromCompaction.revisions == [last])
    }

    @Test func leaderKilledMidWayTheClientWithAllEndpointsKeepsWriting() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client(requestTimeout: .seconds(2))
        defer { Task { await client.shutdown() } }
        let leader = try #require(await cluster.leader(using: client))
        // Start on the leader, so its death hits the client's own connections.
        let onLeader = try cluster.client([leader] + cluster.members.indices.filter { $0 != leader }, requestTimeout: .seconds(2))
        defer { Task { await onLeader.shutdown() } }

        var acknowledged: [(key: String, revision: Int64)] = []
        var failures: [EtcdError] = []
        var longestOutage: Duration = .zero
        let killAt = 20
        for i in 0..<60 {
            if i == killAt { cluster.kill(leader) }
            let key = "/l/\(i)"
            let attempted = ContinuousClock.now
            // Each write is retried until it is acknowledged, within a bound: an unknown outcome
            // is retried too (the value is the same, so a write applied twice is harmless here).
            let deadline = ContinuousClock.now + .seconds(20)
            while true {
                do {
                    acknowledged.append((key, try await onLeader.put(bytes(key), bytes("\(i)")).revision))
                    longestOutage = max(longestOutage, ContinuousClock.now - attempted)
                    break
                } catch let error as EtcdError {
                    failures.append(error)
                    #expect(error.isTransient, "not a cluster failure: \(error)")
                    if ContinuousClock.now > deadline {
                        Issue.record("write \(i) not acknowledged within 20 s: \(failures.suffix(5))")
                        return
                    }
                    // A client retries as any would: not in a tight loop while the cluster elects.
                    try await Task.sleep(for: .milliseconds(50))
                }
            }
        }
        #expect(acknowledged.count == 60)
        #expect(acknowledged.map(\.revision) == acknowledged.map(\.revision).sorted())
        for (key, revision) in acknowledged {
            let read = try await client.range(bytes(key))
            #expect(read.kvs.first.map { $0.modRevision >= revision } == true, "\(key) lost")
        }
        let newLeader = await cluster.leader(using: client)
        #expect(newLeader != nil && newLeader != leader)
        // How many attempts fail depends on how fast they fail; what a user sees is the outage:
        // an election (1 s timeout here) and the client's move to a live member, not a stall.
        #expect(longestOutage < .seconds(10), "writes stalled for \(longestOutage) after the leader was killed")
    }

    @Test func withTwoOfThreeMembersStoppedATxnFailsWithinFiveSecondsAndSucceedsOnceTheyReturn() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client(requestTimeout: .seconds(3))
        defer { Task { await client.shutdown() } }
        try await client.put(bytes("/q/before"), bytes("1"))

        cluster.stop(0)
        cluster.stop(1)
        let started = ContinuousClock.now
        let error = await #expect(throws: EtcdError.self) {
            try await client.txn(compare: [.version(bytes("/q/k"), .equal, 0)], success: [.put(key: bytes("/q/k"), value: bytes("x"))])
        }
        let elapsed = ContinuousClock.now - started
        #expect(elapsed <= .seconds(5), "took \(elapsed)")
        if let error {
            // Refused ("no leader": not applied) or timed out (the outcome is unknown).
            switch error {
            case .unavailable: #expect(!error.isOutcomeUnknown)
            case .timeout(let unknown): #expect(unknown && error.isOutcomeUnknown)
            default: Issue.record("unexpected error: \(error)")
            }
        }
        // Serializable reads still work on the member left.
        let stale = try await client.range(bytes("/q/before"), serializable: true, timeout: .seconds(2))
        #expect(stale.kvs.count == 1)

        try cluster.restart(0)
        try cluster.restart(1)
        #expect(await cluster.waitHealthy(timeout: .seconds(30)), "\(cluster.diagnostics())")
        let after = try await client.txn(success: [.put(key: bytes("/q/after"), value: bytes("y"))])
        #expect(after.succeeded)
    }

    @Test func watchContinuesWithoutGapAcrossARestartOfItsMember() async throws {
        let cluster = try await EtcdCluster.started()
        let probe = try cluster.client()
        let leader = try #require(await cluster.leader(using: probe))
        // The watcher starts on a follower, and that one is restarted (the leader's death is
        // the next test's); the writer stays on the leader.
        let restarted = try #require(cluster.members.indices.first { $0 != leader })
        let others = cluster.members.indices.filter { $0 != restarted }
        let writer = try cluster.client([leader] + others.filter { $0 != leader })
        let watcher = try cluster.client([restarted] + others)
        defer { Task { await probe.shutdown(); await writer.shutdown(); await watcher.shutdown() } }

        let start = try await writer.put(bytes("/w/k"), bytes("0")).revision
        let recorder = WatchRecorder(watcher.watch(bytes("/w/k"), startRevision: start))
        var written = [start]
        for i in 1...5 { written.append(try await writer.put(bytes("/w/k"), bytes("\(i)")).revision) }
        #expect(await recorder.wait(forCount: written.count))

        cluster.kill(restarted)
        for i in 6...10 { written.append(try await writer.put(bytes("/w/k"), bytes("\(i)")).revision) }
        try cluster.restart(restarted)
        for i in 11...15 { written.append(try await writer.put(bytes("/w/k"), bytes("\(i)")).revision) }

        #expect(await recorder.wait(forCount: written.count, timeout: .seconds(20)), "got \(recorder.revisions)")
        #expect(recorder.revisions == written, "no gap, no duplicate")
        #expect(recorder.error == nil && !recorder.ended)
        #expect(watcher.statistics.watchStreamsLost >= 1, "the watch never left the killed member")
        #expect(recorder.responses.allSatisfy { $0.events.first?.prevKV != nil || $0.revision == start })
    }

    @Test func watchOnAMemberCutOffFromItsLeaderIsDetectedAndContinuesWithoutGap() async throws {
        let cluster = try await EtcdCluster.started()
        let writer = try cluster.client([0, 1, 2])
        let watcher = try cluster.client([2, 0, 1])
        defer { Task { await writer.shutdown(); await watcher.shutdown() } }

        let start = try await writer.put(bytes("/i/k"), bytes("0")).revision
        let recorder = WatchRecorder(watcher.watch(bytes("/i/k"), startRevision: start))
        #expect(await recorder.wait(forCount: 1))

        // Member 2 stays up without a leader: after three election timeouts etcd cancels its
        // hasleader watches (measured: the gateway then closes this client's connection), and
        // the watch keeps trying every member — refused ("no leader") or closed — until a
        // quorum is back, then resumes from the next revision.
        cluster.stop(0)
        cluster.stop(1)
        let lost = await eventually(timeout: .seconds(15), every: .milliseconds(20)) { () async -> Bool in
            watcher.statistics.watchStreamsLost >= 1
        }
        #expect(lost, "the cancelled stream was not noticed: \(watcher.statistics)")
        try cluster.restart(0)
        try cluster.restart(1)
        #expect(await cluster.waitHealthy(timeout: .seconds(30)), "\(cluster.diagnostics())")
        var written = [start]
        for i in 1...3 { written.append(try await writer.put(bytes("/i/k"), bytes("\(i)")).revision) }
        #expect(await recorder.wait(forCount: written.count, timeout: .seconds(15)), "the watch went silent: \(recorder.revisions)")
        #expect(recorder.revisions == written)
    }

    @Test func watchOnAHungMemberIsLeftByTheProgressProbeAndContinuesWithoutGap() async throws {
        let cluster = try await EtcdCluster.started()
        let probe = try cluster.client()
        let leader = try #require(await cluster.leader(using: probe))
        let hung = try #require(cluster.members.indices.first { $0 != leader })
        let others = cluster.members.indices.filter { $0 != hung }
        let writer = try cluster.client([leader] + others.filter { $0 != leader })
        let watcher = try cluster.client([hung] + others)
        defer { Task { await probe.shutdown(); await writer.shutdown(); await watcher.shutdown() } }

        let start = try await writer.put(bytes("/h/k"), bytes("0")).revision
        let recorder = WatchRecorder(watcher.watch(bytes("/h/k"), startRevision: start))
        #expect(await recorder.wait(forCount: 1))

        // A frozen member keeps its TCP connections open and answers nothing: only the
        // client's progress probe can tell (1 s quiet + 2 s without an answer by default).
        cluster.pause(hung)
        defer { cluster.resume(hung) }
        var written = [start]
        for i in 1...5 { written.append(try await writer.put(bytes("/h/k"), bytes("\(i)")).revision) }
        #expect(await recorder.wait(forCount: written.count, timeout: .seconds(15)), "the watch stayed on the hung member: \(recorder.revisions)")
        #expect(recorder.revisions == written, "no gap, no duplicate")
        #expect(watcher.statistics.watchStreamsLost >= 1)

        // A read starts on the hung member (the client's first endpoint was never answered by
        // a read), gets nothing for readAttemptTimeout (2 s), and is answered by the next one.
        let reader = try cluster.client([hung] + others)
        defer { Task { await reader.shutdown() } }
        let started = ContinuousClock.now
        let read = try await reader.range(bytes("/h/k"))
        #expect(read.kvs.first?.modRevision == written.last)
        #expect(ContinuousClock.now - started < .seconds(4))
        #expect(reader.statistics.failovers >= 1)
    }
}
