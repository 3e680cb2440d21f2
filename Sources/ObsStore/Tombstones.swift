// ObsStore — a repository's tombstones: the revision of the last deletion of each absent key,
// so that a catch-up (the contract's `catchup: "diff"`) can list what was deleted since a
// client's revision. A key that exists again needs none. They are part of the persistent
// state (the snapshot's TOMB block, and the deletions of the log after it), and bounded: the
// most recent `limit` deletions are kept; `floor` is the newest revision of a deletion
// forgotten, so a catch-up from below it cannot show its deletions (it is a `snapshot`).
// `planned` says what floor a run of deletions and re-creations will leave without applying
// them: etcd mode's commit forgets in etcd what every daemon's install of it will forget.

import ObservableKit

public struct Tombstones: Sendable, Equatable {
    /// Deleted keys a repository remembers by default (the contract's least).
    public static let defaultLimit = 100_000

    /// The most deletions remembered.
    public private(set) var limit: Int
    /// Every deletion above this revision is remembered (0: every deletion is).
    public private(set) var floor: UInt64
    /// The revision of each remembered deletion.
    private var revisions: [Key: UInt64] = [:]
    /// Deletions in the order they were made (revisions ascending, but for those an undo put
    /// back), from `head`; an entry whose key was written again since, or deleted again, is
    /// stale and skipped.
    private var order: [(key: Key, revision: UInt64)] = []
    private var head = 0

    /// None remembered; `floor`: the deletions at or below it are not known.
    public init(limit: Int = Tombstones.defaultLimit, floor: UInt64 = 0) {
        self.limit = max(0, limit)
        self.floor = floor
    }

    /// `entries` (in any order), bounded by `limit`.
    public init(_ entries: some Sequence<(key: Key, revision: UInt64)>, limit: Int = Tombstones.defaultLimit, floor: UInt64 = 0) {
        self.init(limit: limit, floor: floor)
        for (key, revision) in entries.sorted(by: { $0.revision < $1.revision }) { deleted(key, at: revision) }
    }

    public static func == (a: Tombstones, b: Tombstones) -> Bool {
        a.floor == b.floor && a.revisions == b.revisions
    }

    /// How many deletions are remembered.
    public var count: Int { revisions.count }
    public var isEmpty: Bool { revisions.isEmpty }

    /// The revision `key` was last deleted at, if it is absent and remembered.
    public subscript(key: Key) -> UInt64? { revisions.isEmpty ? nil : revisions[key] }

    /// Every remembered deletion, oldest first.
    public var entries: [(key: Key, revision: UInt64)] {
        revisions.map { ($0.key, $0.value) }.sorted { $0.revision < $1.revision || ($0.revision == $1.revision && $0.key < $1.key) }
    }

    /// Whether every deletion above `revision` is remembered.
    public func knowsDeletions(after revision: UInt64) -> Bool { floor <= revision }

    /// The remembered keys deleted above `revision` that `selection` selects, in byte order.
    public func deleted(after revision: UInt64, selectedBy selection: Selection) -> [Key] {
        var keys: [Key] = []
        switch selection {
        case .keys(let selected):
            for key in selected { if let at = revisions[key], at > revision { keys.append(key) } }
        default:
            for (key, at) in revisions where at > revision && selection.matches(key) { keys.append(key) }
        }
        return keys.sorted()
    }

    /// `key` was deleted at `revision` (the newest deletion): remembered, the oldest forgotten
    /// past the limit.
    public mutating func deleted(_ key: Key, at revision: UInt64) {
        guard limit > 0 else {
            floor = max(floor, revision)
            return
        }
        revisions[key] = revision
        order.append((key, revision))
        trim()
    }

    /// `key` exists again: its tombstone goes. Returns the revision it held (for an undo).
    @discardableResult
    public mutating func remove(_ key: Key) -> UInt64? {
        guard !revisions.isEmpty, let revision = revisions.removeValue(forKey: key) else { return nil }
        compactIfStale()
        return revision
    }

    /// Puts back a tombstone `remove` took (a write that re-created the key was undone).
    public mutating func restore(_ key: Key, at revision: UInt64) {
        guard revision > floor else { return }  // forgotten meanwhile: stays forgotten
        deleted(key, at: revision)
    }

    /// One change to the tombstones, as `planned(_:)` takes them.
    public enum Step: Sendable {
        /// `deleted(key, at: revision)`.
        case deleted(Key, at: UInt64)
        /// `remove(key)`: the key exists again.
        case recreated(Key)
    }

    /// The floor `steps`, applied in order by `deleted` and `remove`, would leave — without
    /// applying them or copying what is remembered (a shared store's commit says beforehand
    /// what the installs of its revisions will forget).
    public func planned(_ steps: some Sequence<Step>) -> UInt64 {
        var floor = self.floor
        guard limit > 0 else {
            for case .deleted(_, let revision) in steps { floor = max(floor, revision) }
            return floor
        }
        // What the steps changed so far (nil: no tombstone), over `revisions`; the deletions
        // they added, after `order`.
        var changed: [Key: UInt64?] = [:]
        var added: [(key: Key, revision: UInt64)] = []
        var count = revisions.count
        var next = head
        func current(_ key: Key) -> UInt64? {
            if let change = changed[key] { return change }
            return revisions.isEmpty ? nil : revisions[key]
        }
        for step in steps {
            switch step {
            case .recreated(let key):
                if current(key) != nil {
                    changed[key] = .some(nil)
                    count -= 1
                }
            case .deleted(let key, let revision):
                if current(key) == nil { count += 1 }
                changed[key] = revision
                added.append((key, revision))
                // As `trim`: the oldest first, skipping entries no longer current.
                while count > limit, next < order.count + added.count {
                    let (oldest, at) = next < order.count ? order[next] : added[next - order.count]
                    next += 1
                    guard current(oldest) == at else { continue }
                    changed[oldest] = .some(nil)
                    count -= 1
                    floor = max(floor, at)
                }
            }
        }
        return floor
    }

    /// Forgets every deletion at or below `revision` (they can no longer be shown).
    public mutating func forget(through revision: UInt64) {
        guard revision > floor else { return }
        floor = revision
        revisions = revisions.filter { $0.value > revision }
        rebuildOrder()
    }

    /// Remembers at most `limit` deletions from now on (the oldest beyond it forgotten).
    public mutating func setLimit(_ limit: Int) {
        self.limit = max(0, limit)
        if self.limit == 0 {
            floor = max(floor, revisions.values.max() ?? 0)
            revisions = [:]
            rebuildOrder()
        } else {
            trim()
        }
    }

    private mutating func trim() {
        while revisions.count > limit, head < order.count {
            let (key, revision) = order[head]
            head += 1
            guard revisions[key] == revision else { continue }  // stale
            revisions[key] = nil
            floor = max(floor, revision)
        }
        compactIfStale()
    }

    /// Drops the stale entries once they are most of `order`.
    private mutating func compactIfStale() {
        let held = order.count - head
        guard held > 1024, held > 2 * revisions.count else {
            if head > 0, head == order.count {
                order.removeAll(keepingCapacity: true)
                head = 0
            }
            return
        }
        rebuildOrder()
    }

    private mutating func rebuildOrder() {
        order = revisions.map { ($0.key, $0.value) }.sorted { $0.revision < $1.revision }
        head = 0
    }
}
