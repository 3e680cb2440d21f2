// ObsStore — a repository's retained history as start-up hands it over: the revisions a
// snapshot holds, kept as the snapshot stores them (one buffer) and decoded one at a time as
// they are read, then those replayed from the log. Decoding every revision up front would
// hold each change's key and values as objects of their own at once — hundreds of megabytes
// for a history of a million changes — only to free them when the server has re-encoded them.

import ObsValues
import ObservableKit

/// Revisions oldest first, each decoded when read.
public struct LoadedHistory: RandomAccessCollection, ExpressibleByArrayLiteral, Sendable {
    /// The repository's name (a stored revision does not repeat it).
    private let repo: String
    /// Stored revisions' bodies (see `StoredRevision`), one after another, and where each begins.
    private var stored: [UInt8] = []
    private var starts: [Int] = []
    /// The first stored revision retained.
    private var first = 0
    private var replayed: [RevisionRecord]

    /// Revisions already decoded (from the log, another store, or a test).
    public init(_ records: [RevisionRecord]) {
        repo = records.first?.repo ?? ""
        replayed = records
    }

    public init(arrayLiteral records: RevisionRecord...) { self.init(records) }

    /// An empty history of repository `repo`.
    init(repo: String) {
        self.repo = repo
        replayed = []
    }

    public var startIndex: Int { 0 }
    public var endIndex: Int { storedCount + replayed.count }

    public subscript(position: Int) -> RevisionRecord {
        if position < storedCount {
            // Checked when it was read (`appendStored`): it decodes.
            return storedRevision(position).record(repo: repo) ?? RevisionRecord(repo: repo, changeSet: ChangeSet(revision: 0, changes: []), time: 0, writer: nil)
        }
        return replayed[position - storedCount]
    }

    private var storedCount: Int { starts.count - first }

    private func body(_ position: Int) -> Range<Int> {
        let i = first + position
        return starts[i]..<(i + 1 < starts.count ? starts[i + 1] : stored.count)
    }

    private func storedRevision(_ position: Int) -> StoredRevision {
        stored.withUnsafeBytes { raw in
            var reader = PayloadReader(UnsafeRawBufferPointer(rebasing: raw[body(position)]))
            return StoredRevision.fields(&reader)!
        }
    }

    // MARK: Building (start-up)

    /// Appends a revision as a snapshot stores it (its body); false if it does not decode.
    mutating func appendStored(_ body: UnsafeRawBufferPointer) -> Bool {
        var reader = PayloadReader(body)
        guard let revision = StoredRevision.fields(&reader), (try? LogRecord.checkChanges(revision.changes)) != nil else { return false }
        if !replayed.isEmpty {
            // After decoded revisions (an earlier obsd's, migrated), stays decoded, in order.
            guard let record = revision.record(repo: repo) else { return false }
            replayed.append(record)
            return true
        }
        starts.append(stored.count)
        stored.append(contentsOf: body)
        return true
    }

    /// Appends a revision replayed from the log.
    mutating func append(_ record: RevisionRecord) { replayed.append(record) }

    private func revision(_ position: Int) -> UInt64 {
        position < storedCount ? storedRevision(position).revision : replayed[position - storedCount].revision
    }

    private func weight(_ position: Int) -> Int {
        position < storedCount ? storedRevision(position).weight : replayed[position - storedCount].byteSize
    }

    private func time(_ position: Int) -> Int64 {
        position < storedCount ? storedRevision(position).time : replayed[position - storedCount].time
    }

    /// Keeps what a repository retains (see `Loader.retained`): the contiguous run of
    /// revisions ending at its newest, within `limit` revisions and `maxBytes` (the newest
    /// always stays), none at or before the newest one older than `cutoff`. Returns the
    /// weight kept.
    @discardableResult
    mutating func retain(limit: Int, maxBytes: Int, cutoff: Int64 = .min) -> Int {
        guard limit > 0, let newest = indices.last else {
            self = LoadedHistory(repo: repo)
            return 0
        }
        var start = newest
        var bytes = weight(start)
        if time(start) < cutoff {
            self = LoadedHistory(repo: repo)
            return 0
        }
        while start > 0, count - start < limit, revision(start - 1) + 1 == revision(start), bytes + weight(start - 1) <= maxBytes,
            time(start - 1) >= cutoff
        {
            start -= 1
            bytes += weight(start)
        }
        drop(start)
        return bytes
    }

    /// Forgets the `n` oldest revisions.
    private mutating func drop(_ n: Int) {
        let fromStored = Swift.min(n, storedCount)
        first += fromStored
        if n > fromStored { replayed.removeFirst(n - fromStored) }
        if storedCount == 0 {
            stored = []
            starts = []
            first = 0
        } else if first * 2 >= starts.count {
            // Most of the buffer is dropped revisions: keep only the rest.
            let cut = starts[first]
            stored.removeFirst(cut)
            starts.removeFirst(first)
            for i in starts.indices { starts[i] -= cut }
            first = 0
        }
    }

    /// Calls `stored` with each retained stored revision's body, then `replayed` with each
    /// replayed one (a snapshot writes them without decoding the former).
    func forEach<E: Error>(stored storedBody: (UnsafeRawBufferPointer) throws(E) -> Void, replayed record: (RevisionRecord) throws(E) -> Void) throws(E) {
        for position in 0..<storedCount {
            let range = body(position)
            try stored.withUnsafeBytes { raw in Result { () throws(E) in try storedBody(UnsafeRawBufferPointer(rebasing: raw[range])) } }.get()
        }
        for r in replayed { try record(r) }
    }
}
