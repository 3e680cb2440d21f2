// ObsCluster without a cluster: the operations of a commit's txn — the tombstones it keeps in
// etcd (a tomb key per key the group leaves deleted, the re-created keys' tomb keys deleted,
// the floor key put, raised with the tomb keys at or below it deleted where the deletions go
// past the bound or etcd cannot vouch for its tombstones), that `limitExceeded` counts every
// operation the txn holds, and that no txn puts a key one of its deletions covers (etcd
// refuses such a txn whole: "duplicate key given in txn request").

import Logging
import ObsEtcd
import ObsProtocol
import ObsStore
import ObservableKit
import Testing
import TestSupport

@testable import ObsCluster

@Suite struct ClusterCommitTests {
    let layout = KeyLayout(prefix: "/obsd/")

    func storage(historyLimit: Int = 100, maxTxnOps: Int = 128) throws -> ClusterStorage {
        var configuration = ClusterStorage.Configuration(endpoints: ["http://127.0.0.1:1"], prefix: "/obsd/", historyLimit: historyLimit)
        configuration.maxTxnOps = maxTxnOps
        return try ClusterStorage(configuration: configuration, logger: Logger(label: "test"))
    }

    static func value(_ i: Int) -> CanonicalJSON { CanonicalJSON(.int(Int64(i))) }

    /// A record of `repo` "t" at `revision`: `deleted` keys deleted (they existed), `created`
    /// keys created (they did not), `set` keys changed.
    static func record(_ revision: UInt64, deleted: [String] = [], created: [String] = [], set: [String] = []) -> RevisionRecord {
        var changes = deleted.map { Change(key: Key($0), old: value(0), new: nil) }
        changes += created.map { Change(key: Key($0), old: nil, new: value(Int(revision))) }
        changes += set.map { Change(key: Key($0), old: value(0), new: value(Int(revision))) }
        return RevisionRecord(repo: "t", changeSet: ChangeSet(revision: revision, changes: changes), time: 0, writer: nil)
    }

    static func group(basis: UInt64, _ records: [RevisionRecord], removed: [String: UInt64] = [:], floor: UInt64 = 0) -> SharedCommit {
        var commit = SharedCommit(repo: "t", basisRevision: basis, records: records, writeID: "w-1", deadline: .now + .seconds(4))
        commit.tombstonesRemoved = Dictionary(uniqueKeysWithValues: removed.map { (Key($0.key), $0.value) })
        commit.tombstoneFloor = floor
        return commit
    }

    /// The txn's operations on tomb keys and the floor key, as text.
    func tombOperations(_ success: [EtcdOp]) -> [String] {
        let tomb = layout.tombPrefix
        let floorKey = layout.tombFloorPrefix
        func text(_ bytes: some Collection<UInt8>) -> String { String(decoding: bytes, as: UTF8.self) }
        return success.compactMap { op -> String? in
            switch op {
            case .put(let key, let value, _, _) where key.starts(with: floorKey): return "floor \(text(value))"
            case .put(let key, _, _, _) where key.starts(with: tomb): return "put \(text(key.dropFirst(tomb.count)))"
            case .deleteRange(let key, let end, _) where key.starts(with: tomb):
                return "delete \(text(key.dropFirst(tomb.count)))" + (end.map { "..<\(text($0.dropFirst(tomb.count)))" } ?? "")
            default: return nil
            }
        }
    }

