// ObsServer — a repository's recent revisions, kept for `since` replay.
//
// The newest revisions, contiguous (every revision is recorded), bounded three ways: by
// count (`history.limit`), by bytes (`history.max-bytes`, counted as
// `RevisionRecord.byteSize`; the newest revision stays whatever its size) and optionally by
// age. A subscriber resuming after revision N is served from here if the history still
// reaches back to N + 1; otherwise the answer is `compacted`. The store keeps the same
// window on disk, so it is rebuilt at start-up.

import NIOCore
import ObsStore

/// How much history a repository keeps.
struct HistoryLimits: Sendable {
    /// Revisions (0: none).
    var count: Int
    /// Bytes of revisions.
    var maxBytes: Int
    /// Seconds (nil: no age limit).
    var maxAge: Int64?
}

/// The most recent revisions of one repository, oldest first.
struct History: Sendable {
    let limits: HistoryLimits
    private var revisions = CircularBuffer<Revision>()
    private var bytes = 0

    init(limits: HistoryLimits) {
        self.limits = limits
    }

    var count: Int { revisions.count }

    /// The oldest revision held and not expired at `now`, if any.
    func oldestRevision(now: Int64) -> UInt64? {
        firstLive(now: now).map { revisions[revisions.index(revisions.startIndex, offsetBy: $0)].revision }
    }

    /// The offset of the oldest record not expired at `now`.
    private func firstLive(now: Int64) -> Int? {
        guard !revisions.isEmpty else { return nil }
        guard let maxAge = limits.maxAge else { return 0 }
        // Times never go back within a repository (see `Repository.write`): binary search.
        var low = 0
        var high = revisions.count
        while low < high {
            let mid = (low + high) / 2
            if revisions[revisions.index(revisions.startIndex, offsetBy: mid)].record.time < now - maxAge { low = mid + 1 } else { high = mid }
        }
        return low < revisions.count ? low : nil
    }

    /// Appends the next revision, dropping the oldest beyond the limits.
    mutating func append(_ revision: Revision) {
        guard limits.count > 0 else { return }
        revisions.append(revision)
        bytes += revision.record.byteSize
        while revisions.count > limits.count || (bytes > limits.maxBytes && revisions.count > 1) {
            bytes -= revisions.removeFirst().record.byteSize
        }
    }

    /// Removes the `n` newest records (revisions undone after a storage failure).
    mutating func removeLast(_ n: Int) {
        for _ in 0..<min(n, revisions.count) { bytes -= revisions.removeLast().record.byteSize }
    }

    /// The records with revisions above `revision`, oldest first — or `nil` when the
    /// history (as of `now`) no longer reaches back to `revision + 1` while `current` is above it.
    func records(after revision: UInt64, current: UInt64, now: Int64) -> [Revision]? {
        if revision >= current { return [] }
        guard let first = firstLive(now: now) else { return nil }
        let oldest = revisions[revisions.index(revisions.startIndex, offsetBy: first)].revision
        guard oldest <= revision + 1 else { return nil }
        let skip = Int(revision + 1 - oldest)
        return Array(revisions[revisions.index(revisions.startIndex, offsetBy: first + skip)...])
    }
}
