// Tests of tombstones in the store — the revision of the last deletion of each absent key,
// which catch-ups list: the snapshot's TOMB blocks read back as written (their floor too,
// across blocks, within a lower bound); a snapshot of an earlier format knows no deletion at
// or below its revision, and the next snapshot keeps those made since; the log replayed after
// a snapshot (a kill -9) remembers each deletion and forgets the tombstone of a key written
// again, a repository the snapshot did not hold knowing every deletion of its own; the
// checkpointer folds the log's deletions into the old snapshot's within the bound, the
// oldest forgotten and the floor raised; a TOMB block that breaks the format is refused,
// naming the file, the offset and what is wrong.

import Foundation
#if canImport(Glibc)
import Glibc
#endif
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

/// Writes to one repository of a store, with the values each change replaces, as the daemon
/// writes them; knows which deletions the daemon would remember (all of them).
private struct Writes {
    let repo: String
    let listener = ListenerStub()
    var revision: UInt64 = 0
    var values: [Key: CanonicalJSON] = [:]
    var deletions: [Key: UInt64] = [:]

    init(_ repo: String, revision: UInt64 = 0, values: [String] = []) {
        self.repo = repo
        self.revision = revision
        for key in values { self.values[Key(key)] = CanonicalJSON(.int(0)) }
    }

    /// One revision: each key set to a value, or deleted (nil).
    mutating func write(_ storage: DiskStorage, _ changes: [(String, JSONValue?)]) {
        revision += 1
        var list: [Change<CanonicalJSON>] = []
        for (name, value) in changes {
            let key = Key(name)
            let new = value.map { CanonicalJSON($0) }
            list.append(Change(key: key, old: values[key], new: new))
            values[key] = new
            deletions[key] = new == nil ? revision : nil
        }
        let record = RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: list), time: 1_700_000_000, writer: nil)
        #expect(storage.append(record, listener: listener))
    }

    mutating func set(_ storage: DiskStorage, _ keys: String...) { write(storage, keys.map { ($0, .int(Int64(revision + 1))) }) }
    mutating func delete(_ storage: DiskStorage, _ keys: String...) { write(storage, keys.map { ($0, nil) }) }

    /// Waits until everything written is durable.
    func durable() -> Bool { waitFor { listener.durable == revision } }
}

private func storeOptions(_ dir: String, limit: Int = Tombstones.defaultLimit) -> DiskStorage.Options {
    var o = options(dir)
    o.checkpointInterval = .seconds(3600)  // a snapshot only when the store closes
    o.tombstoneLimit = limit
    return o
}

/// Each repository's tombstones as `storage` loaded them.
private func tombstones(_ storage: DiskStorage) throws -> [String: Tombstones] {
    Dictionary(uniqueKeysWithValues: try storage.load().map { ($0.name, $0.tombstones) })
}

/// Tombstones as a dictionary (to compare and print).
private func deletions(_ tombstones: Tombstones?) -> [Key: UInt64] {
    Dictionary(uniqueKeysWithValues: (tombstones?.entries ?? []).map { ($0.key, $0.revision) })
}

/// What a kill -9 leaves, in another directory: a crash copy (`crashCopy`) whose snapshot
/// records the copy's own file identity, as the file left in place would (a copy is another
/// file: it starts new epochs, `aCopiedSnapshotStartsANewEpochKnowingNoDeletionBeforeIt`).
func killedCopy(_ dir: String) throws -> String {
    let copy = try crashCopy(dir)
    let path = copy + "/" + SnapshotFormat.fileName
    let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
    let magic = SnapshotFormat.magic.count
    let length = Int(bytes[magic + 4]) | Int(bytes[magic + 5]) << 8 | Int(bytes[magic + 6]) << 16 | Int(bytes[magic + 7]) << 24
    let start = magic + SnapshotFormat.blockHeader
    let identity = try SnapshotLoader.identity(of: path)
    let rewritten = try bytes.withUnsafeBytes { raw in
        var reader = PayloadReader(UnsafeRawBufferPointer(rebasing: raw[start..<(start + length)]))
        guard let version = reader.u32(), let covered = reader.u64(), reader.text(lengthBytes: 2) != nil, let time = reader.u64() else {
            throw TestFailure("\(path) begins with no HEAD")
        }
        var head = PayloadWriter()
        head.u32(version)
        head.u64(covered)
        head.text(identity, lengthBytes: 2)
        head.u64(time)
        var block: [UInt8] = []
        SnapshotWriter.append(SnapshotFormat.Kind.head.rawValue, &block)
        SnapshotWriter.append(UInt32(head.bytes.count), &block)
        SnapshotWriter.append(head.bytes.withUnsafeBytes { SnapshotFormat.checksum(kind: SnapshotFormat.Kind.head.rawValue, payload: $0) }, &block)
        return Array(raw[..<magic]) + block + head.bytes + Array(raw[(start + length)...])
    }
    // Written in place: the file, and so its identity, stays.
    let handle = try FileHandle(forUpdating: URL(fileURLWithPath: path))
    try handle.truncate(atOffset: 0)
    try handle.write(contentsOf: Data(rewritten))
    try handle.close()
    return copy
}

