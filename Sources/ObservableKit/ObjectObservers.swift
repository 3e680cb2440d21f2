// ObservableKit — observers as objects, held weakly, of any number of protocols.
//
// What the Flowduino/Observable package offers, made thread-safe and `Sendable`:
// register any class instance (one or many in one call), for all keys or for some;
// notify "every observer that conforms to protocol P" — so one observable can serve
// several observer protocols; an observer that is deallocated simply stops receiving
// and is pruned. `ObservationToken` ends a closure observation, explicitly or on deinit.
//
// Registrations are kept and pruned by `ObserverID`, which is never reused. An object's
// identity (`ObjectIdentifier`, its address) only finds the registrations of an object
// that is passed in, and is checked against the object itself: once an observer is freed,
// a new object may get its address before the dead registration is pruned.


/// A weak reference to an observer object.
public struct WeakObserver: Sendable {
    public private(set) weak var object: (any AnyObject & Sendable)?
    public let identity: ObjectIdentifier

    public init(_ object: any AnyObject & Sendable) {
        self.object = object
        self.identity = ObjectIdentifier(object)
    }
}

/// Observer objects of any protocol, held weakly.
///
/// ```swift
/// protocol ThemeObserver: AnyObject, Sendable { func themeChanged(to: String) }
/// let observers = ObjectObservers()
/// observers.add(view)                      // or add([a, b, c])
/// observers.notify { (o: ThemeObserver) in o.themeChanged(to: "dark") }
/// ```
public final class ObjectObservers: Sendable {
    private struct Registration {
        let id: ObserverID
        let observer: WeakObserver
    }

    private let set = ObserverSet<WeakObserver>()
    /// The registration at each identity: of a live object, or of a dead one not pruned yet.
    private let ids = Locked<[ObjectIdentifier: Registration]>([:])

    public init() {}

    /// Adds an observer. Adding the same object twice has no effect.
    public func add(_ observer: any AnyObject & Sendable) {
        add([observer])
    }

    /// Adds several observers in one call.
    public func add(_ observers: [any AnyObject & Sendable]) {
        ids.withLock { ids in
            for observer in observers {
                let identity = ObjectIdentifier(observer)
                if let existing = ids[identity] {
                    if existing.observer.object === observer { continue }
                    set.remove(existing.id)  // a freed observer's, whose address `observer` now has
                }
                let weak = WeakObserver(observer)
                ids[identity] = Registration(id: set.insert(weak), observer: weak)
            }
        }
    }

    /// Removes an observer.
    public func remove(_ observer: AnyObject) {
        remove([observer])
    }

    /// Removes several observers in one call.
    public func remove(_ observers: [AnyObject]) {
        let removed = ids.withLock { ids in observers.compactMap { ids.removeValue(forKey: ObjectIdentifier($0))?.id } }
        set.remove(contentsOf: removed)
    }

    /// The number of live observers.
    public var count: Int {
        var n = 0
        set.forEach { _, weak in if weak.object != nil { n += 1 } }
        return n
    }

    /// Calls `body` for every live observer that conforms to `P`, with no lock held.
    /// Deallocated observers are pruned.
    public func notify<P>(_ type: P.Type = P.self, _ body: (P) throws -> Void) rethrows {
        var dead: [(identity: ObjectIdentifier, id: ObserverID)] = []
        try set.forEach { id, weak in
            guard let object = weak.object else { return dead.append((weak.identity, id)) }
            if let observer = object as? P { try body(observer) }
        }
        if !dead.isEmpty { prune(dead) }
    }

    /// Drops the registrations of freed observers — not whatever now has their addresses.
    private func prune(_ dead: [(identity: ObjectIdentifier, id: ObserverID)]) {
        ids.withLock { ids in
            for (identity, id) in dead where ids[identity]?.id == id { ids[identity] = nil }
        }
        set.remove(contentsOf: dead.map(\.id))
    }
}

/// Observer objects of any protocol, held weakly, each watching some keys.
///
/// ```swift
/// observers.add(view, for: .keys(["theme", "lang"]))
/// observers.notify(key: "theme") { (o: ThemeObserver) in o.themeChanged(to: "dark") }
/// ```
public final class KeyedObjectObservers: Sendable {
    private let index = KeyedObserverIndex<WeakObserver>()
    private let ids = Locked<[ObjectIdentifier: [ObserverID]]>([:])

    public init() {}

    /// Adds an observer for the keys `selection` includes.
    public func add(_ observer: any AnyObject & Sendable, for selection: Selection) {
        add([observer], for: selection)
    }

    /// Adds several observers, each for the keys `selection` includes.
    public func add(_ observers: [any AnyObject & Sendable], for selection: Selection) {
        ids.withLock { ids in
            for observer in observers {
                let id = index.insert(WeakObserver(observer), for: selection)
                ids[ObjectIdentifier(observer), default: []].append(id)
            }
        }
    }

    /// Removes every registration of an observer.
    public func remove(_ observer: AnyObject) {
        remove([observer])
    }

    /// Removes every registration of several observers.
    public func remove(_ observers: [AnyObject]) {
        let removed = ids.withLock { ids in observers.flatMap { ids.removeValue(forKey: ObjectIdentifier($0)) ?? [] } }
        index.remove(contentsOf: removed)
    }

    /// Calls `body` for every live observer of `key` that conforms to `P`, with no lock held.
    public func notify<P>(key: Key, as type: P.Type = P.self, _ body: (P) throws -> Void) rethrows {
        var dead: [(identity: ObjectIdentifier, id: ObserverID)] = []
        for routed in index.observers(of: key) {
            guard let object = routed.observer.object else {
                dead.append((routed.observer.identity, routed.id))
                continue
            }
            if let observer = object as? P { try body(observer) }
        }
        if !dead.isEmpty {
            // The freed observers' registrations only: a new object may have one of their addresses.
            ids.withLock { ids in
                for (identity, id) in dead {
                    ids[identity]?.removeAll { $0 == id }
                    if ids[identity]?.isEmpty == true { ids[identity] = nil }
                }
            }
            index.remove(contentsOf: dead.map(\.id))
        }
    }
}

/// Ends an observation when cancelled or deallocated — keep it as long as you observe.
public final class ObservationToken: Sendable, Hashable {
    private let onCancel: Locked<(@Sendable () -> Void)?>

    /// A token that runs `onCancel` once, on the first `cancel()` or on deinit.
    public init(onCancel: @escaping @Sendable () -> Void) {
        self.onCancel = Locked(onCancel)
    }

    /// Ends the observation. Idempotent.
    public func cancel() {
        let action = onCancel.withLock { action in
            defer { action = nil }
            return action
        }
        action?()
    }

    /// Whether `cancel()` ran.
    public var isCancelled: Bool { onCancel.withLock { $0 == nil } }

    deinit { cancel() }

    public static func == (lhs: ObservationToken, rhs: ObservationToken) -> Bool { lhs === rhs }
    public func hash(into hasher: inout Hasher) { hasher.combine(ObjectIdentifier(self)) }

    /// Keeps this token in a set, Combine-style.
    public func store(in set: inout Set<ObservationToken>) { set.insert(self) }
}
