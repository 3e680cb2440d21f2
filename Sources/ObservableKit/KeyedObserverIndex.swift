// ObservableKit — the keyed observer index: who watches which keys.
//
// Observers register for exact keys, a key prefix, or every key. Routing a revision's
// keys returns each matching observer once, with the positions of the changes it
// selects. Lookups cost O(1) per exact key and O(number of distinct prefix lengths) per
// prefix, whatever the number of keys or observers. Routing snapshots the matches under a
// short lock; callbacks then run with no lock held (see `ObserverSet`).


/// Which changes of a routed revision an observer selects.
public enum SelectedChanges: Sendable, Equatable {
    /// All of them (always the case for a revision with a single change).
    case all
    /// Only the changes at these positions, in increasing order.
    case some([Int])

    /// Applies the selection to `changes`.
    @inlinable
    public func apply<T>(to changes: [T]) -> [T] {
        switch self {
        case .all: return changes
        case .some(let positions): return positions.map { changes[$0] }
        }
    }
}

/// One observer matched by routing, with the changes it selects.
public struct Routed<Element: Sendable>: Sendable {
    public let id: ObserverID
    public let observer: Element
    public let selected: SelectedChanges

    @usableFromInline
    init(id: ObserverID, observer: Element, selected: SelectedChanges) {
        self.id = id
        self.observer = observer
        self.selected = selected
    }
}

/// The routes of observers by exact key, key prefix, or all keys: a value, for one owner
/// (a lock, an event loop). `KeyedObserverIndex` is the thread-safe form.
///
/// `@inlinable` so that a client module specializes it for its observer type: it runs once
/// per revision on the delivery path, and unspecialized generic code there cost a daemon a
/// quarter of its throughput in runtime metadata lookups.
public struct KeyedRoutes<Element> {
    @usableFromInline var exact: [Key: SlotList<Element>] = [:]
    @usableFromInline var prefixes: [Key: SlotList<Element>] = [:]
    /// UTF-8 length → number of distinct registered prefixes of that length.
    @usableFromInline var prefixLengths: [Int: Int] = [:]
    @usableFromInline var all = SlotList<Element>()
    @usableFromInline var selections: [ObserverID: Selection] = [:]

    public init() {}

    /// The number of registrations.
    public var count: Int { selections.count }

    /// Registers `observer` for `selection` under `id` (from `ObserverID.next()`).
    public mutating func insert(_ observer: Element, for selection: Selection, id: ObserverID) {
        selections[id] = selection
        switch selection {
        case .all:
            all.append(observer, id: id)
        case .keys(let keys):
            for key in keys { exact[key, default: SlotList()].append(observer, id: id) }
        case .prefix(let prefix) where prefix.isEmpty:
            all.append(observer, id: id)
        case .prefix(let prefix):
            let p = Key(prefix)
            if prefixes[p] == nil { prefixLengths[p.utf8Count, default: 0] += 1 }
            prefixes[p, default: SlotList()].append(observer, id: id)
        }
    }

    /// Removes a registration; returns its observer if it was present.
    @discardableResult
    public mutating func remove(_ id: ObserverID) -> Element? {
        guard let selection = selections.removeValue(forKey: id) else { return nil }
        var removed: Element?
        switch selection {
        case .all:
            removed = all.remove(id)
        case .keys(let keys):
            for key in keys {
                guard var list = exact.removeValue(forKey: key) else { continue }
                removed = list.remove(id) ?? removed
                if !list.isEmpty { exact[key] = list }
            }
        case .prefix(let prefix) where prefix.isEmpty:
            removed = all.remove(id)
        case .prefix(let prefix):
            let p = Key(prefix)
            if var list = prefixes.removeValue(forKey: p) {
                removed = list.remove(id)
                if list.isEmpty {
                    let n = p.utf8Count
                    let left = (prefixLengths[n] ?? 1) - 1
                    prefixLengths[n] = left == 0 ? nil : left
                } else {
                    prefixes[p] = list
                }
            }
        }
        return removed
    }