/// A new store, opened and closed (its log and first snapshot in place); the log position
/// that snapshot covers.
private func emptyStore(_ dir: String) throws -> UInt64 {
    try open(storeOptions(dir)).close()
    return try SnapshotLoader.load(dir + "/" + SnapshotFormat.fileName, options: storeOptions(dir)).covered
}

/// A snapshot written block by block (HEAD first, of `version`), as `blocks` say.
private func handMade(_ dir: String, version: UInt32, covering covered: UInt64 = 0, _ blocks: [(SnapshotFormat.Kind, [UInt8])]) throws -> String {
    let path = dir + "/" + SnapshotFormat.fileName
    let output = try SnapshotOutput(path: path)
    var head = PayloadWriter()
    head.u32(version)
    head.u64(covered)
    head.text(try output.identity(), lengthBytes: 2)
    head.u64(0)
    try output.block(.head, head.bytes)
    for (kind, payload) in blocks { try output.block(kind, payload) }
    try output.sync()
    return path
}

private func repoBlock(_ name: String, revision: UInt64) -> [UInt8] {
    var w = PayloadWriter()
    w.text(name, lengthBytes: 2)
    w.text(String(repeating: "e", count: 32), lengthBytes: 1)
    w.u64(revision)
    return w.bytes
}

/// An ENTR block holding `keys`, each at revision 1.
private func entriesBlock(_ keys: [String]) -> [UInt8] {
    var table = FlatTable(revision: 1)
    for key in keys { table.set(Key(key), to: CanonicalJSON(.string("v")), revision: 1) }
    var bytes: [UInt8] = []
    table.forEach { bytes.append(contentsOf: $0.encoded) }
    return bytes
}

private func tombBlock(floor: UInt64, _ entries: [(String, UInt64)], count: UInt32? = nil) -> [UInt8] {
    var w = PayloadWriter()
    w.u64(floor)
    w.u32(count ?? UInt32(entries.count))
    for (key, revision) in entries {
        w.text(key, lengthBytes: 2)
        w.u64(revision)
    }
    return w.bytes
}

private let noLeases: (SnapshotFormat.Kind, [UInt8]) = {
    var w = PayloadWriter()
    w.u64(1)
    w.u32(0)
    return (.leases, w.bytes)
}()

private func doneBlock(repositories: UInt32, entries: UInt64) -> (SnapshotFormat.Kind, [UInt8]) {
    var w = PayloadWriter()
    w.u32(repositories)
    w.u64(entries)
    w.u64(0)
    return (.done, w.bytes)
}

@Suite(.mayBlock) struct TombstoneStorageTests {
    /// Tombstones across several TOMB blocks, a floor without any, none at all: read back as
    /// written; read with a lower bound, the newest are kept and the floor raised.
    @Test func aSnapshotHoldsEachRepositorysTombstonesAndTheirFloor() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let covered = try emptyStore(dir)
        let long = String(repeating: "x", count: 40)
        // 40,000 tombstones of ~60 bytes: more than one block of 1 MiB.
        let many = Tombstones((1...40_000 as ClosedRange<UInt64>).map { (Key("gone/\(long)/\($0)"), $0 + 7) }, limit: .max, floor: 7)
        var state = FlatTable(revision: 50_000)
        state.set(Key("here"), to: CanonicalJSON(.int(1)), revision: 50_000)
        let repositories = [
            LoadedRepository(name: "many", epoch: Epoch.random(), state: state, history: [], tombstones: many),
            LoadedRepository(name: "floor", epoch: Epoch.random(), state: FlatTable(revision: 9), history: [], tombstones: Tombstones(floor: 9)),
            LoadedRepository(name: "none", epoch: Epoch.random(), state: FlatTable(revision: 4), history: [], tombstones: Tombstones()),
        ]
        _ = try SnapshotLoader.write(repositories, leases: PersistedLeases(), covering: covered, directory: dir)

