// ObsClusterTests, tombstones in etcd: a catch-up past the history is a `diff` on any daemon of
// a cluster — one that started after some of the deletions, one restarted after all of them,
// one whose watch resumed behind an etcd compaction, one that had to stop and restart because
// the change log no longer reached back — listing what another daemon deleted (the contract's
// example on the wire, CatchUpScenario, written through A and caught up through B), and not
// the keys it re-created; etcd holds what every daemon remembers (a tomb key per deletion,
// lease ends' included, none for a key written again) within the bound, the floor raised past
// it, so that a catch-up from before the floor is a `snapshot` on every daemon; and deletions
// etcd cannot vouch for (a floor key behind the counter, as a daemon that keeps no tombstones
// leaves it) are unknown, on start-up and to the next commit.

import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ObsClient
import ObsCluster
import ObsEtcd
import ObsProtocol
import ObservableKit
import Synchronization
import Testing
import TestSupport

extension ClusterTests {
    /// What a subscription resumed with `catchup` got before `synced`.
    struct Resumed {
        let mode: CatchUpMode?
        let revision: UInt64
        let diff: CatchUpEvent<JSONValue>?
        let snapshot: [Key: JSONValue]?
    }

    /// Resumes `repo` through `client` from `since` of `epoch` with `catchup`.
    func resume(_ client: ObsConnection, _ repo: String, since: UInt64, epoch: String) async throws -> Resumed {
        let subscription = try await client.subscribe(to: repo, since: since, epoch: epoch, catchUp: true)
        let log = EventLog(subscription)
        let synced = await log.wait { $0.contains { if case .synced = $0 { true } else { false } } }
        try? await subscription.cancel()
        guard synced else { throw ClusterTestFailure("no synced after resuming \(repo) from \(since): \(log.events) \(log.failure ?? "")") }
        var diff: CatchUpEvent<JSONValue>? = nil
        var snapshot: [Key: JSONValue]? = nil
        for event in log.events {
            switch event {
            case .catchUp(let c): diff = c
            case .snapshot(_, let values): snapshot = values
            default: break
            }
        }
        return Resumed(mode: subscription.catchUp, revision: subscription.revision, diff: diff, snapshot: snapshot)
    }

    /// The tomb keys of `repo` in etcd, as "key@revision" in key order of etcd, and its floor key.
    static func tombstonesInEtcd(_ client: EtcdClient, prefix: String, repo: String) async throws -> (tombs: [String], floor: String?) {
        let head = Array("\(prefix)tomb/\(repo)/".utf8)
        let tombs = try await client.range(head, rangeEnd: EtcdKey.prefixEnd(head))
        let listed = tombs.kvs.map { kv -> String in
            let rest = String(decoding: kv.key.dropFirst(head.count), as: UTF8.self)
            let revision = UInt64(rest.prefix(20)) ?? 0
            return "\(rest.dropFirst(21))@\(revision)"
        }
        let floor = try await client.range(Array("\(prefix)tombfloor/\(repo)".utf8)).kvs.first.map { String(decoding: $0.value, as: UTF8.self) }
        return (listed, floor)
    }

