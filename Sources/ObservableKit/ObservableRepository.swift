// ObservableKit — an in-process observable keyed repository.
//
// Composes `KeyedState` (write rules), `KeyedObserverIndex` (who watches what) and
// `SerialDeliveryQueue` (ordered delivery outside the lock). Usable by any app without
// the daemon: the same semantics obsd serves over its socket, in one process.

import Synchronization

/// An object notified of a repository's changes. Held weakly.
public protocol RepositoryObserver<Value>: AnyObject, Sendable {
    associatedtype Value: Equatable & Sendable
    /// Called once per revision that changes a key this observer selects, with only
    /// those changes, in revision order.
    func repositoryDidChange(_ changes: ChangeSet<Value>)
}

/// A thread-safe keyed repository (key → value) with revisions, whose observers are
/// told each revision's old and new values.
///
/// Notifications arrive in revision order, one per revision per observer, holding only
/// the keys that observer selects. They run on the thread of one of the writers, with no
/// lock held, possibly after the write that caused them has returned (when another
/// thread is delivering). An observer may read, write, add or remove observers from
/// inside its callback; writes made there are delivered after the callback returns.
public final class ObservableRepository<Value: Equatable & Sendable>: Sendable {
    /// The repository's name (informational).
    public let name: String

    private let state = Locked(KeyedState<Value>())
    private let registry = Registry()
    private let delivery: SerialDeliveryQueue<ChangeSet<Value>>
    private var index: KeyedObserverIndex<Observation> { registry.index }

    /// One registration: what to call, from which revision on, and whether only once.
    private struct Observation: Sendable {
        enum Target: Sendable {
            case handler(@Sendable (ChangeSet<Value>) -> Void)
            case object(WeakObserver)
        }
        let target: Target
        /// Revisions at or below this were already visible when the observer registered.
        let after: UInt64
        /// Set for `once` observers: the first delivery wins it.
        let once: OnceFlag?
    }

    public init(name: String = "") {
        self.name = name
        let registry = self.registry
        self.delivery = SerialDeliveryQueue { changeSet in
            registry.deliver(changeSet)
        }
    }

    // MARK: Reading

    /// The current revision: 0 until the first change.
    public var revision: UInt64 { state.withLock { $0.revision } }

    /// The current value of `key`, or `nil` if it does not exist.
    public subscript(key: Key) -> Value? { state.withLock { $0[key]?.value } }

    /// The current entry (value and revision) of `key`.
    public func entry(for key: Key) -> Entry<Value>? { state.withLock { $0[key] } }

    /// The number of keys.
    public var count: Int { state.withLock { $0.count } }

    /// The keys, optionally those starting with `prefix`, in byte order.
    public func keys(prefix: String? = nil) -> [Key] { state.withLock { $0.keys(prefix: prefix) } }

    /// The values `selection` includes, and the revision they are current at.
    public func snapshot(_ selection: Selection = .all) -> (revision: UInt64, values: [Key: Value]) {
        state.withLock { Self.snapshot(of: $0, selection) }
    }

    // MARK: Writing

    /// Sets `key` to `value`. An equal value is not a change unless `force` is set.
    ///
    /// - Parameters:
    ///   - value: the new value.
    ///   - key: the key.
    ///   - ifRevision: write only if the key's revision equals this (0: absent).
    ///   - force: count an equal value as a change (revision raised, observers notified).
    /// - Returns: the repository revision after the call, whether it changed, and the previous entry.
    @discardableResult
    public func set(
        _ value: Value, for key: Key, ifRevision: UInt64? = nil, force: Bool = false
    ) throws(WriteError) -> WriteResult<Value> {
        try write(.set(key, value, ifRevision: ifRevision, force: force))
    }

    /// Deletes `key`. Deleting an absent key is not an error and changes nothing.
    @discardableResult
    public func delete(_ key: Key, ifRevision: UInt64? = nil) throws(WriteError) -> WriteResult<Value> {
        try write(.delete(key, ifRevision: ifRevision))
    }

    /// Applies `ops` atomically as one revision (or none, if nothing changes).
    @discardableResult
    public func apply(_ ops: [WriteOp<Value>]) throws(WriteError) -> ChangeSet<Value>? {
        let changeSet = try state.withLock { (s) throws(WriteError) -> ChangeSet<Value>? in
            let changeSet = try s.apply(ops)
            if let changeSet { delivery.enqueue(changeSet) }
            return changeSet
        }
        delivery.drain()
        return changeSet
    }

    private func write(_ op: WriteOp<Value>) throws(WriteError) -> WriteResult<Value> {
        let result = try state.withLock { (s) throws(WriteError) -> WriteResult<Value> in
            let previous = s[op.key]
            let changeSet = try s.apply([op])
            if let changeSet { delivery.enqueue(changeSet) }
            return WriteResult(revision: s.revision, changed: changeSet != nil, previous: previous)
        }
        delivery.drain()
        return result
    }

    // MARK: Observing

    /// Calls `handler` with each later revision's changes to the keys `selection` includes.
    ///
    /// - Parameters:
    ///   - selection: the keys observed.
    ///   - once: stop after the first notification (`withObservationTracking` style).
    ///   - handler: called with each revision's changes to the selected keys, in order.
    /// - Returns: a token; the observation ends when it is cancelled or deallocated.
    public func observe(
        _ selection: Selection = .all, once: Bool = false,
        _ handler: @escaping @Sendable (ChangeSet<Value>) -> Void
    ) -> ObservationToken {
        observeWithSnapshot(selection, once: once, handler).token
    }