    /// Calls `body` for each observer that selects any of `keys` (one revision's keys, in
    /// application order) — once per observer, with the positions it selects.
    ///
    /// Mutating only so that it reads the routes in place: it changes nothing, and `body`
    /// must not change them. (Called on a value its owner keeps in memory, non-mutating, it
    /// copies the index — its dictionaries retained and released — once per revision.)
    @inlinable
    public mutating func route(_ keys: some RandomAccessCollection<Key>, _ body: (ObserverID, borrowing Element, SelectedChanges) -> Void) {
        if keys.count == 1, let key = keys.first {
            forEachMatch(of: key) { (slot: borrowing SlotList<Element>.Slot) in body(slot.id, slot.element, .all) }
            return
        }
        var position: [ObserverID: Int] = [:]
        var matches: [(slot: SlotList<Element>.Slot, indices: [Int])] = []
        for (i, key) in keys.enumerated() {
            forEachMatch(of: key) { (slot: borrowing SlotList<Element>.Slot) in
                if let j = position[slot.id] {
                    matches[j].indices.append(i)
                } else {
                    position[slot.id] = matches.count
                    matches.append((copy slot, [i]))
                }
            }
        }
        for m in matches {
            body(m.slot.id, m.slot.element, m.indices.count == keys.count ? .all : .some(m.indices))
        }
    }

    /// Calls `body` for each registration's observer: once per selected key for exact keys,
    /// once for a prefix or every key (diagnostics; routing uses `route`).
    public func forEachRegistration(_ body: (Element) -> Void) {
        for slot in all.slots { body(slot.element) }
        for list in prefixes.values { for slot in list.slots { body(slot.element) } }
        for list in exact.values { for slot in list.slots { body(slot.element) } }
    }

    @inlinable
    mutating func forEachMatch(of key: Key, _ body: (borrowing SlotList<Element>.Slot) -> Void) {
        if let list = exact[key] { Self.visit(list, body) }
        if !prefixLengths.isEmpty {
            key.withUTF8 { bytes in
                for length in prefixLengths.keys where length <= bytes.count {
                    // A prefix is valid UTF-8: it cannot end just before a continuation byte.
                    if length < bytes.count, bytes[length] & 0xC0 == 0x80 { continue }
                    let candidate = Key(String(decoding: UnsafeBufferPointer(rebasing: bytes[..<length]), as: UTF8.self))
                    if let list = prefixes[candidate] { Self.visit(list, body) }
                }
            }
        }
        Self.visit(all, body)
    }

    /// Calls `body` with each slot, borrowed from the list's storage (no copy of its element:
    /// at fan-out, a retain and release of each observer per revision would be most of the cost).
    @inlinable
    static func visit(_ list: borrowing SlotList<Element>, _ body: (borrowing SlotList<Element>.Slot) -> Void) {
        list.slots.withUnsafeBufferPointer { slots in
            for i in slots.indices { body(slots[i]) }
        }
    }
}

extension KeyedRoutes: Sendable where Element: Sendable {}

/// A thread-safe index of observers by exact key, key prefix, or all keys.
///
/// Routing snapshots the matches under a short lock; callbacks then run with no lock held.
public final class KeyedObserverIndex<Element: Sendable>: Sendable {
    @usableFromInline let storage = Locked(KeyedRoutes<Element>())

    public init() {}

    /// The number of registrations.
    public var count: Int { storage.withLock { $0.count } }

    /// Registers `observer` for `selection`; returns the identifier that removes it.
    @discardableResult
    public func insert(_ observer: Element, for selection: Selection) -> ObserverID {
        let id = ObserverID.next()
        insert(observer, for: selection, id: id)
        return id
    }

    /// Registers `observer` for `selection` under an identifier the caller allocated
    /// with `ObserverID.next()`.
    public func insert(_ observer: Element, for selection: Selection, id: ObserverID) {
        storage.withLock { $0.insert(observer, for: selection, id: id) }
    }

    /// Removes a registration; returns its observer if it was present.
    @discardableResult
    public func remove(_ id: ObserverID) -> Element? {
        storage.withLock { $0.remove(id) }
    }

    /// Removes several registrations in one step.
    public func remove(contentsOf ids: some Sequence<ObserverID>) {
        storage.withLock { s in
            for id in ids { s.remove(id) }
        }
    }

    /// The observers whose selection includes `key`.
    @inlinable
    public func observers(of key: Key) -> [Routed<Element>] {
        route([key])
    }

    /// Routes the keys of one revision, in application order, to the observers that
    /// select any of them. Each observer appears once, with the positions it selects.
    @inlinable
    public func route(_ keys: [Key]) -> [Routed<Element>] {
        storage.withLock { s in
            var out: [Routed<Element>] = []
            s.route(keys) { id, element, selected in out.append(Routed(id: id, observer: copy element, selected: selected)) }
            return out
        }
    }
}
