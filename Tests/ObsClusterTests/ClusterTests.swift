// ObsClusterTests: two real obsd daemons, A and B, sharing their repositories through a real
// 3-member etcd cluster on loopback (issue 14). The wire contract across daemons: events with
// old and new values, dense revisions in one order, a batch as one event, compare-and-set,
// the no-op rule, `since` replay and one epoch, writes committed in groups of more revisions
// than the change log keeps (this file); etcd losing its quorum, its leader killed under a
// write loop, a daemon killed -9, an etcd compaction, starting while etcd is down
// (ClusterFailureTests.swift); a watch resumed behind a compaction and a wiped prefix
// (ClusterCatchUpTests.swift); leases across daemons (ClusterLeaseTests.swift); catch-ups
// across daemons, from the tombstones kept in etcd (ClusterTombstoneTests.swift).
//
// Each test starts its own cluster and daemons and stops every process by PID in a `defer`.
// Tests await events and replies; the waits' bounds are failure guards only. The suite runs
// one test at a time, alone (Makefile `ALONE_SUITES`): its bounds are etcd's and obsd's, not
// those of a 2-core machine busy with every other suite.

import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .serialized, .enabled(if: EtcdCluster.isAvailable, etcdMissing), .timeLimit(.minutes(3)))
struct ClusterTests {
    @Test func aWriteOnAReachesBsSubscriberWithOldAndNewValues() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let log = EventLog(try await b.subscribe(to: "flags"))

        let first = try await a.set("beta", to: int(1), in: "flags")
        let second = try await a.set("beta", to: int(2), in: "flags")
        #expect(first.revision == 1 && first.changed && first.old == nil)
        #expect(second.revision == 2 && second.changed && second.old == int(1))

