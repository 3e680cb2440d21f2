// ObsCluster without a cluster: the key layout, and the encodings of values and of the
// change log read back exactly.

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
