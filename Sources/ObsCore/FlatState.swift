// ObsCore — a repository's keys, values and revision as the value core keeps them: the write
// rules of ObservableKit's `KeyedState` (an equal value is not a change, `force` makes it one,
// `ifRevision` is compare-and-set, a batch is atomic, shares one revision and may not write a
// key twice, a write that changes nothing raises no revision) over ObsStore's `FlatTable` —
// records in slabs, not a dictionary of per-key allocations — which is also what a snapshot
// loads into. Values are compared where they lie; a value is copied out only when it is part
// of a change (the change carries it to the history, the log and the events).

import ObsStore
import ObsValues
import ObservableKit

/// The entries and revision of one repository, with its write rules.
public struct FlatState: Sendable {
    public private(set) var table: FlatTable

    /// An empty state at revision 0.
    public init() { table = FlatTable() }

    /// A state over `table` (as storage loaded it).
    public init(_ table: FlatTable) { self.table = table }

    /// The repository revision: 0 until the first change, then raised by 1 per change.
    public var revision: UInt64 { table.revision }
    /// The number of keys.
    public var count: Int { table.count }

    /// The entry for `key`, if the key exists.
    public subscript(key: Key) -> Entry<CanonicalJSON>? { table[key] }

    /// Calls `body` with every entry, read in place, in no particular order.
    public func forEach(_ body: (FlatRecord) -> Void) { table.forEach(body) }

    /// The changes `ops` would make, in order, without making them: no key twice, every
    /// `ifRevision` met (else `WriteError`, in the order `KeyedState.validate` reports them),
    /// and operations that change nothing left out. Empty when nothing would change.
    public func plan(_ ops: [WriteOp<CanonicalJSON>]) throws(WriteError) -> [Change<CanonicalJSON>] {
        if ops.count > 1 {
            var seen = Set<Key>(minimumCapacity: ops.count)
            for op in ops where !seen.insert(op.key).inserted { throw .duplicateKey(op.key) }
        }
        var changes: [Change<CanonicalJSON>] = []
        changes.reserveCapacity(ops.count)
        for op in ops {
            switch op {
            case .set(let key, let value, let ifRevision, let force):
                let outcome = table.withRecord(key) { record -> Outcome in
                    if let ifRevision, ifRevision != (record?.revision ?? 0) { return .conflict(record?.revision ?? 0) }
                    guard let record else { return .change(old: nil) }
                    return !force && record.valueEquals(value) ? .unchanged : .change(old: record.value)
                }
                switch outcome {
                case .conflict(let actual): throw .conflict(key: key, expected: ifRevision ?? 0, actual: actual)
                case .unchanged: break
                case .change(let old): changes.append(Change(key: key, old: old, new: value))
                }
            case .delete(let key, let ifRevision):
                let outcome = table.withRecord(key) { record -> Outcome in
                    if let ifRevision, ifRevision != (record?.revision ?? 0) { return .conflict(record?.revision ?? 0) }
                    return record.map { .change(old: $0.value) } ?? .unchanged
                }
                switch outcome {
                case .conflict(let actual): throw .conflict(key: key, expected: ifRevision ?? 0, actual: actual)
                case .unchanged: break
                case .change(let old): changes.append(Change(key: key, old: old, new: nil))
                }
            }
        }
        return changes
    }

    /// What `changes` (planned on this state, a key at most once) replace: each key's entry
    /// before them — the value the change already carries, the revision looked up — so an
    /// undo record costs no second copy of a value.
    public func entries(replacedBy changes: [Change<CanonicalJSON>]) -> [(key: Key, entry: Entry<CanonicalJSON>?)] {
        changes.map { change in
            (change.key, change.old.map { Entry(value: $0, revision: table.withRecord(change.key) { $0?.revision ?? 0 }) })
        }
    }

    private enum Outcome {
        case conflict(UInt64)
        case unchanged
        case change(old: CanonicalJSON?)
    }

    /// Installs a change set whose revision follows the current one. Returns `false`,
    /// changing nothing, when its revision is not above the current revision.
    @discardableResult
    public mutating func install(_ changeSet: ChangeSet<CanonicalJSON>) -> Bool {
        table.install(changeSet)
    }

    /// Calls `body` with the record of the key whose bytes are `key`, read in place (nil:
    /// absent), and where it lies (for `install(key:…:at:)`).
    @inlinable
    public func withRecord<R>(key: UnsafeRawBufferPointer, _ body: (FlatRecord?, FlatTable.Position) -> R) -> R {
        table.withRecord(key: key, body)
    }

    /// Installs one change given as bytes as the next revision (its write rules were checked),
    /// where a lookup of its key found it, the state unchanged since.
    public mutating func install(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer?, isPlain: Bool, revision: UInt64, at position: FlatTable.Position) {
        if let value { table.set(key: key, value: value, isPlain: isPlain, revision: revision, at: position) } else { table.remove(key: key, at: position) }
        table.revision = revision
    }

    /// Sets (or, `value` nil, removes) the key whose bytes are `key` as it was at `revision`,
    /// undoing a change (`UndoLog`).
    mutating func restore(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer?, isPlain: Bool, revision: UInt64) {
        if let value { table.set(key: key, value: value, isPlain: isPlain, revision: revision) } else { table.remove(key: key) }
    }

    /// Takes the revision down by one, its changes undone (`UndoLog`).
    mutating func dropRevision() {
        if table.revision > 0 { table.revision -= 1 }
    }

    /// Undoes the newest revision: each key back to its entry before it (`nil`: absent),
    /// newest first, and the revision down by one.
    public mutating func undoLast(restoring previous: [(key: Key, entry: Entry<CanonicalJSON>?)]) {
        guard table.revision > 0 else { return }
        for (key, entry) in previous.reversed() { table.restore(key, entry) }
        table.revision -= 1
    }
}
