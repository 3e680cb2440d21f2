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

/// A thread-safe index of observers by exact key, key prefix, or all keys.
///
/// Routing is `@inlinable` so that a client module specializes it for its observer type:
/// it runs once per revision on the delivery path, and unspecialized generic code there
/// cost a daemon a quarter of its throughput in runtime metadata lookups.
public final class KeyedObserverIndex<Element: Sendable>: Sendable {
    @usableFromInline
    struct Storage: Sendable {
        @usableFromInline var exact: [Key: SlotList<Element>] = [:]
        @usableFromInline var prefixes: [Key: SlotList<Element>] = [:]
        /// UTF-8 length → number of distinct registered prefixes of that length.
        @usableFromInline var prefixLengths: [Int: Int] = [:]
        @usableFromInline var all = SlotList<Element>()
        @usableFromInline var selections: [ObserverID: Selection] = [:]

        @usableFromInline init() {}
    }

    @usableFromInline let storage = Locked(Storage())

    public init() {}

    /// The number of registrations.
    public var count: Int { storage.withLock { $0.selections.count } }

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
        storage.withLock { s in
            s.selections[id] = selection
            switch selection {
            case .all:
                s.all.append(observer, id: id)
            case .keys(let keys):
                for key in keys { s.exact[key, default: SlotList()].append(observer, id: id) }
            case .prefix(let prefix) where prefix.isEmpty:
                s.all.append(observer, id: id)
            case .prefix(let prefix):
                let p = Key(prefix)
                if s.prefixes[p] == nil { s.prefixLengths[p.utf8Count, default: 0] += 1 }
                s.prefixes[p, default: SlotList()].append(observer, id: id)
            }
        }
    }

    /// Removes a registration; returns its observer if it was present.
    @discardableResult
    public func remove(_ id: ObserverID) -> Element? {
        storage.withLock { Self.remove(id, from: &$0) }
    }

    /// Removes several registrations in one step.
    public func remove(contentsOf ids: some Sequence<ObserverID>) {
        storage.withLock { s in
            for id in ids { Self.remove(id, from: &s) }
        }
    }

    @discardableResult
    private static func remove(_ id: ObserverID, from s: inout Storage) -> Element? {
        guard let selection = s.selections.removeValue(forKey: id) else { return nil }
        var removed: Element?
        switch selection {
        case .all:
            removed = s.all.remove(id)
        case .keys(let keys):
            for key in keys {
                guard var list = s.exact.removeValue(forKey: key) else { continue }
                removed = list.remove(id) ?? removed
                if !list.isEmpty { s.exact[key] = list }
            }
        case .prefix(let prefix) where prefix.isEmpty:
            removed = s.all.remove(id)
        case .prefix(let prefix):
            let p = Key(prefix)
            if var list = s.prefixes.removeValue(forKey: p) {
                removed = list.remove(id)
                if list.isEmpty {
                    let n = p.utf8Count
                    let left = (s.prefixLengths[n] ?? 1) - 1
                    s.prefixLengths[n] = left == 0 ? nil : left
                } else {
                    s.prefixes[p] = list
                }
            }
        }
        return removed
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
            if keys.count == 1 {
                var out: [Routed<Element>] = []
                Self.forEachMatch(of: keys[0], in: s) { slot in
                    out.append(Routed(id: slot.id, observer: slot.element, selected: .all))
                }
                return out
            }
            var position: [ObserverID: Int] = [:]
            var matches: [(slot: SlotList<Element>.Slot, indices: [Int])] = []
            for (i, key) in keys.enumerated() {
                Self.forEachMatch(of: key, in: s) { slot in
                    if let j = position[slot.id] {
                        matches[j].indices.append(i)
                    } else {
                        position[slot.id] = matches.count
                        matches.append((slot, [i]))
                    }
                }
            }
            return matches.map { m in
                Routed(
                    id: m.slot.id, observer: m.slot.element,
                    selected: m.indices.count == keys.count ? .all : .some(m.indices))
            }
        }
    }

    @inlinable
    static func forEachMatch(
        of key: Key, in s: Storage, _ body: (SlotList<Element>.Slot) -> Void
    ) {
        if let list = s.exact[key] { list.slots.forEach(body) }
        if !s.prefixLengths.isEmpty {
            key.withUTF8 { bytes in
                for length in s.prefixLengths.keys where length <= bytes.count {
                    // A prefix is valid UTF-8: it cannot end just before a continuation byte.
                    if length < bytes.count, bytes[length] & 0xC0 == 0x80 { continue }
                    let candidate = Key(String(decoding: UnsafeBufferPointer(rebasing: bytes[..<length]), as: UTF8.self))
                    s.prefixes[candidate]?.slots.forEach(body)
                }
            }
        }
        s.all.slots.forEach(body)
    }
}
