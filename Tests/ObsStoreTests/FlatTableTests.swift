// Tests of the flat table: random writes and removals checked against a dictionary after
// every operation (in-place updates, records moved by compaction, the index growing and
// shrinking its runs), records larger than a slab, copy on write, and loading slabs of
// records as a snapshot hands them over — damaged ones refused.

import ObsStore
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

/// A canonical string value of about `size` bytes.
func stringValue(_ n: Int, size: Int) -> CanonicalJSON {
    let text = "v\(n)-" + String(repeating: "x", count: max(0, size - 8))
    return CanonicalJSON(.string(text))
}

/// Checks `table` holds exactly `model`.
func expectSame(_ table: FlatTable, _ model: [Key: Entry<CanonicalJSON>], sourceLocation: SourceLocation = #_sourceLocation) {
    #expect(table.count == model.count, sourceLocation: sourceLocation)
    var seen = 0
    table.forEach { record in
        seen += 1
        #expect(model[record.key] == record.entry, "key \(record.key) as iterated", sourceLocation: sourceLocation)
    }
    #expect(seen == model.count, sourceLocation: sourceLocation)
    for (key, entry) in model { #expect(table[key] == entry, "key \(key) looked up", sourceLocation: sourceLocation) }
}

@Suite(.mayBlock) struct FlatTableTests {
    @Test(arguments: [(keys: 40, ops: 20_000, seed: 1 as UInt64), (keys: 3_000, ops: 60_000, seed: 2), (keys: 200, ops: 30_000, seed: 3)])
    func randomOperationsMatchADictionary(keys: Int, ops: Int, seed: UInt64) {
        var rng = SeededGenerator(seed: seed)
        var table = FlatTable()
        var model: [Key: Entry<CanonicalJSON>] = [:]
        var revision: UInt64 = 0
        for step in 0..<ops {
            let key = Key("key/\(Int.random(in: 0..<keys, using: &rng))")
            revision += UInt64.random(in: 1...3, using: &rng) << (step % 7 == 0 ? 20 : 0)
            switch Int.random(in: 0..<10, using: &rng) {
            case 0..<6:
                // Sizes that keep, shrink and grow records; now and then a large one.
                let size = Int.random(in: 0..<100, using: &rng) == 0 ? Int.random(in: 2_000...40_000, using: &rng) : Int.random(in: 1...120, using: &rng)
                let value = stringValue(step, size: size)
                table.set(key, to: value, revision: revision)
                model[key] = Entry(value: value, revision: revision)
            case 6..<9:
                #expect(table.remove(key) == (model.removeValue(forKey: key) != nil))
            default:
                #expect(table[key] == model[key])
            }
            if step % 997 == 0 { expectSame(table, model) }
        }
        expectSame(table, model)
        // Emptied, it holds (almost) nothing.
        for key in Array(model.keys) {
            table.remove(key)
            model[key] = nil
        }
        expectSame(table, model)
        #expect(table.memoryBytes < 64 << 10 + 16 * 8 * keys)
    }

    @Test func deadBytesAreReclaimed() {
        var table = FlatTable()
        for round in 0..<200 {
            for i in 0..<500 { table.set(Key("k\(i)"), to: stringValue(i, size: 20 + round), revision: UInt64(round * 500 + i + 1)) }
        }
        // 500 live records of ~230 bytes: slabs stay within a small multiple of that.
        #expect(table.count == 500)
        #expect(table.memoryBytes < 4 * 500 * 240 + (64 << 10), "\(table.memoryBytes) bytes held")
        for i in 0..<500 { #expect(table[Key("k\(i)")]?.value == stringValue(i, size: 219)) }
    }

    @Test func recordsLargerThanASlab() {
        var table = FlatTable()
        let big = stringValue(1, size: 3 << 20)
        table.set("big", to: big, revision: 1)
        table.set("small", to: stringValue(2, size: 10), revision: 2)
        table.set("big", to: stringValue(3, size: (3 << 20) - 100), revision: 3)
        #expect(table["big"]?.value == stringValue(3, size: (3 << 20) - 100))
        table.set("big", to: stringValue(4, size: 5 << 20), revision: 4)
        #expect(table["big"] == Entry(value: stringValue(4, size: 5 << 20), revision: 4))
        #expect(table["small"]?.revision == 2)
    }

    @Test func copiesAreValues() {
        var a = FlatTable(revision: 7)
        for i in 0..<100 { a.set(Key("k\(i)"), to: CanonicalJSON(.int(Int64(i))), revision: UInt64(i)) }
        var b = a
        b.set("k1", to: CanonicalJSON(.string("changed")), revision: 8)
        b.remove("k2")
        b.revision = 8
        #expect(a["k1"]?.value == CanonicalJSON(.int(1)) && a["k2"] != nil && a.revision == 7 && a.count == 100)
        #expect(b["k1"]?.value == CanonicalJSON(.string("changed")) && b["k2"] == nil && b.count == 99)
    }

    @Test func valuesCompareAsJSON() {
        var table = FlatTable()
        let object = CanonicalJSON(.object(JSONObject(uniqueMembers: [("a", .int(1)), ("b", .int(2))])))
        table.set("o", to: object, revision: 1)
        table.set("n", to: CanonicalJSON(.int(1)), revision: 1)
        let reordered = CanonicalJSON(.object(JSONObject(uniqueMembers: [("b", .int(2)), ("a", .int(1))])))
        #expect(table.withRecord("o") { $0!.valueEquals(reordered) })
        #expect(table.withRecord("n") { $0!.valueEquals(CanonicalJSON(.double(1.0))) })
        #expect(!table.withRecord("n") { $0!.valueEquals(CanonicalJSON(.int(2))) })
    }

    @Test func adoptedSlabsAreIndexedAndChecked() throws {
        var source = FlatTable()
        for i in 0..<1000 { source.set(Key("key/\(i)"), to: stringValue(i, size: 30), revision: UInt64(i + 1)) }
        var bytes: [UInt8] = []
        source.forEach { bytes.append(contentsOf: $0.encoded) }
        let storage = FlatTableStorage()
        let block = FlatMemory.allocate(bytes.count)
        block.copyMemory(from: bytes, byteCount: bytes.count)
        #expect(try storage.adoptBlock(block, blockCapacity: bytes.count, used: bytes.count) == 1000)
        try storage.buildIndex()
        var loaded = FlatTable(revision: 1000, storage: storage)
        #expect(loaded.count == 1000 && loaded["key/999"]?.value == stringValue(999, size: 30))
        loaded.set("key/5", to: stringValue(5, size: 200), revision: 1001)
        #expect(loaded["key/5"]?.value == stringValue(5, size: 200))

        // A record whose lengths run past its block, and a key stored twice, are refused.
        let twice = FlatTableStorage()
        let doubled = bytes + bytes
        let block2 = FlatMemory.allocate(doubled.count)
        block2.copyMemory(from: doubled, byteCount: doubled.count)
        _ = try twice.adoptBlock(block2, blockCapacity: doubled.count, used: doubled.count)
        #expect(throws: FlatRecordCodec.Malformed.self) { try twice.buildIndex() }
        let cut = FlatTableStorage()
        let block3 = FlatMemory.allocate(bytes.count)
        block3.copyMemory(from: bytes, byteCount: bytes.count)
        #expect(throws: FlatRecordCodec.Malformed.self) { try cut.adoptBlock(block3, blockCapacity: bytes.count, used: bytes.count - 3) }
    }
}