        let arrived = await log.wait(forRevision: 2)
        #expect(arrived, "B's subscriber did not see A's writes:\n\(pair.diagnostics)")
        let changes = log.changes
        #expect(changes.map(\.revision) == [1, 2])
        #expect(changes.first?.changes.map(\.key) == ["beta"])
        #expect(changes.first?.changes.first?.old == nil && changes.first?.changes.first?.new == int(1))
        #expect(changes.last?.changes.first?.old == int(1) && changes.last?.changes.first?.new == int(2))
        // A read on B after A's acknowledgement sees the write (linearizable).
        let read = try await b.get("beta", in: "flags")
        #expect(read?.value == int(2) && read?.revision == 2)
    }

    @Test func alternatingWritesOnAAndBGiveDenseRevisionsInOneOrderOnBoth() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let logA = EventLog(try await a.subscribe(to: "seq"))
        let logB = EventLog(try await b.subscribe(to: "seq"))

        let count = 40
        for i in 1...count {
            let writer = i.isMultiple(of: 2) ? b : a
            let reply = try await writer.set(Key("k\(i % 3)"), to: int(i), in: "seq")
            #expect(reply.revision == UInt64(i) && reply.changed, "write \(i) on \(i.isMultiple(of: 2) ? "B" : "A")")
        }

        let arrivedA = await logA.wait(forRevision: UInt64(count))
        let arrivedB = await logB.wait(forRevision: UInt64(count))
        #expect(arrivedA && arrivedB, "\(pair.diagnostics)")
        #expect(logA.changes.map(\.revision) == (1...count).map(UInt64.init))
        #expect(logB.changes.map(\.revision) == (1...count).map(UInt64.init))
        #expect(logA.changes == logB.changes, "A and B show different changes for the same revisions")
        // Each revision's new value is the write that took it, its old value the one before.
        for (i, event) in logB.changes.enumerated() {
            let n = i + 1
            #expect(event.changes.count == 1 && event.changes[0].key == Key("k\(n % 3)") && event.changes[0].new == int(n))
            #expect(event.changes[0].old == (n > 3 ? int(n - 3) : JSONValue?.none))
        }
        let repos = (try await a.repositories(), try await b.repositories())
        #expect(repos.0.map(\.revision) == [UInt64(count)] && repos.0 == repos.1)
    }

    @Test func aThreeKeyBatchIsOneEventOnB() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let log = EventLog(try await b.subscribe(to: "cfg"))

        let batch = try await a.apply([.set("x", int(1)), .set("y", int(2)), .set("z", int(3))], in: "cfg")
        #expect(batch.revision == 1 && batch.changed)
        let after = try await a.set("x", to: int(10), in: "cfg")
        #expect(after.revision == 2)

        #expect(await log.wait(forRevision: 2), "\(pair.diagnostics)")
        let changes = log.changes
        #expect(changes.map(\.revision) == [1, 2], "the batch is one revision and one event")
        #expect(changes.first?.changes.map(\.key) == ["x", "y", "z"])
        #expect(changes.first?.changes.map(\.new) == [int(1), int(2), int(3)])
        #expect(changes.last?.changes.map(\.old) == [int(1)])
    }

    @Test func aStaleIfRevOnBAfterAsWriteIsAConflict() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()

        #expect(try await a.set("owner", to: .string("a"), in: "cas").revision == 1)
        // B may not have A's revision yet when it plans: the cluster decides, not B's state.
        let create = await refusal { () async throws(ObsClientError) in try await b.set("owner", to: .string("b"), in: "cas", ifRevision: 0) }
        #expect(create?.code == .conflict, "create-if-absent on B after A created: \(String(describing: create))")
        #expect(try await a.set("owner", to: .string("a2"), in: "cas").revision == 2)
        let stale = await refusal { () async throws(ObsClientError) in try await b.set("owner", to: .string("b"), in: "cas", ifRevision: 1) }
        #expect(stale?.code == .conflict, "ifRev 1 on B after A's revision 2: \(String(describing: stale))")
        let staleDelete = await refusal { () async throws(ObsClientError) in try await b.delete("owner", in: "cas", ifRevision: 1) }
        #expect(staleDelete?.code == .conflict)

        let current = try await b.set("owner", to: .string("b"), in: "cas", ifRevision: 2)
        #expect(current.revision == 3 && current.changed && current.old == .string("a2"))
        #expect(try await a.get("owner", in: "cas")?.value == .string("b"))
    }

    @Test func anEqualValueThroughBAfterAsWriteChangesNothingAndSendsNoEvent() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let b = try await pair.b.client()
        let logA = EventLog(try await a.subscribe(to: "ui"))
        let logB = EventLog(try await b.subscribe(to: "ui"))

        #expect(try await a.set("theme", to: .string("dark"), in: "ui").revision == 1)
        let same = try await b.set("theme", to: .string("dark"), in: "ui")
        #expect(!same.changed && same.revision == 1 && same.old == .string("dark"))
        let sameBatch = try await b.apply([.set("theme", .string("dark"))], in: "ui")
        #expect(!sameBatch.changed && sameBatch.revision == 1)
        // The next revision is 2, and it is the next event on both: nothing came between.
        #expect(try await a.set("theme", to: .string("light"), in: "ui").revision == 2)
        // `force` makes an equal value a change, with its event.
        let forced = try await b.set("theme", to: .string("light"), in: "ui", force: true)
        #expect(forced.changed && forced.revision == 3)

        let arrivedA = await logA.wait(forRevision: 3)
        let arrivedB = await logB.wait(forRevision: 3)
        #expect(arrivedA && arrivedB, "\(pair.diagnostics)")
        for log in [logA, logB] {
            #expect(log.changes.map(\.revision) == [1, 2, 3])
            #expect(log.changes.dropFirst().first?.changes.first?.old == .string("dark"))
            #expect(log.changes.last?.changes.first?.old == .string("light") && log.changes.last?.changes.first?.new == .string("light"))
        }
    }

    @Test func bResumesWithSinceAfterADisconnectWithExactlyTheMissedChangesInTheSameEpoch() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        let first = try await pair.b.client()
        let log = EventLog(try await first.subscribe(to: "state"))
        for i in 1...3 { try await a.set("n", to: int(i), in: "state") }
        #expect(await log.wait(forRevision: 3), "\(pair.diagnostics)")
        let epoch = log.subscription.epoch
        await first.close()

        // Missed while disconnected: A's writes and one through B itself.
        for i in 4...5 { try await a.set("n", to: int(i), in: "state") }
        let b = try await pair.b.client()
        try await b.set("m", to: .string("b"), in: "state")
        for i in 7...8 { try await a.set("n", to: int(i), in: "state") }

        let resumed = EventLog(try await b.subscribe(to: "state", since: 3, epoch: epoch))
        let synced = await resumed.wait { events in events.contains { if case .synced = $0 { true } else { false } } }
        #expect(synced, "\(pair.diagnostics)")
        #expect(resumed.changes.map(\.revision) == [4, 5, 6, 7, 8], "exactly the missed changes, no gap and no duplicate")
        #expect(resumed.changes.first?.changes.first?.old == int(3))
        #expect(resumed.changes[2].changes.map(\.key) == ["m"])
        guard case .synced(let at)? = resumed.events.last else {
            Issue.record("the replay did not end with synced: \(resumed.events)")
            return
        }
        #expect(at == 8)

        // One epoch for the repository, on both daemons.
        let (listA, listB) = (try await a.list("state"), try await b.list("state"))
        #expect(!epoch.isEmpty && listA.epoch == epoch && listB.epoch == epoch)
        #expect(listA.revision == 8 && listB.revision == 8)
        #expect(resumed.subscription.epoch == epoch)
        // A resume with another epoch is refused.
        let foreign = await refusal { () async throws(ObsClientError) in
            try await b.subscribe(to: "state", since: 3, epoch: String(repeating: "0", count: 32))
        }
        #expect(foreign?.code == .compacted)
    }

    /// Concurrent writes are committed in groups of several revisions: a group of more
    /// revisions than the change log keeps (history.limit 1) still commits — its trim of the
    /// log must not cover its own records, or etcd refuses the txn ("duplicate key").
    @Test func aGroupOfMoreRevisionsThanTheChangeLogKeepsCommits() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "1"])
        defer { pair.stop() }
        let writers = 8
        let writes = 10
        let connections = try (0..<writers).map { _ in try WireConnection(path: pair.a.socketPath) }
        let tasks = connections.enumerated().map { (w, c) in
            Task {
                try await onOwnThread { () throws -> [JSONObject] in  // (blocking: never on the shared pool)
                    for i in 1...writes {
                        let key = JSONValue.string("w\(w)-\(i % 2)")
                        _ = try c.request(i.isMultiple(of: 3) ? ["op": "delete", "repo": "g", "key": key] : ["op": "set", "repo": "g", "key": key, "value": .int(Int64(i))])
                    }
                    return try (1...writes).map { _ in try c.receive() }
                }
            }
        }
        var failed: [JSONObject] = []
        for task in tasks { failed += try await task.value.filter { !$0.ok } }
        #expect(failed.isEmpty, "\(failed.count) of \(writers * writes) refused, the first: \(failed.first.map { "\($0)" } ?? "")")
        let revision = try await pair.a.client().list("g").revision
        #expect(revision == UInt64(writers * writes), "every write changes its key")
        #expect(try await pair.b.client().list("g").revision == revision)
    }
}

/// The error a call fails with (nil if it succeeded).
func refusal<T>(_ body: () async throws(ObsClientError) -> T) async -> ObsClientError? {
    do {
        _ = try await body()
        return nil
    } catch {
        return error
    }
}