    @Test func aCatchUpOnADaemonStartedAfterSomeDeletionsListsThemAllAsADiff() async throws {
        let etcd = try await EtcdCluster.start()
        let a = ClusterDaemon(name: "A", endpoints: etcd.clientURLs, prefix: "/obsd-test/", extra: ["--history-limit", "2"])
        let b = ClusterDaemon(name: "B", endpoints: etcd.clientURLs, prefix: "/obsd-test/", extra: ["--history-limit", "2"])
        defer {
            a.stop()
            b.stop()
            for i in etcd.members.indices { etcd.kill(i) }
        }
        try await a.launch()
        let clientA = try await a.client()
        _ = try await clientA.apply((1...6).map { .set(Key("k\($0)"), int($0)) }, in: "t")  // 1
        let epoch = try await clientA.list("t").epoch
        // Before B starts.
        try await clientA.delete("k1", in: "t")  // 2
        try await clientA.delete("k2", in: "t")  // 3
        try await clientA.set("k3", to: int(30), in: "t")  // 4
        try await b.launch()
        let clientB = try await b.client()
        // While it runs.
        try await clientA.delete("k4", in: "t")  // 5
        _ = try await clientA.apply([.delete("k5"), .set("k7", int(7))], in: "t")  // 6
        try await clientA.delete("k6", in: "t")  // 7
        try await clientA.set("k6", to: int(60), in: "t")  // 8: exists again
        try await clientA.set("k8", to: int(8), in: "t")  // 9
        try await clientA.set("k9", to: int(9), in: "t")  // 10
        #expect(try await clientB.get("k9", in: "t")?.revision == 10)

        for (name, client) in [("B", clientB), ("A", clientA)] {
            let resumed = try await resume(client, "t", since: 1, epoch: epoch)
            #expect(resumed.mode == .diff, "through \(name), from 1 (before B started): \(resumed)\n\(b.log.suffix(2000))")
            #expect(resumed.revision == 10 && resumed.diff?.from == 1 && resumed.diff?.revision == 10)
            #expect(resumed.diff?.deleted == ["k1", "k2", "k4", "k5"], "through \(name)")
            #expect(resumed.diff?.values == ["k3": int(30), "k6": int(60), "k7": int(7), "k8": int(8), "k9": int(9)], "through \(name)")
            #expect(resumed.snapshot == nil)
        }
        // From after k1 and k2 went: only the later deletions.
        let later = try await resume(clientB, "t", since: 3, epoch: epoch)
        #expect(later.mode == .diff && later.diff?.deleted == ["k4", "k5"], "\(later)")
        #expect(later.diff?.values == ["k3": int(30), "k6": int(60), "k7": int(7), "k8": int(8), "k9": int(9)])
    }

