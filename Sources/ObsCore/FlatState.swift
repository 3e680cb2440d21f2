// ObsCore — a repository's keys, values and revision as the value core keeps them, and the
// daemon's write rules — the contract's, in one place: an equal value is not a change, `force`
// makes it one, `ifRevision` is compare-and-set (0: the key must not exist), a delete of an
// absent key changes nothing, a batch is atomic and shares one revision, a write that changes
// nothing raises no revision — over ObsStore's `FlatTable` (records in slabs, not a dictionary
// of per-key allocations; also what a snapshot loads into). Every write is decided here on its
// operations' bytes, a single key's as a batch's: keys looked up and values compared where
// they lie, nothing copied out. (That a batch names a key at most once is the request's rule:
// the protocol's decoders refuse it.) ObservableKit's `KeyedState` keeps the same rules for
// observation in process.

import ObsProtocol
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

    /// Whether `key` exists (its entry not copied out).
    public func contains(_ key: Key) -> Bool {
        key.withUTF8 { table.contains(key: UnsafeRawBufferPointer($0)) }
    }

    /// Calls `body` with every entry, read in place, in no particular order.
    public func forEach(_ body: (FlatRecord) -> Void) { table.forEach(body) }

    /// Decides each of `ops` on the current state without applying anything: `plans` (room for
    /// one per operation) gets, in order, whether each changes its key, and what the key holds
    /// now, read in place. Throws the first failed `ifRevision`, in operation order. `ops`
    /// name each key at most once.
    public func plan(_ ops: UnsafeBufferPointer<RawWriteOp>, into plans: UnsafeMutableBufferPointer<OpPlan>) throws(WriteRefusal) {
        for (i, op) in ops.enumerated() {
            let plan = table.withRecord(key: op.key) { record, position -> OpPlan? in
                let oldRevision = record?.revision ?? 0
                if let ifRevision = op.ifRevision, ifRevision != oldRevision { return nil }
                let old = record?.valueBytes
                let oldIsPlain = record?.isPlain ?? true
                let changes: Bool =
                    if let value = op.value {
                        // A set: of an equal value it changes nothing, unless forced.
                        record == nil || op.force || !record!.valueEquals(canonical: value, isPlain: op.isPlain)
                    } else {
                        // A delete: of an absent key it changes nothing.
                        record != nil
                    }
                return OpPlan(changes: changes, old: old, oldIsPlain: oldIsPlain, oldRevision: oldRevision, position: position)
            }
            guard let plan else {
                let actual = table.withRecord(key: op.key) { record, _ in record?.revision ?? 0 }
                throw .conflict(key: Key(String(decoding: op.key, as: UTF8.self)), expected: op.ifRevision ?? 0, actual: actual)
            }
            plans[i] = plan
        }
    }

    /// What `changes` (planned on this state, a key at most once) replace: each key's entry
    /// before them — the value the change already carries, the revision looked up — so an
    /// undo record costs no second copy of a value.
    public func entries(replacedBy changes: [Change<CanonicalJSON>]) -> [(key: Key, entry: Entry<CanonicalJSON>?)] {
        changes.map { change in
            (change.key, change.old.map { Entry(value: $0, revision: table.withRecord(change.key) { $0?.revision ?? 0 }) })
        }
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

    /// Sets the repository's revision (after a write of several keys, installed one by one).
    mutating func setRevision(_ revision: UInt64) {
        table.revision = revision
    }

    /// Sets (or, `value` nil, removes) the key whose bytes are `key`, changed at `revision` —
    /// a write of several keys, installed one by one, or a change undone (`UndoLog`).
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
