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

/// All changes of one revision, in the order they were applied — or, coalesced, of
/// several revisions.
///
/// Observers receive exactly one `ChangeSet` per revision that touches a key they
/// select, holding only the changes they select. A consumer that asked for coalescing
/// (`ObservableRepository.coalescedChanges`, obsd's `coalesce` subscriptions) may instead
/// receive one change set covering revisions `from` through `revision`: one change per key
/// whose value now differs from the one it last received (`old` that value, `new` the
/// value at `revision`), in byte order of the keys.
public struct ChangeSet<Value: Sendable>: Sendable {
    /// The repository revision these changes produced (for a coalesced change set: the
    /// revision the new values are at).
    public let revision: UInt64
    /// The changes, in application order (coalesced: in byte order of the keys). Never empty.
    public let changes: [Change<Value>]
    /// For a coalesced change set, the first revision it covers; `nil` for the changes of
    /// exactly one revision.
    public let from: UInt64?

    @inlinable
    public init(revision: UInt64, changes: [Change<Value>], from: UInt64? = nil) {
        self.revision = revision
        self.changes = changes
        self.from = from
    }

    /// Whether this change set coalesces several revisions (`from` is set).
    public var isCoalesced: Bool { from != nil }

    /// The change of `key` in this revision, if any.
    public func change(for key: Key) -> Change<Value>? {
        changes.first { $0.key == key }
    }

    /// This change set restricted to the changes `selection` includes, or `nil` when none.
    public func filtered(by selection: Selection) -> ChangeSet<Value>? {
        if case .all = selection { return self }
        let kept = changes.filter { selection.matches($0.key) }
        return kept.isEmpty ? nil : ChangeSet(revision: revision, changes: kept, from: from)
    }
}

extension ChangeSet: Equatable where Value: Equatable {}
