// ObsServer — a repository's recent revisions, kept for `since` replay.
//
// A ring of the last `capacity` revisions (contiguous: every revision is recorded),
// optionally also bounded by age. A subscriber resuming after revision N is served from
// here if the ring still reaches back to N + 1; otherwise the answer is `compacted`. The
// persistent store keeps the same window on disk, so the ring is rebuilt at start-up.

import ObsStore

/// The most recent revisions of one repository, oldest first.
struct History: Sendable {
    let capacity: Int
    /// Records older than this many seconds are gone (nil: no age limit).
    let maxAge: Int64?
    private var ring: [Revision] = []
    private var head = 0  // index of the oldest record once the ring is full

    init(capacity: Int, maxAge: Int64?) {
        self.capacity = max(0, capacity)
        self.maxAge = maxAge
    }

    var count: Int { ring.count }

    private func record(_ i: Int) -> Revision { ring[(head + i) % ring.count] }

    /// The oldest revision held and not expired at `now`, if any.
    func oldestRevision(now: Int64) -> UInt64? {
        guard let i = firstLive(now: now) else { return nil }
        return record(i).revision
    }

    /// The position of the oldest record not expired at `now`.
    private func firstLive(now: Int64) -> Int? {
        guard !ring.isEmpty else { return nil }
        guard let maxAge else { return 0 }
        // Records are in commit order, so their times only grow: binary search.
        var low = 0
        var high = ring.count
        while low < high {
            let mid = (low + high) / 2
            if record(mid).record.time < now - maxAge { low = mid + 1 } else { high = mid }
        }
        return low < ring.count ? low : nil
    }

    /// Appends the next revision, dropping the oldest when full.
    mutating func append(_ record: Revision) {
        guard capacity > 0 else { return }
        if ring.count < capacity {
            ring.append(record)
        } else {
            ring[head] = record
            head = (head + 1) % capacity
        }
    }

    /// Removes the `n` newest records (revisions undone after a storage failure).
    mutating func removeLast(_ n: Int) {
        guard n > 0, !ring.isEmpty else { return }
        var ordered = (0..<ring.count).map { record($0) }
        ordered.removeLast(min(n, ordered.count))
        ring = ordered
        head = 0
    }

    /// The records with revisions above `revision`, oldest first — or `nil` when the
    /// history (as of `now`) no longer reaches back to `revision + 1` while `current` is above it.
    func records(after revision: UInt64, current: UInt64, now: Int64) -> [Revision]? {
        if revision >= current { return [] }
        guard let first = firstLive(now: now) else { return nil }
        let oldest = record(first).revision
        guard oldest <= revision + 1 else { return nil }
        let skip = Int(revision + 1 - oldest)
        return (first + skip..<ring.count).map { record($0) }
    }
}
