// ObsCluster without a cluster: the key layout (tomb keys sorting by revision, the floor key),
// and the encodings of values (with their lease attachment), of the change log (with a
// lease's end), of lease records and of the tombstone floor read back exactly.

import ObsProtocol
import ObsStore
import ObservableKit
import Testing

@testable import ObsCluster

@Suite struct KeyLayoutTests {
    let layout = KeyLayout(prefix: "/obsd/")

    @Test func everyKeyIsUnderThePrefixAndClassifiesBack() {
        let key = Key("a/b c")
        #expect(layout.classify(layout.epochKey) == .epoch)
        #expect(layout.classify(layout.counterKey("ui")) == .counter(repo: "ui"))
        #expect(layout.classify(layout.dataKey("ui", key)) == .data(repo: "ui"))
        #expect(layout.key(ofDataKey: layout.dataKey("ui", key), repo: "ui") == key)
        #expect(layout.classify(layout.logKey("ui", 7)) == .log(repo: "ui"))
        #expect(String(decoding: layout.logKey("ui", 7), as: UTF8.self) == "/obsd/log/ui/00000000000000000007")
        #expect(layout.classify(Array("/other/rev/ui".utf8)) == .other)
        #expect(layout.classify(Array("/obsd/data/ui".utf8)) == .other)
        for k in [layout.epochKey, layout.counterKey("x"), layout.dataKey("x", key), layout.logKey("x", 1)] {
            #expect(k.starts(with: Array("/obsd/".utf8)))
        }
        // Log keys sort by revision.
        #expect(layout.logKey("ui", 9).lexicographicallyPrecedes(layout.logKey("ui", 10)))
    }