    @Test func aDaemonRestartedAfterTheDeletionsAnswersADiffFromTheTombstonesInEtcd() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "2"])
        defer { pair.stop() }
        let etcdClient = try pair.etcdClient()
        defer { Task { await etcdClient.shutdown() } }
        let clientA = try await pair.a.client()
        _ = try await clientA.apply((1...6).map { .set(Key("k\($0)"), int($0)) }, in: "t")  // 1
        let epoch = try await clientA.list("t").epoch
        try await clientA.delete("k1", in: "t")  // 2
        #expect(try await pair.b.client().get("k1", in: "t") == nil)

        pair.b.stop()
        try await clientA.delete("k2", in: "t")  // 3
        try await clientA.delete("k3", in: "t")  // 4
        try await clientA.set("k3", to: int(30), in: "t")  // 5: exists again
        _ = try await clientA.apply([.delete("k4"), .delete("k5")], in: "t")  // 6
        try await clientA.set("k7", to: int(7), in: "t")  // 7
        try await clientA.set("k8", to: int(8), in: "t")  // 8
        let held = try await Self.tombstonesInEtcd(etcdClient, prefix: pair.prefix, repo: "t")
        #expect(held.tombs == ["k1@2", "k2@3", "k4@6", "k5@6"], "a tomb key per deletion, none for k3, written again")
        #expect(held.floor == "0 8")

        try await pair.b.launch()
        let clientB = try await pair.b.client()
        let resumed = try await resume(clientB, "t", since: 1, epoch: epoch)
        #expect(resumed.mode == .diff, "\(resumed)\n\(pair.b.log.suffix(2000))")
        #expect(resumed.diff?.deleted == ["k1", "k2", "k4", "k5"])
        #expect(resumed.diff?.values == ["k3": int(30), "k7": int(7), "k8": int(8)])

        // What B deletes now, A lists too — and B, restarted, still does.
        try await clientB.delete("k6", in: "t")  // 9
        #expect(try await clientA.get("k6", in: "t") == nil)
        let throughA = try await resume(clientA, "t", since: 1, epoch: epoch)
        #expect(throughA.mode == .diff && throughA.diff?.deleted == ["k1", "k2", "k4", "k5", "k6"], "\(throughA)")
        try await pair.b.launch(afterStopping: true)
        let again = try await resume(try await pair.b.client(), "t", since: 4, epoch: epoch)
        #expect(again.mode == .diff && again.diff?.deleted == ["k4", "k5", "k6"], "\(again)")
        #expect(again.diff?.values == ["k3": int(30), "k7": int(7), "k8": int(8)])
    }

    @Test func etcdHoldsAtMostTheBoundAndACatchUpFromBeforeTheFloorIsASnapshot() async throws {
        let etcd = try await EtcdCluster.start()
        let prefix = "/obsd-test/"
        // A small bound: only in process (the obsd binary takes 100,000 at least).
        let storage = try ClusterStorage(
            configuration: ClusterStorage.Configuration(endpoints: etcd.clientURLs, prefix: prefix, historyLimit: 2), logger: Logger(label: "obsd-in-process"))
        let a = try await InProcessDaemon.start(storage: storage, historyLimit: 2, historyTombstones: 4)
        let b = ClusterDaemon(name: "B", endpoints: etcd.clientURLs, prefix: prefix, extra: ["--history-limit", "2"])
        let etcdClient = try ClusterPair.etcdClient(etcd)
        defer {
            b.stop()
            for i in etcd.members.indices { etcd.kill(i) }
            Task { await etcdClient.shutdown() }
        }
        let clientA = try await ObsConnection.connect(socketPath: a.socketPath)
        var ops: [WriteOp<JSONValue>] = (1...10).map { .set(Key("k\($0)"), int($0)) }
        ops += ["a", "b", "c"].map { .set(Key($0), int(0)) }
        ops += (1...6).map { .set(Key("d\($0)"), int($0)) }
        _ = try await clientA.apply(ops, in: "t")  // 1
        let epoch = try await clientA.list("t").epoch
        for i in 1...10 { try await clientA.delete(Key("k\(i)"), in: "t") }  // 2…11: k1…k10
        var held = try await Self.tombstonesInEtcd(etcdClient, prefix: prefix, repo: "t")
        #expect(held.tombs == ["k7@8", "k8@9", "k9@10", "k10@11"], "the four newest deletions")
        #expect(held.floor == "7 11", "k6's deletion, at 7, was the last forgotten")

        try await clientA.set("k10", to: int(100), in: "t")  // 12: its tombstone goes
        _ = try await clientA.apply([.delete("a"), .delete("b"), .delete("c")], in: "t")  // 13: k7 and k8 forgotten
        held = try await Self.tombstonesInEtcd(etcdClient, prefix: prefix, repo: "t")
        #expect(held.tombs == ["k9@10", "a@13", "b@13", "c@13"])
        #expect(held.floor == "9 13")

        try await b.launch()
        let clientB = try await b.client()
        for (name, client) in [("A", clientA), ("B", clientB)] {
            let before = try await resume(client, "t", since: 8, epoch: epoch)
            #expect(before.mode == .snapshot && before.snapshot?[Key("k10")] == int(100) && before.snapshot?.count == 7, "through \(name): \(before)")
            let after = try await resume(client, "t", since: 9, epoch: epoch)
            #expect(after.mode == .diff && after.diff?.deleted == ["a", "b", "c", "k9"], "through \(name): \(after)")
            #expect(after.diff?.values == ["k10": int(100)], "through \(name)")
        }

        // One revision deleting more than the bound: its own deletions are forgotten at once.
        _ = try await clientA.apply((1...6).map { .delete(Key("d\($0)")) }, in: "t")  // 14
        held = try await Self.tombstonesInEtcd(etcdClient, prefix: prefix, repo: "t")
        #expect(held.tombs.isEmpty && held.floor == "14 14", "\(held)")
        for i in 1...3 { try await clientA.set("x", to: int(i), in: "t") }  // 15…17: the history starts at 16
        // B, on the default bound, remembers the deletions it installed; restarted, it knows
        // what etcd holds.
        let remembered = try await resume(clientB, "t", since: 13, epoch: epoch)
        #expect(remembered.mode == .diff && remembered.diff?.deleted == ["d1", "d2", "d3", "d4", "d5", "d6"], "\(remembered)")
        try await b.launch(afterStopping: true)
        let restartedB = try await b.client()
        for (name, client) in [("A", clientA), ("B", restartedB)] {
            #expect(try await resume(client, "t", since: 13, epoch: epoch).mode == .snapshot, "through \(name)")
            let now = try await resume(client, "t", since: 14, epoch: epoch)
            #expect(now.mode == .diff && now.diff?.deleted == [] && now.diff?.values == ["x": int(3)], "through \(name): \(now)")
        }
        await clientA.close()
        try await a.stop()
    }

    @Test func deletionsEtcdCannotVouchForAreUnknownToADaemonStartingAndToTheNextCommit() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "2"])
        defer { pair.stop() }
        let etcdClient = try pair.etcdClient()
        defer { Task { await etcdClient.shutdown() } }
        let clientA = try await pair.a.client()
        _ = try await clientA.apply((1...4).map { .set(Key("k\($0)"), int($0)) }, in: "t")  // 1
        let epoch = try await clientA.list("t").epoch
        try await clientA.delete("k1", in: "t")  // 2
        try await clientA.delete("k2", in: "t")  // 3
        for i in 4...6 { try await clientA.set(Key("k\(i + 1)"), to: int(i), in: "t") }  // 4…6
        #expect(try await Self.tombstonesInEtcd(etcdClient, prefix: pair.prefix, repo: "t").floor == "0 6")
        // As a daemon that keeps no tombstones leaves it: revisions 5 and 6 committed, the
        // floor key not put.
        _ = try await etcdClient.put(Array("\(pair.prefix)tombfloor/t".utf8), Array("0 4".utf8))

        try await pair.b.launch(afterStopping: true)
        let clientB = try await pair.b.client()
        for since: UInt64 in [1, 3] {
            #expect(try await resume(clientB, "t", since: since, epoch: epoch).mode == .snapshot, "from \(since): the deletions up to 6 are not known")
        }

        // The next commit (by A, which installed every deletion) cannot vouch for etcd's
        // either: the floor goes up to its basis, and the tomb keys below with it.
        try await clientA.delete("k3", in: "t")  // 7
        let held = try await Self.tombstonesInEtcd(etcdClient, prefix: pair.prefix, repo: "t")
        #expect(held.tombs == ["k3@7"] && held.floor == "6 7", "\(held)")
        for i in 8...9 { try await clientA.set("x", to: int(i), in: "t") }  // 8, 9: the history starts at 8
        try await pair.b.launch(afterStopping: true)
        let restarted = try await pair.b.client()
        let after = try await resume(restarted, "t", since: 6, epoch: epoch)
        #expect(after.mode == .diff && after.diff?.deleted == ["k3"] && after.diff?.values == ["x": int(9)], "\(after)")
        #expect(try await resume(restarted, "t", since: 5, epoch: epoch).mode == .snapshot)
    }
}


