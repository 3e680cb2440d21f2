// ObsServer — a repository's recent revisions, kept for `since` replay.
//
// A ring of the last `capacity` revisions (contiguous: every revision is recorded). A
// subscriber resuming after revision N is served from here if the ring still reaches
// back to N + 1; otherwise the answer is `compacted`.

/// The most recent revisions of one repository, oldest first.
struct History: Sendable {
    let capacity: Int
    private var ring: [RevisionRecord] = []
    private var head = 0  // index of the oldest record once the ring is full

    init(capacity: Int) {
        self.capacity = max(0, capacity)
    }

    var count: Int { ring.count }

    /// The oldest revision held, if any.
    var oldestRevision: UInt64? {
        ring.isEmpty ? nil : ring[head].revision
    }

    /// Appends the next revision, dropping the oldest when full.
    mutating func append(_ record: RevisionRecord) {
        guard capacity > 0 else { return }
        if ring.count < capacity {
            ring.append(record)
        } else {
            ring[head] = record
            head = (head + 1) % capacity
        }
    }

    /// The records with revisions above `revision`, oldest first — or `nil` when the
    /// history no longer reaches back to `revision + 1` while `current` is above it.
    func records(after revision: UInt64, current: UInt64) -> [RevisionRecord]? {
        if revision >= current { return [] }
        guard let oldest = oldestRevision, oldest <= revision + 1 else { return nil }
        let skip = Int(revision + 1 - oldest)
        let n = ring.count
        return (skip..<n).map { ring[(head + $0) % n] }
    }
}