    @Test func tombKeysSortByRevisionAndReadBack() {
        let key = Key("a/b c")
        let tomb = layout.tombKey("ui", 7, key)
        #expect(String(decoding: tomb, as: UTF8.self) == "/obsd/tomb/ui/00000000000000000007/a/b c")
        #expect(layout.classify(tomb) == .tomb(repo: "ui"))
        #expect(layout.tombstone(ofTombKey: tomb, repo: "ui").map { $0.revision == 7 && $0.key == key } == true)
        #expect(layout.tombstone(ofTombKey: tomb, repo: "u") == nil)
        #expect(layout.tombstone(ofTombKey: Array("/obsd/tomb/ui/7/a".utf8), repo: "ui") == nil)
        #expect(layout.classify(layout.tombFloorKey("ui")) == .tombFloor(repo: "ui"))
        #expect(String(decoding: layout.tombFloorKey("ui"), as: UTF8.self) == "/obsd/tombfloor/ui")
        // The tomb keys of the revisions up to N lie before the range's end for N + 1, those
        // of N + 1 and later from it on.
        let end = layout.tombPrefix("ui", revision: 10)
        #expect(layout.tombKey("ui", 9, Key("\u{10FFFF}")).lexicographicallyPrecedes(end))
        #expect(!layout.tombKey("ui", 10, Key("")).lexicographicallyPrecedes(end))
        #expect(layout.tombKey("ui", 9, key).starts(with: layout.tombPrefix("ui")))
        #expect(!layout.tombKey("ui2", 9, key).starts(with: layout.tombPrefix("ui")))

        #expect(Codec.tombFloor(from: Codec.tombFloor(TombFloor(floor: 3, through: 9))) == TombFloor(floor: 3, through: 9))
        #expect(String(decoding: Codec.tombFloor(TombFloor(floor: 0, through: 12)), as: UTF8.self) == "0 12")
        for bad in ["", "3", "3 ", "a 4", "5 4", "1 2 3"] { #expect(Codec.tombFloor(from: Array(bad.utf8)) == nil, "\(bad)") }
        // Deletions etcd does not hold through the counter are unknown.
        #expect(TombFloor.floor(of: TombFloor(floor: 3, through: 9), at: 9) == 3)
        #expect(TombFloor.floor(of: TombFloor(floor: 3, through: 8), at: 9) == 9)
        #expect(TombFloor.floor(of: nil, at: 9) == 9)
    }

    @Test func valuesAndLogRecordsRoundTrip() throws {
        let data = Codec.data(revision: 42, value: CanonicalJSON(JSONValue.object(JSONObject(uniqueMembers: [("b", .int(1)), ("a", .double(1.5))]))))
        let entry = try Codec.data(from: data)
        #expect(entry.revision == 42)
        #expect(String(decoding: entry.value.bytes, as: UTF8.self) == #"{"b":1,"a":1.5}"#)
        #expect(!entry.value.isPlain)

        let changes: [Change<CanonicalJSON>] = [
            Change(key: Key("theme"), old: CanonicalJSON(.string("light")), new: CanonicalJSON(.string("dark"))),
            Change(key: Key("draft"), old: CanonicalJSON(.null), new: nil),
            Change(key: Key("lang\n"), old: nil, new: CanonicalJSON(.int(-9_000_000_000_000))),
        ]
        let record = RevisionRecord(
            repo: "ui", changeSet: ChangeSet(revision: 43, changes: changes), time: 1_700_000_000,
            writer: Writer(uid: 1000, gid: 100, pid: -1))
        let decoded = try Codec.log(from: Codec.log(record, writeID: "abc-1"), repo: "ui")
        #expect(decoded.writeID == "abc-1")
        #expect(decoded.record.revision == 43)
        #expect(decoded.record.time == 1_700_000_000)
        #expect(decoded.record.writer == Writer(uid: 1000, gid: 100, pid: -1))
        #expect(decoded.record.changes == changes)
        #expect(decoded.record.changes.map { $0.new?.bytes } == changes.map { $0.new?.bytes })
        #expect(throws: Malformed.self) { try Codec.log(from: Array("{}".utf8), repo: "ui") }
        #expect(throws: Malformed.self) { try Codec.data(from: Array("x {}".utf8)) }
    }

    @Test func leaseKeysAttachmentsLeaseEndsAndLeaseRecordsRoundTrip() throws {
        #expect(layout.classify(layout.leaseCounterKey) == .leaseCounter)
        #expect(layout.classify(layout.leaseKey(7)) == .lease(id: 7))
        #expect(layout.classify(layout.aliveKey(7)) == .alive(id: 7))
        #expect(String(decoding: layout.aliveKey(7), as: UTF8.self) == "/obsd/alive/00000000000000000007")
        #expect(layout.classify(Array("/obsd/lease/x".utf8)) == .other)

        let value = CanonicalJSON(JSONValue.string("@ not a lease"))
        let attached = Codec.data(revision: 3, value: value, lease: 12)
        #expect(String(decoding: attached, as: UTF8.self) == #"3 @12 "@ not a lease""#)
        #expect(Codec.lease(ofData: attached) == 12)
        #expect(try Codec.data(from: attached).value == value && Codec.data(from: attached).revision == 3)
        #expect(Codec.lease(ofData: Codec.data(revision: 3, value: value)) == nil, "a value of no lease, even one starting with @")

        let record = RevisionRecord(
            repo: "svc", changeSet: ChangeSet(revision: 5, changes: [Change(key: Key("up"), old: CanonicalJSON(.bool(true)), new: nil)]), time: 1,
            writer: Writer(uid: 1, gid: 2, pid: 3))
        let end = try Codec.log(from: Codec.log(record, writeID: "w", lease: LeaseEnd(lease: 12, reason: .expired)), repo: "svc")
        #expect(end.lease == LeaseEnd(lease: 12, reason: .expired) && end.record.changes == record.changes)
        #expect(try Codec.log(from: Codec.log(record, writeID: "w"), repo: "svc").lease == nil)
        // The record read back carries the end too: a restarted daemon's history is the records
        // ClusterLoader reads, and its `since` replay of the end must name the lease (found by
        // the robustness suite: the replayed event had no `lease`).
        #expect(end.record.leaseEnd == LeaseEnd(lease: 12, reason: .expired))
        #expect(try Codec.log(from: Codec.log(record, writeID: "w"), repo: "svc").record.leaseEnd == nil)

        var lease = LeaseRecord(id: 12, owner: Writer(uid: 1000, gid: 1000, pid: 77), ttl: 30, daemon: "d1", grant: "g1")
        #expect(try Codec.lease(from: Codec.lease(lease)) == lease)
        lease.revoked = true
        #expect(try Codec.lease(from: Codec.lease(lease)) == lease)
        let bound = LeaseRecord(id: 13, owner: Writer(uid: 0, gid: 0, pid: 1), ttl: nil, daemon: "d2", grant: "g2")
        #expect(try Codec.lease(from: Codec.lease(bound)) == bound)
        #expect(throws: Malformed.self) { try Codec.lease(from: Array(#"{"id":1}"#.utf8)) }
    }

    @Test func theLoadedHistoryIsTheContiguousTailWithinTheLimit() {
        func record(_ revision: UInt64) -> RevisionRecord {
            RevisionRecord(repo: "r", changeSet: ChangeSet(revision: revision, changes: [Change(key: Key("k"), old: nil, new: CanonicalJSON(.int(1)))]), time: 0, writer: nil)
        }
        let records = [1, 2, 4, 5, 6].map { record(UInt64($0)) }.shuffled()
        #expect(ClusterLoader.contiguousTail(records, endingAt: 6, limit: 10).map(\.revision) == [4, 5, 6])
        #expect(ClusterLoader.contiguousTail(records, endingAt: 6, limit: 2).map(\.revision) == [5, 6])
        #expect(ClusterLoader.contiguousTail(records, endingAt: 7, limit: 10).isEmpty)
    }
}
