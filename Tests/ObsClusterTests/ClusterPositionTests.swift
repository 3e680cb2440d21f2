// ObsCluster against a real etcd, without daemons: a group commits only on the position it
// was planned at. A commit that only moves attachments changes no revision, so a group
// planned before it, on the same revision, must still be refused (`stale`) — else a lease's
// end planned before a move deletes the key the move took to another lease (the robustness
// suite's `etcd-end-moved-key`).

import Logging
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import Testing
import TestSupport

@testable import ObsCluster

/// A sink that counts what is delivered.
private final class CountingSink: SharedStorageSink {
    let delivered = Mutex(0)
    func deliver(repo: String, revisions: [SharedRevision], attachments: [SharedAttachment], replacing: Bool) {
        delivered.withLock { $0 += 1 }
    }
    func leaseEnded(_ lease: SharedLease, reason: LeaseEnd.Reason) {}
    func leasesLost(_ ids: [UInt64]) {}
    func historyLost(_ reason: String) {}
}

@Suite(.mayBlock, .serialized, .enabled(if: EtcdCluster.isAvailable, etcdMissing), .timeLimit(.minutes(2)))
struct ClusterPositionTests {
    static func record(_ revision: UInt64, _ key: String, _ value: Int) -> RevisionRecord {
        RevisionRecord(
            repo: "t", changeSet: ChangeSet(revision: revision, changes: [Change(key: Key(key), old: nil, new: CanonicalJSON(.int(Int64(value))))]),
            time: 0, writer: nil)
    }

    @Test func aGroupPlannedBeforeAMoveOfAttachmentsIsStaleThoughTheRevisionIsTheSame() async throws {
        let etcd = try await EtcdCluster.start()
        defer { for i in etcd.members.indices { etcd.kill(i) } }
        let storage = try ClusterStorage(
            configuration: ClusterStorage.Configuration(endpoints: etcd.clientURLs, prefix: "/position-test/", historyLimit: 100),
            logger: Logger(label: "position-test"))
        try await storage.connect()
        _ = try storage.load()
        storage.start(delivering: CountingSink())
        func group(basis: UInt64, _ records: [RevisionRecord]) -> SharedCommit {
            SharedCommit(repo: "t", basisRevision: basis, records: records, writeID: "w-\(UInt64.random(in: 1...UInt64.max))", deadline: .now + .seconds(10))
        }
        guard case .committed = await storage.commit(group(basis: 0, [Self.record(1, "k", 1)])) else { throw ClusterTestFailure("revision 1") }
        // Planned now, on revision 1 …
        let planned = try #require(storage.deliveredPosition(of: "t"))
        // … then a commit that only moves k's attachment (to none): no revision, a new position.
        var move = group(basis: 1, [])
        move.reattached = [SharedReattachment(key: Key("k"), entry: Entry(value: CanonicalJSON(.int(1)), revision: 1), lease: nil)]
        guard case .committed = await storage.commit(move) else { throw ClusterTestFailure("the move") }
        #expect(try #require(storage.deliveredPosition(of: "t")) > planned)

        var stale = group(basis: 1, [Self.record(2, "k2", 2)])
        stale.basisPosition = planned
        guard case .stale = await storage.commit(stale) else { throw ClusterTestFailure("a group planned before the move committed") }
        // Without its position the same group commits: the revision alone cannot tell.
        guard case .committed = await storage.commit(group(basis: 1, [Self.record(2, "k2", 2)])) else { throw ClusterTestFailure("revision 2") }
        storage.close()
    }
}