    @Test func aGroupPutsATombKeyPerKeyItLeavesDeletedAndDeletesTheReCreatedKeysOnes() throws {
        let store = try storage()
        store.tombFloors.withLock { $0["t"] = TombFloor(floor: 0, through: 5) }
        let group = Self.group(
            basis: 5,
            [
                Self.record(6, deleted: ["a"], created: ["b", "x"]),
                Self.record(7, deleted: ["b"], created: ["a"]),
                Self.record(8, deleted: ["c"]),
            ], removed: ["b": 3])
        let (_, success, _) = store.transaction(for: group, position: 40)
        #expect(
            tombOperations(success) == [
                "delete t/00000000000000000003/b",
                "put t/00000000000000000007/b",
                "put t/00000000000000000008/c",
                "floor 0 8",
            ], "a, deleted then created again, has none; b's old one goes, its new one is put")
        // The values and the log as before.
        #expect(success.contains(.deleteRange(key: layout.dataKey("t", Key("c")))))
        #expect(success.contains { if case .put(let key, _, _, _) = $0 { key == layout.logKey("t", 8) } else { false } })
    }

    @Test func theFloorRisesToThePlannedOneAndNeverGoesDown() throws {
        let store = try storage()
        store.tombFloors.withLock { $0["t"] = TombFloor(floor: 2, through: 5) }
        // The installs forget the deletions up to 4 (past the bound); b's tombstone, at 3, is
        // among them: the range deletes it.
        let raised = Self.group(basis: 5, [Self.record(6, deleted: ["d"], created: ["b"])], removed: ["b": 3], floor: 4)
        #expect(
            tombOperations(store.transaction(for: raised, position: 40).success) == [
                "delete t/..<t/00000000000000000005/", "put t/00000000000000000006/d", "floor 4 6",
            ])
        // A daemon that remembers more (a larger bound) does not lower etcd's floor.
        let lower = Self.group(basis: 5, [Self.record(6, deleted: ["d"])], floor: 1)
        #expect(tombOperations(store.transaction(for: lower, position: 40).success) == ["put t/00000000000000000006/d", "floor 2 6"])
        // Its own deletions forgotten at once (more than the bound in one revision): no tomb key.
        let forgotten = Self.group(basis: 5, [Self.record(6, deleted: ["d", "e"])], floor: 6)
        #expect(tombOperations(store.transaction(for: forgotten, position: 40).success) == ["delete t/..<t/00000000000000000007/", "floor 6 6"])
    }

    @Test func tombstonesEtcdCannotVouchForGoUpToTheBasis() throws {
        let store = try storage()
        // The floor key is behind the counter (a daemon that keeps no tombstones committed 4
        // and 5): what etcd holds is not every deletion up to 5.
        store.tombFloors.withLock { $0["t"] = TombFloor(floor: 0, through: 3) }
        let group = Self.group(basis: 5, [Self.record(6, deleted: ["d"])])
        #expect(tombOperations(store.transaction(for: group, position: 40).success) == ["delete t/..<t/00000000000000000006/", "put t/00000000000000000006/d", "floor 5 6"])
        // No floor key at all on a repository with revisions (older than tombstones in etcd).
        store.tombFloors.withLock { $0 = [:] }
        #expect(tombOperations(store.transaction(for: group, position: 40).success) == ["delete t/..<t/00000000000000000006/", "put t/00000000000000000006/d", "floor 5 6"])
        // A new repository: every deletion is known from its first revision.
        let first = Self.group(basis: 0, [Self.record(1, created: ["a"]), Self.record(2, deleted: ["a"])])
        #expect(tombOperations(store.transaction(for: first, position: 0).success) == ["put t/00000000000000000002/a", "floor 0 2"])
    }

    @Test func aGroupThatOnlyMovesAttachmentsLeavesTheTombstonesAlone() throws {
        let store = try storage()
        store.tombFloors.withLock { $0["t"] = TombFloor(floor: 0, through: 5) }
        var group = Self.group(basis: 5, [])
        group.reattached = [SharedReattachment(key: Key("a"), entry: Entry(value: Self.value(1), revision: 4), lease: 7)]
        let (_, success, _) = store.transaction(for: group, position: 40)
        #expect(tombOperations(success).isEmpty && success.count == 2, "the counter (unchanged) and the value with its lease: \(success)")
    }

    /// Random groups: `limitExceeded` counts at least the operations the txn holds, and no
    /// put lies in a range the txn deletes, nor is any key put twice.
    @Test func everyTxnIsWithinTheCountedOperationsAndPutsNoKeyItDeletes() throws {
        var rng = SeededGenerator(seed: 35)
        for round in 0..<400 {
            let historyLimit = Int(rng.next() % 4) + 1
            let store = try storage(historyLimit: historyLimit)
            let basis = rng.next() % 12
            let known = rng.next() % 4 == 0 ? nil : TombFloor(floor: min(basis, rng.next() % 6), through: rng.next() % 3 == 0 ? basis / 2 : basis)
            store.tombFloors.withLock { $0["t"] = known }
            // Keys k0…k7; those in `absent` do not exist on the basis, some with a tombstone.
            var absent = Set((0..<8).filter { _ in rng.next() % 2 == 0 }.map { "k\($0)" })
            var removed: [String: UInt64] = [:]
            var tombstones = Dictionary(uniqueKeysWithValues: absent.filter { _ in rng.next() % 2 == 0 && basis > 0 }.map { ($0, 1 + rng.next() % basis) })
            var records: [RevisionRecord] = []
            for revision in (basis + 1)...(basis + 1 + rng.next() % 5) {
                var deleted: [String] = []
                var created: [String] = []
                var set: [String] = []
                for key in (0..<8).map({ "k\($0)" }) where rng.next() % 3 == 0 {
                    if absent.contains(key) {
                        created.append(key)
                        absent.remove(key)
                        if let at = tombstones.removeValue(forKey: key) { removed[key] = at }
                    } else if rng.next() % 2 == 0 {
                        deleted.append(key)
                        absent.insert(key)
                    } else {
                        set.append(key)
                    }
                }
                if deleted.isEmpty && created.isEmpty && set.isEmpty { set = ["k0"] }
                records.append(Self.record(revision, deleted: deleted, created: created, set: set))
            }
            let floor = rng.next() % 2 == 0 ? 0 : rng.next() % (records.last!.revision + 1)
            let group = Self.group(basis: basis, records, removed: removed, floor: floor)
            let (_, success, _) = store.transaction(for: group, position: 40)
            // With room for one operation fewer than the txn holds, the count must say it does
            // not fit (`extraOperations`: the planner's count of re-created keys with a tombstone).
            let tight = try storage(historyLimit: historyLimit, maxTxnOps: success.count - 1)
            #expect(tight.limitExceeded(by: records, extraOperations: removed.count) != nil, "round \(round): the txn holds \(success.count) operations, more than counted")
            var puts = Set<[UInt8]>()
            var ranges: [(key: [UInt8], end: [UInt8]?)] = []
            for op in success {
                switch op {
                case .put(let key, _, _, _): #expect(puts.insert(key).inserted, "round \(round): \(String(decoding: key, as: UTF8.self)) put twice")
                case .deleteRange(let key, let end, _): ranges.append((key, end))
                case .range: break
                }
            }
            for key in puts {
                for range in ranges {
                    let inside = range.end.map { !key.lexicographicallyPrecedes(range.key) && key.lexicographicallyPrecedes($0) } ?? (key == range.key)
                    #expect(!inside, "round \(round) (history \(historyLimit), \(records.count) records on \(basis)): \(String(decoding: key, as: UTF8.self)) is put and deleted by the same txn")
                }
            }
        }
    }
}
