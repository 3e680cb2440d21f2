// ObservableKit — the write semantics of a keyed repository, as a pure value.
//
// `KeyedState` owns the rules every obsd repository follows: an equal value is not a
// change (SwiftUI `onChange`), `force` makes it one anyway (`didSet`), `ifRevision` is
// compare-and-set, a batch is atomic and shares one revision, and a write that changes
// nothing raises no revision. It is not thread-safe: callers keep it under their lock.

/// A key's current value and the revision that last changed it.
public struct Entry<Value: Sendable>: Sendable {
    public var value: Value
    /// The repository revision that last changed this key.
    public var revision: UInt64

    @inlinable
    public init(value: Value, revision: UInt64) {
        self.value = value
        self.revision = revision
    }
}

extension Entry: Equatable where Value: Equatable {}

/// One write of a batch.
public enum WriteOp<Value: Sendable>: Sendable {
    /// Sets `key` to `value`. With `ifRevision`, only if the key's revision equals it
    /// (`0`: the key must not exist). With `force`, an equal value still counts as a change.
    case set(Key, Value, ifRevision: UInt64? = nil, force: Bool = false)
    /// Deletes `key`. With `ifRevision`, only if the key's revision equals it.
    case delete(Key, ifRevision: UInt64? = nil)

    /// The key this operation writes.
    @inlinable
    public var key: Key {
        switch self {
        case .set(let key, _, _, _), .delete(let key, _): return key
        }
    }

    /// The revision it is conditional on, if any.
    @inlinable
    public var ifRevision: UInt64? {
        switch self {
        case .set(_, _, let r, _), .delete(_, let r): return r
        }
    }
}

extension WriteOp: Equatable where Value: Equatable {}

/// Why a write was refused. Nothing was applied.
public enum WriteError: Error, Sendable, Equatable {
    /// A compare-and-set condition failed: `key` is at `actual`, not `expected`.
    case conflict(key: Key, expected: UInt64, actual: UInt64)
    /// A batch wrote the same key twice.
    case duplicateKey(Key)
}

extension WriteError: CustomStringConvertible {
    public var description: String {
        switch self {
        case .conflict(let key, let expected, let actual):
            if expected == 0 {
                return "key \(key.debugDescription) exists (revision \(actual)); ifRev 0 requires it to be absent"
            }
            if actual == 0 {
                return "key \(key.debugDescription) does not exist; ifRev \(expected) requires revision \(expected)"
            }
            return "key \(key.debugDescription) is at revision \(actual), not \(expected)"
        case .duplicateKey(let key):
            return "the batch writes key \(key.debugDescription) more than once"
        }
    }
}

/// The keys, values and revision of one repository, with its write rules.
///
/// `apply` and `install` are `@inlinable` so that a client module specializes them for its
/// value type: they run on every write.
public struct KeyedState<Value: Equatable & Sendable>: Sendable {
    @usableFromInline var _revision: UInt64
    @usableFromInline var _entries: [Key: Entry<Value>]

    /// The repository revision: 0 until the first change, then raised by 1 per change.
    @inlinable public var revision: UInt64 { _revision }
    /// The current entries.
    @inlinable public var entries: [Key: Entry<Value>] { _entries }

    /// An empty state at revision 0.
    public init() {
        self._revision = 0
        self._entries = [:]
    }

    /// A state restored from storage.
    public init(revision: UInt64, entries: [Key: Entry<Value>]) {
        self._revision = revision
        self._entries = entries
    }

    /// The entry for `key`, if the key exists.
    @inlinable
    public subscript(key: Key) -> Entry<Value>? { _entries[key] }

    /// The number of keys.
    public var count: Int { entries.count }

    /// The keys, optionally only those starting with `prefix`, in byte order.
    public func keys(prefix: String? = nil) -> [Key] {
        var keys: [Key]
        if let prefix, !prefix.isEmpty {
            keys = entries.keys.filter { $0.hasBytePrefix(prefix) }
        } else {
            keys = Array(entries.keys)
        }
        keys.sort()
        return keys
    }