extension ClusterTests {
    /// Subscribes `c` to `repo` from `seen` of `epoch` with `catchup` and reads the reply, the
    /// `catchup` event (its line as sent, and parsed) and `synced`.
    func catchUpOnTheWire(_ c: WireConnection, repo: String = "r", since seen: UInt64, epoch: String) throws -> (
        reply: JSONObject, line: String, event: JSONObject, synced: JSONObject
    ) {
        let id = try c.request(["op": "subscribe", "repo": .string(repo), "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true])
        let reply = try c.receive()
        guard reply["id"] == id, reply.ok else { throw ClusterTestFailure("the catch-up was refused: \(reply)") }
        guard let line = try c.receiveLine() else { throw ClusterTestFailure("the connection closed after \(reply)") }
        guard case .object(let event) = try JSONParser.parse(line) else { throw ClusterTestFailure("not an object: \(line)") }
        return (reply, String(decoding: line, as: UTF8.self), event, try c.receive())
    }

    /// The contract's example written through A (CatchUpScenario, as CatchUpTests writes it on
    /// one daemon), caught up through B: B's `catchup` is a `diff` listing exactly the keys
    /// changed and the keys deleted through A — and still is once B has restarted.
    @Test func aCatchUpThroughBOfWritesAndDeletionsThroughAIsADiffAndStillIsOnceBRestarted() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "2"])
        defer { pair.stop() }
        let a = try WireConnection(path: pair.a.socketPath)
        let (seen, epoch) = try CatchUpScenario.write(a)
        for restarted in [false, true] {
            if restarted { try await pair.b.launch(afterStopping: true) }
            let b = try WireConnection(path: pair.b.socketPath)
            let plain = try b.call(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch)])
            #expect(plain.errorCode == "compacted", "B keeps 2 revisions, restarted \(restarted): \(plain)")
            let (reply, line, event, synced) = try catchUpOnTheWire(b, since: seen, epoch: epoch)
            let sub = reply["sub"]?.int64Value ?? -1
            #expect(reply["catchup"]?.stringValue == "diff" && reply["rev"]?.int64Value == CatchUpScenario.revision, "restarted \(restarted): \(reply)\n\(pair.diagnostics)")
            #expect(reply["epoch"]?.stringValue == epoch)
            #expect(line.hasPrefix(#"{"event":"catchup","sub":\#(sub),"repo":"r","from":3,"rev":8,"values":{"#), "restarted \(restarted): \(line)")
            #expect(event["values"] == CatchUpScenario.values, "restarted \(restarted): \(line)")
            #expect(event["deleted"]?.arrayValue == CatchUpScenario.deleted, "what A deleted, restarted \(restarted): \(line)")
            #expect(event["by"] == nil && event["lease"] == nil)
            #expect(synced["event"]?.stringValue == "synced" && synced["rev"]?.int64Value == CatchUpScenario.revision, "\(synced)")
            if restarted {
                // Then live: A's next write reaches B's subscription.
                #expect(try CatchUpScenario.set(a, "lang", "de") == 9)
                let live = try b.receive()
                #expect(live["event"]?.stringValue == "change" && live["rev"]?.int64Value == 9 && live["sub"]?.int64Value == sub, "\(live)")
            }
        }
    }

    /// B cut off while A deletes; etcd compacted: B's watch resumes behind the compaction and
    /// catches up from the change log, its tombstones with it — a catch-up through B is a diff.
    @Test func deletionsBMissedBehindAnEtcdCompactionAreListedByItsDiff() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "3"], bOnItsOwnMember: true)
        defer { pair.stop() }
        let (etcd, a, b) = (pair.etcd, pair.a, pair.b)
        let clientA = try await a.client()
        let clientB = try await b.client()
        let log = EventLog(try await clientB.subscribe(to: "c"))
        _ = try await clientA.apply((1...4).map { .set(Key("k\($0)"), int($0)) }, in: "c")  // 1
        let epoch = try await clientA.list("c").epoch
        #expect(await log.wait(forRevision: 1))

        try await cutOffCompactAndReconnect(etcd, b: b) {
            try await clientA.delete("k1", in: "c")  // 2
            try await clientA.delete("k2", in: "c")  // 3
            try await clientA.set("k3", to: int(30), in: "c")  // 4
        }
        #expect(await log.wait(forRevision: 4, timeout: .seconds(30)), "\(b.log.suffix(3000))")
        #expect(b.log.contains("catching up from the change log"), "the watch did not resume behind the compaction")
        for i in 5...7 { try await clientA.set("x", to: int(i), in: "c") }  // 5…7: B's history starts at 5
        #expect(await log.wait(forRevision: 7))
        let resumed = try await resume(clientB, "c", since: 1, epoch: epoch)
        #expect(resumed.mode == .diff, "\(resumed)\n\(b.log.suffix(3000))")
        #expect(resumed.diff?.deleted == ["k1", "k2"] && resumed.diff?.values == ["k3": int(30), "x": int(7)], "\(resumed)")
    }

    /// B cut off for longer than the change log reaches, while A deletes; etcd compacted: B
    /// stops, and restarted it reads the tomb keys — a catch-up through B is a diff.
    @Test func deletionsBeyondTheChangeLogAreListedByTheDiffOfADaemonThatHadToRestart() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "3"], bOnItsOwnMember: true)
        defer { pair.stop() }
        let (etcd, a, b) = (pair.etcd, pair.a, pair.b)
        let clientA = try await a.client()
        let clientB = try await b.client()
        let log = EventLog(try await clientB.subscribe(to: "c"))
        _ = try await clientA.apply((1...4).map { .set(Key("k\($0)"), int($0)) }, in: "c")  // 1
        let epoch = try await clientA.list("c").epoch
        #expect(await log.wait(forRevision: 1))

        // Six revisions missed, three kept in the change log.
        try await cutOffCompactAndReconnect(etcd, b: b) {
            try await clientA.delete("k1", in: "c")  // 2
            try await clientA.delete("k2", in: "c")  // 3
            try await clientA.set("k3", to: int(30), in: "c")  // 4
            for i in 5...7 { try await clientA.set("x", to: int(i), in: "c") }  // 5…7
        }
        let stopped = await eventually(timeout: .seconds(30)) { () async -> Bool in !b.isRunning }
        #expect(stopped && b.log.contains("no longer holds them all"), "\(b.log.suffix(3000))")
        try await b.launch()
        let resumed = try await resume(try await b.client(), "c", since: 1, epoch: epoch)
        #expect(resumed.mode == .diff, "\(resumed)\n\(b.log.suffix(3000))")
        #expect(resumed.diff?.deleted == ["k1", "k2"] && resumed.diff?.values == ["k3": int(30), "x": int(7)], "\(resumed)")
    }

    /// A lease's end is a commit too: each of its revisions (at most `leaseEndKeys` keys, each
    /// deletion taking its tomb key) leaves a tomb key per key, and a daemon restarted after
    /// it lists them all.
    @Test func aLeaseEndOfMoreKeysThanOneRevisionHoldsLeavesATombKeyPerKey() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "1"])
        defer { pair.stop() }
        let etcdClient = try pair.etcdClient()
        defer { Task { await etcdClient.shutdown() } }
        let holder = try WireConnection(path: pair.a.socketPath)
        let lease = try #require(try holder.call(["op": "grant"])["lease"], "\(pair.diagnostics)")
        let keys = (1...70).map { String(format: "k%02d", $0) }
        // (Two batches: a key a write attaches counts as two operations of its txn.)
        for (i, half) in [keys.prefix(35), keys.suffix(35)].enumerated() {
            let batch = try holder.call(["op": "batch", "repo": "l", "ops": .array(half.map { ["op": "set", "key": .string($0), "value": 1, "lease": lease] })])
            #expect(batch["rev"] == .int(Int64(i + 1)), "\(batch)")
        }
        _ = try CatchUpScenario.set(holder, "other", 1, repo: "l")  // 3
        let epoch = try CatchUpScenario.epoch(holder, repo: "l")
        let revoked = try holder.call(["op": "revoke", "lease": lease])
        // (4, or 5 when B's deletion of the first 60 came first: A names the one it made.)
        #expect([4, 5].contains(revoked["revs"]?.objectValue?["l"]?.int64Value ?? 0), "\(revoked)")

        let held = try await Self.tombstonesInEtcd(etcdClient, prefix: pair.prefix, repo: "l")
        #expect(held.tombs.count == 70 && held.floor == "0 5", "two revisions (60 keys, then 10): \(held.floor ?? "none")")
        #expect(held.tombs.filter { $0.hasSuffix("@4") }.count == 60 && held.tombs.filter { $0.hasSuffix("@5") }.count == 10, "\(held.tombs)")
        try await pair.b.launch(afterStopping: true)
        let resumed = try await resume(try await pair.b.client(), "l", since: 3, epoch: epoch)
        #expect(resumed.mode == .diff && resumed.diff?.deleted == keys.map { Key($0) } && resumed.diff?.values == [:], "\(resumed)")
    }
}

extension ClusterDaemon {
    /// Stops the process (if `afterStopping`) and starts it again.
    func launch(afterStopping: Bool) async throws {
        if afterStopping { stop() }
        try await launch()
    }
}
