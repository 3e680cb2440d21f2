// ObservableKit — thread-safe observer sets.
//
// `ObserverSet` holds any `Sendable` observers (closures, subscriptions, weak references).
// Readers take a snapshot under a short lock and call observers with no lock held, so an
// observer may add or remove observers — itself included — from inside its callback
// without deadlock, and a fan-out in progress is never corrupted by a concurrent change.

import Synchronization

/// Identifies one registration in an observer set or index. Unique within the process.
public struct ObserverID: Hashable, Sendable, Comparable, CustomStringConvertible {
    public let rawValue: UInt64

    /// A fresh identifier, never returned before in this process.
    public static func next() -> ObserverID {
        ObserverID(rawValue: observerIDCounter.add(1, ordering: .relaxed).newValue)
    }

    public static func < (lhs: ObserverID, rhs: ObserverID) -> Bool { lhs.rawValue < rhs.rawValue }
    public var description: String { "#\(rawValue)" }
}

private let observerIDCounter = Atomic<UInt64>(0)

/// A list of registrations with O(1) removal by identifier once it grows large.
///
/// Order is not preserved across removals. Not thread-safe: owners keep it under a lock.
@usableFromInline
struct SlotList<Element> {
    @usableFromInline
    struct Slot {
        @usableFromInline let id: ObserverID
        @usableFromInline let element: Element
    }

    /// Below this size removal scans; above it a position map is kept.
    static var indexThreshold: Int { 32 }

    @usableFromInline private(set) var slots: [Slot] = []
    private var positions: [ObserverID: Int]? = nil

    var isEmpty: Bool { slots.isEmpty }
    var count: Int { slots.count }

    mutating func append(_ element: Element, id: ObserverID) {
        slots.append(Slot(id: id, element: element))
        if positions != nil {
            positions![id] = slots.count - 1
        } else if slots.count > Self.indexThreshold {
            var map = [ObserverID: Int](minimumCapacity: slots.count * 2)
            for (i, slot) in slots.enumerated() { map[slot.id] = i }
            positions = map
        }
    }

    @discardableResult
    mutating func remove(_ id: ObserverID) -> Element? {
        let index: Int
        if positions != nil {
            guard let i = positions!.removeValue(forKey: id) else { return nil }
            index = i
        } else {
            guard let i = slots.firstIndex(where: { $0.id == id }) else { return nil }
            index = i
        }
        let removed = slots[index].element
        let last = slots.count - 1
        if index != last {
            slots[index] = slots[last]
            positions?[slots[index].id] = index
        }
        slots.removeLast()
        if let p = positions, p.count <= Self.indexThreshold / 2 { positions = nil }
        return removed
    }
}

extension SlotList: Sendable where Element: Sendable {}
extension SlotList.Slot: Sendable where Element: Sendable {}

/// A thread-safe set of observers of any `Sendable` type.
///
/// Iteration works on a snapshot taken under a short lock; callbacks run with no lock
/// held. An observer added during a notification is first called by the next one; an
/// observer removed during a notification may still receive that notification.
public final class ObserverSet<Element: Sendable>: Sendable {
    private let storage = Locked(SlotList<Element>())

    public init() {}

    /// Adds an observer and returns the identifier that removes it.
    @discardableResult
    public func insert(_ observer: Element) -> ObserverID {
        let id = ObserverID.next()
        storage.withLock { $0.append(observer, id: id) }
        return id
    }

    /// Adds several observers in one step; returns their identifiers in order.
    @discardableResult
    public func insert(contentsOf observers: some Sequence<Element>) -> [ObserverID] {
        let pairs = observers.map { (ObserverID.next(), $0) }
        storage.withLock { list in
            for (id, element) in pairs { list.append(element, id: id) }
        }
        return pairs.map(\.0)
    }

    /// Removes one observer; returns it if it was present.
    @discardableResult
    public func remove(_ id: ObserverID) -> Element? {
        storage.withLock { $0.remove(id) }
    }

    /// Removes several observers in one step.
    public func remove(contentsOf ids: some Sequence<ObserverID>) {
        storage.withLock { list in
            for id in ids { list.remove(id) }
        }
    }

    /// Removes every observer.
    public func removeAll() {
        storage.withLock { $0 = SlotList() }
    }

    /// The number of observers.
    public var count: Int { storage.withLock { $0.count } }

    /// The observers at this moment, with their identifiers.
    public func snapshot() -> [(id: ObserverID, observer: Element)] {
        storage.withLock { list in list.slots.map { ($0.id, $0.element) } }
    }

    /// Calls `body` for each observer of a snapshot, with no lock held.
    public func forEach(_ body: (ObserverID, Element) throws -> Void) rethrows {
        let slots = storage.withLock { $0.slots }
        for slot in slots { try body(slot.id, slot.element) }
    }
}