    /// Checks `ops` against the write rules without applying them: no key twice, every
    /// `ifRevision` condition met.
    @inlinable
    public func validate(_ ops: [WriteOp<Value>]) throws(WriteError) {
        if ops.count > 1 {
            var seen = Set<Key>(minimumCapacity: ops.count)
            for op in ops where !seen.insert(op.key).inserted {
                throw .duplicateKey(op.key)
            }
        }
        for op in ops {
            if let expected = op.ifRevision {
                let actual = _entries[op.key]?.revision ?? 0
                if actual != expected { throw .conflict(key: op.key, expected: expected, actual: actual) }
            }
        }
    }

    /// Applies `ops` atomically.
    ///
    /// - Returns: the changes with their new revision, or `nil` when nothing changed
    ///   (equal values, absent keys deleted, or no operations); the revision is then not raised.
    /// - Throws: `WriteError` and applies nothing when a key repeats or a condition fails.
    @inlinable
    public mutating func apply(_ ops: [WriteOp<Value>]) throws(WriteError) -> ChangeSet<Value>? {
        let changes = try plan(ops)
        guard !changes.isEmpty else { return nil }
        let changeSet = ChangeSet(revision: _revision + 1, changes: changes)
        install(changeSet)
        return changeSet
    }

    /// The changes `ops` would make, in order, without making them: checks the write rules
    /// (`validate`) and leaves out operations that change nothing. Empty when nothing would
    /// change. A caller that must check more (limits) before the state moves plans, checks,
    /// then installs `ChangeSet(revision: revision + 1, changes:)`.
    @inlinable
    public func plan(_ ops: [WriteOp<Value>]) throws(WriteError) -> [Change<Value>] {
        try validate(ops)
        var changes: [Change<Value>] = []
        changes.reserveCapacity(ops.count)
        for op in ops {
            switch op {
            case .set(let key, let value, _, let force):
                let old = _entries[key]?.value
                if force || old != value {
                    changes.append(Change(key: key, old: old, new: value))
                }
            case .delete(let key, _):
                if let old = _entries[key]?.value {
                    changes.append(Change(key: key, old: old, new: nil))
                }
            }
        }
        return changes
    }

    /// Installs a change set whose revision follows the current one — for example one
    /// read back from storage, whose write rules were checked when it was first applied.
    ///
    /// - Returns: `false`, changing nothing, when `changeSet.revision` is not above the current revision.
    @inlinable @discardableResult
    public mutating func install(_ changeSet: ChangeSet<Value>) -> Bool {
        guard changeSet.revision > _revision else { return false }
        _revision = changeSet.revision
        for change in changeSet.changes {
            if let new = change.new {
                _entries[change.key] = Entry(value: new, revision: _revision)
            } else {
                _entries.removeValue(forKey: change.key)
            }
        }
        return true
    }

    /// Undoes the newest revision: each key back to its entry before it (`nil`: absent),
    /// newest first, and the revision down by one.
    public mutating func undoLast(restoring previous: [(key: Key, entry: Entry<Value>?)]) {
        guard _revision > 0 else { return }
        for (key, entry) in previous.reversed() { _entries[key] = entry }
        _revision -= 1
    }

    /// Undoes the last applied change set, restoring each changed key's previous entry
    /// (`previous[i]` for `changeSet.changes[i]`; `nil` where the key did not exist).
    ///
    /// - Returns: `false`, changing nothing, unless `changeSet` is the current revision.
    @discardableResult
    public mutating func revert(_ changeSet: ChangeSet<Value>, previous: [Entry<Value>?]) -> Bool {
        guard changeSet.revision == _revision, previous.count == changeSet.changes.count else { return false }
        for (change, entry) in zip(changeSet.changes, previous).reversed() {
            _entries[change.key] = entry
        }
        _revision -= 1
        return true
    }
}
