// ObservableKit — what observers select and what they are told.
//
// `Selection` says which keys an observer watches; `Change` is one key's old and new
// value; `ChangeSet` is everything one revision changed — the unit of notification.

/// Which keys of a repository an observer watches.
public enum Selection: Sendable, Hashable {
    /// Every key.
    case all
    /// Exactly these keys.
    case keys(Set<Key>)
    /// Every key whose UTF-8 bytes start with the prefix's bytes.
    case prefix(String)

    /// A selection of a single key.
    public static func key(_ key: Key) -> Selection { .keys([key]) }

    /// Whether the selection includes `key`.
    @inlinable
    public func matches(_ key: Key) -> Bool {
        switch self {
        case .all: return true
        case .keys(let keys): return keys.contains(key)
        case .prefix(let prefix): return key.hasBytePrefix(prefix)
        }
    }
}

/// One key's change within a revision: the value before and after.
///
/// `old` is `nil` when the key did not exist before (a creation); `new` is `nil` when
/// it does not exist after (a deletion). A forced write of an equal value has
/// `old == new`.
public struct Change<Value: Sendable>: Sendable {
    public let key: Key
    public let old: Value?
    public let new: Value?

    @inlinable
    public init(key: Key, old: Value?, new: Value?) {
        self.key = key
        self.old = old
        self.new = new
    }
}

extension Change: Equatable where Value: Equatable {}

/// All changes of one revision, in the order they were applied.
///
/// Observers receive exactly one `ChangeSet` per revision that touches a key they
/// select, holding only the changes they select.
public struct ChangeSet<Value: Sendable>: Sendable {
    /// The repository revision these changes produced.
    public let revision: UInt64
    /// The changes, in application order. Never empty.
    public let changes: [Change<Value>]

    @inlinable
    public init(revision: UInt64, changes: [Change<Value>]) {
        self.revision = revision
        self.changes = changes
    }

    /// The change of `key` in this revision, if any.
    public func change(for key: Key) -> Change<Value>? {
        changes.first { $0.key == key }
    }

    /// This change set restricted to the changes `selection` includes, or `nil` when none.
    public func filtered(by selection: Selection) -> ChangeSet<Value>? {
        if case .all = selection { return self }
        let kept = changes.filter { selection.matches($0.key) }
        return kept.isEmpty ? nil : ChangeSet(revision: revision, changes: kept)
    }
}

extension ChangeSet: Equatable where Value: Equatable {}