        let reopened = try open(storeOptions(dir))
        let loaded = try tombstones(reopened)
        reopened.close()
        let same = loaded["many"] == many
        #expect(same && loaded["many"]?.count == 40_000, "\(loaded["many"]?.count ?? 0) tombstones, floor \(loaded["many"]?.floor ?? 0)")
        #expect(loaded["floor"]?.floor == 9 && loaded["floor"]?.isEmpty == true)
        #expect(loaded["none"]?.floor == 0 && loaded["none"]?.isEmpty == true, "a repository that knows all its deletions still does")

        let bounded = try SnapshotLoader.load(dir + "/" + SnapshotFormat.fileName, options: storeOptions(dir, limit: 25_000))
        let newest = try #require(bounded.repositories.first { $0.name == "many" }?.tombstones)
        #expect(newest.count == 25_000 && newest.floor == 15_007, "the oldest 15,000 forgotten: the floor is the newest of them")
        #expect(newest[Key("gone/\(long)/40000")] == 40_007 && newest[Key("gone/\(long)/15000")] == nil)
    }

    /// A snapshot of format 2 (no TOMB): no deletion at or below its revision is known; those
    /// made since are, replayed from the log after a kill and in the next snapshot (format 3).
    @Test func aSnapshotOfAnEarlierFormatKnowsNoDeletionBeforeItsRevisionAndTheNextKeepsThoseSince() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let covered = try emptyStore(dir)
        _ = try handMade(
            dir, version: 2, covering: covered,
            [(.repository, repoBlock("a", revision: 3)), (.entries, entriesBlock(["y", "z"])), noLeases, doneBlock(repositories: 1, entries: 2)])

        let storage = try open(storeOptions(dir))
        let loaded = try tombstones(storage)
        #expect(loaded["a"]?.floor == 3 && loaded["a"]?.isEmpty == true, "\(String(describing: loaded["a"]))")
        var a = Writes("a", revision: 3, values: ["y", "z"])
        a.delete(storage, "y")
        a.set(storage, "x")
        #expect(a.durable())
        let crashed = try killedCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()

        let recovered = try open(storeOptions(crashed))
        let replayed = try tombstones(recovered)["a"]
        recovered.close()
        #expect(replayed?.floor == 3 && deletions(replayed) == [Key("y"): 4], "\(deletions(replayed))")

        let reopened = try open(storeOptions(dir))
        let checkpointed = try tombstones(reopened)["a"]
        reopened.close()
        #expect(checkpointed?.floor == 3 && deletions(checkpointed) == [Key("y"): 4], "\(deletions(checkpointed))")
        let head = try Data(contentsOf: URL(fileURLWithPath: dir + "/" + SnapshotFormat.fileName))[20..<24]
        #expect(head.elementsEqual([3, 0, 0, 0]), "the snapshot the checkpointer wrote is of format 3")
    }

    /// After a snapshot holding tombstones, a kill: the log replayed on top remembers each
    /// deletion and forgets the tombstone of a key written again; a repository the snapshot
    /// did not hold knows every deletion of its own (floor 0).
    @Test func theLogAfterASnapshotRemembersDeletionsAndForgetsKeysWrittenAgain() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var a = Writes("a")
        do {
            let storage = try open(storeOptions(dir))
            a.set(storage, "k1", "k2", "k3", "k4", "k5")
            a.delete(storage, "k1")
            a.delete(storage, "k2")
            storage.close()
        }
        let storage = try open(storeOptions(dir))
        #expect(deletions(try tombstones(storage)["a"]) == [Key("k1"): 2, Key("k2"): 3], "the snapshot holds them")
        a.set(storage, "k1")  // 4: written again, no tombstone
        a.delete(storage, "k3")  // 5
        a.set(storage, "k6")  // 6
        a.delete(storage, "k6")  // 7: created and deleted since
        a.set(storage, "k2")  // 8
        a.delete(storage, "k2")  // 9: deleted again
        var b = Writes("b")
        b.set(storage, "x", "y")
        b.delete(storage, "x")
        #expect(a.durable() && b.durable())
        let crashed = try killedCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()

        let recovered = try open(storeOptions(crashed))
        let loaded = try tombstones(recovered)
        recovered.close()
        #expect(a.deletions == [Key("k2"): 9, Key("k3"): 5, Key("k6"): 7])
        #expect(loaded["a"]?.floor == 0 && deletions(loaded["a"]) == a.deletions, "\(deletions(loaded["a"]))")
        #expect(loaded["b"]?.floor == 0 && deletions(loaded["b"]) == [Key("x"): 2], "\(deletions(loaded["b"]))")
    }

    /// A copied snapshot (a restored backup) starts a new epoch: the deletions before it are
    /// no longer known — those of the log replayed on top of it are.
    @Test func aCopiedSnapshotStartsANewEpochKnowingNoDeletionBeforeIt() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var a = Writes("a")
        do {
            let storage = try open(storeOptions(dir))
            a.set(storage, "k1", "k2", "k3")
            a.delete(storage, "k1")
            storage.close()
        }
        let storage = try open(storeOptions(dir))
        #expect(deletions(try tombstones(storage)["a"]) == [Key("k1"): 2])
        a.delete(storage, "k2")
        a.set(storage, "k4")
        #expect(a.durable())
        let copy = try crashCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: copy) }
        storage.close()

        let restored = try open(storeOptions(copy))
        let loaded = try tombstones(restored)["a"]
        #expect(restored.notices.contains { $0.contains("starts a new epoch") }, "\(restored.notices)")
        restored.close()
        #expect(loaded?.floor == 2 && deletions(loaded) == [Key("k2"): 3], "\(deletions(loaded)), floor \(loaded?.floor ?? 0)")
    }

    /// With a bound of 5: the checkpointer keeps the newest 5 deletions, the floor raised to
    /// the newest forgotten; then folds the log's into them — a key written again leaves, the
    /// new deletions come in, the oldest go — as the log replayed after a kill does.
    @Test func aCheckpointFoldsTheLogsDeletionsIntoTheSnapshotsWithinTheBound() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var a = Writes("a")
        do {
            let storage = try open(storeOptions(dir, limit: 5))
            a.write(storage, (0..<20).map { ("k\($0)", .int(1)) })
            for k in 0..<10 { a.delete(storage, "k\(k)") }  // k0 at revision 2 … k9 at 11
            storage.close()
        }
        let storage = try open(storeOptions(dir, limit: 5))
        let first = try tombstones(storage)["a"]
        #expect(first?.floor == 6 && deletions(first) == Dictionary(uniqueKeysWithValues: (5..<10).map { (Key("k\($0)"), UInt64($0) + 2) }), "\(deletions(first))")
        a.set(storage, "k7")  // 12
        a.delete(storage, "k10")  // 13
        a.delete(storage, "k11")  // 14
        #expect(a.durable())
        let crashed = try killedCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()

        let expected: [Key: UInt64] = [Key("k6"): 8, Key("k8"): 10, Key("k9"): 11, Key("k10"): 13, Key("k11"): 14]
        let reopened = try open(storeOptions(dir, limit: 5))
        let checkpointed = try tombstones(reopened)["a"]
        #expect(!reopened.notices.contains { $0.contains("replayed") }, "the checkpoint at the stop took the log: \(reopened.notices)")
        reopened.close()
        #expect(checkpointed?.floor == 7 && deletions(checkpointed) == expected, "folded: \(deletions(checkpointed)), floor \(String(describing: checkpointed?.floor))")
        let recovered = try open(storeOptions(crashed, limit: 5))
        let replayed = try tombstones(recovered)["a"]
        recovered.close()
        #expect(replayed?.floor == 7 && deletions(replayed) == expected, "replayed: \(deletions(replayed)), floor \(String(describing: replayed?.floor))")
    }

    /// An old snapshot's tombstones over several blocks, a bound below their number, keys
    /// written again in every part of them: the checkpointer keeps the newest of what stays,
    /// as many as the bound; a start after a kill bounds them as it loads, then replays.
    @Test func aCheckpointFoldsTombstonesSpanningSeveralBlocks() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let covered = try emptyStore(dir)
        let long = String(repeating: "x", count: 40)
        func gone(_ i: Int) -> String { "gone/\(long)/\(i)" }
        let old = (0..<40_000).map { (key: Key(gone($0)), revision: UInt64($0) + 1) }
        var state = FlatTable(revision: 40_010)
        for i in 0..<10 { state.set(Key("here/\(i)"), to: CanonicalJSON(.int(0)), revision: 40_001 + UInt64(i)) }
        _ = try SnapshotLoader.write(
            [LoadedRepository(name: "big", epoch: Epoch.random(), state: state, history: [], tombstones: Tombstones(old, limit: .max))],
            leases: PersistedLeases(), covering: covered, directory: dir)

        let storage = try open(storeOptions(dir, limit: 30_000))
        var big = Writes("big", revision: 40_010, values: (0..<10).map { "here/\($0)" })
        big.set(storage, gone(5))  // among the oldest: forgotten as the start bounded them
        big.set(storage, gone(20_000), gone(20_001), gone(20_002))
        big.set(storage, gone(39_999))  // the newest
        big.delete(storage, "here/0")
        big.delete(storage, "here/1")
        #expect(big.durable())
        let crashed = try killedCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()

        func apply(_ tombstones: inout Tombstones) {
            for i in [5, 20_000, 20_001, 20_002, 39_999] { tombstones.remove(Key(gone(i))) }
            tombstones.deleted(Key("here/0"), at: 40_014)
            tombstones.deleted(Key("here/1"), at: 40_015)
        }
        // The checkpointer: what stays of the old, then the new, the oldest beyond the bound gone.
        var folded = Tombstones(old, limit: .max)
        apply(&folded)
        folded.setLimit(30_000)
        let reopened = try open(storeOptions(dir, limit: 30_000))
        let checkpointed = try #require(try tombstones(reopened)["big"])
        #expect(!reopened.notices.contains { $0.contains("replayed") }, "the checkpoint at the stop took the log: \(reopened.notices)")
        reopened.close()
        let folds = checkpointed == folded
        #expect(folds && checkpointed.count == 30_000, "floor \(checkpointed.floor), \(checkpointed.count) tombstones")
        // After a kill: bounded as the snapshot loads, then the log replayed.
        var replayed = Tombstones(old, limit: 30_000)
        apply(&replayed)
        // Both keep the newest deletions, but not the same number: a replay cannot be taken for the checkpoint.
        #expect(replayed.floor == 10_000 && folded.floor == 9_998)
        let recovered = try open(storeOptions(crashed, limit: 30_000))
        let loaded = try #require(try tombstones(recovered)["big"])
        recovered.close()
        let replays = loaded == replayed
        #expect(replays, "floor \(loaded.floor), \(loaded.count) tombstones; expected floor \(replayed.floor), \(replayed.count)")
    }

    /// TOMB blocks that pass their checksum but break the format: refused, naming the file,
    /// the block's offset and what is wrong.
    @Test(arguments: [
        ([(SnapshotFormat.Kind.tombstones, [UInt8](repeating: 0, count: 10))], "a TOMB block cut short"),
        ([(.tombstones, tombBlock(floor: 0, [("gone", 1)], count: 2))], "a tombstone that does not decode"),
        ([(.tombstones, tombBlock(floor: 0, [("gone", 1)]) + [0])], "bytes after its tombstones"),
        ([(.tombstones, tombBlock(floor: 9, []))], "a tombstone floor 9 above the repository's revision 5"),
        ([(.tombstones, tombBlock(floor: 1, [("gone", 6)]))], "a tombstone of revision 6"),
        ([(.tombstones, tombBlock(floor: 1, [("gone", 1)]))], "a tombstone of revision 1"),
        ([(.tombstones, tombBlock(floor: 0, [("a", 3), ("b", 2)]))], "a tombstone of revision 2"),
        ([(.tombstones, tombBlock(floor: 0, [("a", 2), ("a", 3)]))], "key \"a\" deleted twice"),
        ([(.tombstones, tombBlock(floor: 0, [])), (.tombstones, tombBlock(floor: 1, []))], "a tombstone floor other than"),
        ([(.tombstones, tombBlock(floor: 0, [])), (.entries, entriesBlock(["late"]))], "entries outside a repository, or after its attachments or tombstones"),
        ([], "repository a ends without its TOMB block"),
    ])
    func aTombstoneBlockThatBreaksTheFormatIsRefused(_ blocks: [(SnapshotFormat.Kind, [UInt8])], _ reason: String) throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = try handMade(
            dir, version: 3, [(.repository, repoBlock("a", revision: 5)), (.entries, entriesBlock(["here"]))] + blocks + [noLeases, doneBlock(repositories: 1, entries: 1)])
        #expect {
            _ = try SnapshotLoader.load(path, options: storeOptions(dir))
        } throws: { error in
            guard let error = error as? StorageError, error.kind == .corrupt else { return false }
            return error.description.contains(path) && error.description.contains("the block at offset") && error.description.contains(reason)
        }
    }

    /// A tombstone of a key the repository holds: refused, naming the key.
    @Test func aTombstoneOfAKeyThatIsThereIsRefused() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = try handMade(
            dir, version: 3,
            [(.repository, repoBlock("a", revision: 5)), (.entries, entriesBlock(["here"])), (.tombstones, tombBlock(floor: 0, [("here", 2)])), noLeases,
             doneBlock(repositories: 1, entries: 1)])
        #expect {
            _ = try SnapshotLoader.load(path, options: storeOptions(dir))
        } throws: { error in
            guard let error = error as? StorageError, error.kind == .corrupt else { return false }
            return error.description.contains(path) && error.description.contains("holds key \"here\" and a tombstone of it")
        }
    }
}