    /// Like `observe`, and atomically returns the values current when observation began:
    /// notifications that follow have revisions above `snapshot.revision` — no gap, no overlap.
    public func observeWithSnapshot(
        _ selection: Selection = .all, once: Bool = false,
        _ handler: @escaping @Sendable (ChangeSet<Value>) -> Void
    ) -> (token: ObservationToken, snapshot: (revision: UInt64, values: [Key: Value])) {
        let id = ObserverID.next()
        let snapshot = state.withLock { s in
            index.insert(
                Observation(target: .handler(handler), after: s.revision, once: once ? OnceFlag() : nil),
                for: selection, id: id)
            return Self.snapshot(of: s, selection)
        }
        let token = ObservationToken { [index] in index.remove(id) }
        return (token, snapshot)
    }

    /// The changes to the keys `selection` includes, as an async sequence. Ends when the
    /// consuming task is cancelled or the sequence is dropped.
    public func changes(_ selection: Selection = .all) -> AsyncStream<ChangeSet<Value>> {
        let (stream, continuation) = AsyncStream.makeStream(of: ChangeSet<Value>.self)
        let token = observe(selection) { continuation.yield($0) }
        continuation.onTermination = { _ in token.cancel() }
        return stream
    }

    /// Adds a weakly held observer object for `selection`.
    public func addObserver(_ observer: some RepositoryObserver<Value>, for selection: Selection = .all) {
        addObservers([observer], for: selection)
    }

    /// Adds several weakly held observer objects, each for `selection`.
    public func addObservers(_ observers: [any RepositoryObserver<Value>], for selection: Selection = .all) {
        for observer in observers {
            let id = ObserverID.next()
            // Recorded and registered in one step under the identities' lock, so a concurrent
            // `removeObservers` sees both or neither (never an index entry it cannot find).
            registry.objectIDs.withLock { map in
                map[ObjectIdentifier(observer), default: []].append(id)
                state.withLock { s in
                    index.insert(
                        Observation(target: .object(WeakObserver(observer)), after: s.revision, once: nil),
                        for: selection, id: id)
                }
            }
        }
    }

    /// Removes every registration of an observer object.
    public func removeObserver(_ observer: AnyObject) {
        removeObservers([observer])
    }

    /// Removes every registration of several observer objects.
    public func removeObservers(_ observers: [AnyObject]) {
        registry.objectIDs.withLock { map in
            index.remove(contentsOf: observers.flatMap { map.removeValue(forKey: ObjectIdentifier($0)) ?? [] })
        }
    }

    /// The number of registered observations.
    public var observerCount: Int { index.count }

    // MARK: Internals

    private static func snapshot(of s: KeyedState<Value>, _ selection: Selection) -> (revision: UInt64, values: [Key: Value]) {
        var values: [Key: Value] = [:]
        switch selection {
        case .keys(let keys):
            for key in keys { if let e = s[key] { values[key] = e.value } }
        case .all, .prefix:
            for (key, e) in s.entries where selection.matches(key) { values[key] = e.value }
        }
        return (s.revision, values)
    }

    /// The observer index and the identities of observer objects: everything delivery needs.
    private final class Registry: Sendable {
        let index = KeyedObserverIndex<Observation>()
        let objectIDs = Locked<[ObjectIdentifier: [ObserverID]]>([:])

        func deliver(_ changeSet: ChangeSet<Value>) {
            for match in index.route(changeSet.changes.map(\.key)) where changeSet.revision > match.observer.after {
                if let once = match.observer.once {
                    guard once.fire() else { continue }
                    index.remove(match.id)
                }
                let selected: ChangeSet<Value>
                switch match.selected {
                case .all: selected = changeSet
                case .some: selected = ChangeSet(revision: changeSet.revision, changes: match.selected.apply(to: changeSet.changes))
                }
                switch match.observer.target {
                case .handler(let handler):
                    handler(selected)
                case .object(let weak):
                    if let observer = weak.object as? any RepositoryObserver<Value> {
                        observer.repositoryDidChange(selected)
                    } else {
                        forget(match.id, of: weak.identity)
                    }
                }
            }
        }

        /// Drops the registration of an observer object that was deallocated.
        private func forget(_ id: ObserverID, of identity: ObjectIdentifier) {
            index.remove(id)
            objectIDs.withLock { map in
                map[identity]?.removeAll { $0 == id }
                if map[identity]?.isEmpty == true { map[identity] = nil }
            }
        }
    }
}

/// The outcome of a single-key write.
public struct WriteResult<Value: Sendable>: Sendable {
    /// The repository revision after the write.
    public let revision: UInt64
    /// Whether the write changed anything.
    public let changed: Bool
    /// The key's entry before the write, if it existed.
    public let previous: Entry<Value>?

    public init(revision: UInt64, changed: Bool, previous: Entry<Value>?) {
        self.revision = revision
        self.changed = changed
        self.previous = previous
    }
}

/// A flag that can be won exactly once, from any thread.
public final class OnceFlag: Sendable {
    private let fired = Atomic<Bool>(false)
    public init() {}
    /// `true` for the first caller only.
    public func fire() -> Bool {
        !fired.exchange(true, ordering: .acquiringAndReleasing)
    }
    /// Whether `fire()` has been won.
    public var hasFired: Bool { fired.load(ordering: .acquiring) }
}
