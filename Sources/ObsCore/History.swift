// ObsCore — a repository's recent revisions, kept for `since` replay: records in flat chunks.
//
// The newest revisions, contiguous (every revision is recorded), bounded three ways: by
// count (`history.limit`), by weight (`history.max-bytes`, counted as `RevisionInfo.weight`;
// the newest revision stays whatever its size) and optionally by age. Records live in chunks
// of about `chunkSize` bytes, one allocation per chunk, not per revision: a revision is
// encoded straight into the end of the last chunk (no buffer of its own, no copy), dropping
// the oldest revisions frees a chunk once none of its records is left. A subscriber
// resuming after revision N is served from here if the history still reaches back to N + 1;
// otherwise the answer is `compacted`.

import ObsStore
import ObsValues
import ObservableKit

/// How much history a repository keeps.
public struct HistoryLimits: Sendable, Equatable {
    /// Revisions (0: none).
    public var count: Int
    /// Weight of revisions (`RevisionInfo.weight`).
    public var maxBytes: Int
    /// Seconds (nil: no age limit).
    public var maxAge: Int64?
    /// Deleted keys remembered (tombstones, for catch-ups: `Tombstones`).
    public var tombstones: Int

    public init(count: Int, maxBytes: Int, maxAge: Int64?, tombstones: Int = Tombstones.defaultLimit) {
        self.count = count
        self.maxBytes = maxBytes
        self.maxAge = maxAge
        self.tombstones = tombstones
    }
}

/// The most recent revisions of one repository, oldest first.
public struct History: Sendable {
    public let limits: HistoryLimits
    /// Records are written into a chunk until it holds this many bytes.
    static let chunkSize = 256 << 10

    // Usable from inline code (with `withNewest`): delivery reads the newest record once per
    // revision, and a generic function compiled here reaches `Array.withUnsafeBytes`
    // unspecialized.
    @usableFromInline
    struct Entry: Sendable {
        @usableFromInline var info: RevisionInfo
        /// The chunk's number (counted from the first chunk ever) and the record's place in it.
        @usableFromInline var chunk: Int
        @usableFromInline var place: RecordPlace
    }

    /// A chunk's bytes, allocated once at their full capacity: records already written never
    /// move, and the next is encoded in place after them.
    ///
    /// `@unchecked Sendable`: a chunk is mutated (`count`, the bytes past it) only through a
    /// `History` that holds the one reference to it (`makeRoom` starts a new chunk rather
    /// than write into a shared one, `removeLast` copies a shared one first), so a chunk two
    /// values share — which may be on two threads — is never written, as with `Array`'s
    /// copy on write.
    @usableFromInline
    final class Chunk: @unchecked Sendable {
        @usableFromInline let base: UnsafeMutableRawPointer
        @usableFromInline let capacity: Int
        @usableFromInline var count = 0

        init(capacity: Int) {
            base = .allocate(byteCount: capacity, alignment: 8)
            self.capacity = capacity
        }

        deinit { base.deallocate() }

        @inlinable
        var bytes: UnsafeRawBufferPointer { UnsafeRawBufferPointer(start: base, count: count) }

        func copy() -> Chunk {
            let copy = Chunk(capacity: capacity)
            copy.base.copyMemory(from: base, byteCount: count)
            copy.count = count
            return copy
        }
    }

    @usableFromInline private(set) var chunks: [Chunk] = []
    /// The number of the first chunk in `chunks`.
    @usableFromInline private(set) var firstChunk = 0
    /// The records, oldest first, from `head` on (the slots before it are dropped ones,
    /// compacted away now and then).
    @usableFromInline private(set) var entries: [Entry] = []
    @usableFromInline private(set) var head = 0
    private var weight = 0

    public init(limits: HistoryLimits) {
        self.limits = limits
    }

    /// Whether it keeps revisions at all (`history.limit` above 0).
    public var keepsRevisions: Bool { limits.count > 0 }

    /// The number of revisions held.
    public var count: Int { entries.count - head }

    /// The newest revision held, if any.
    public var newest: UInt64? { entries.last.map(\.info.revision) }

    /// Appends the next revision (`changes`, made at `info.revision`), dropping the oldest
    /// beyond the limits.
    @_specialize(where C == RawChanges)
    public mutating func append<C: RecordChanges>(prefix: [UInt8], info: RevisionInfo, changes: C, tail: [UInt8] = []) {
        guard limits.count > 0 else { return }
        let place = makeRoom(RevisionRecordLayout.bound(prefix: prefix, changes: changes, tail: tail))._withUnsafeGuaranteedRef { chunk in
            var sink = PointerSink(chunk.base)
            sink.count = chunk.count
            let place = RevisionRecordLayout.encode(prefix: prefix, revision: info.revision, changes: changes, into: &sink, tail: tail)
            assert(sink.count <= chunk.capacity, "a record's bound was too small")
            chunk.count = sink.count
            return place
        }
        entries.append(Entry(info: info, chunk: firstChunk + chunks.count - 1, place: place))
        weight += info.weight
        while count > limits.count || (weight > limits.maxBytes && count > 1) { dropOldest() }
    }

    /// Appends a record read elsewhere (a revision loaded from storage, already encoded).
    public mutating func append(_ view: RevisionView) {
        guard limits.count > 0 else { return }
        let offset = makeRoom(view.place.length)._withUnsafeGuaranteedRef { chunk in
            let offset = chunk.count
            let record = view.record
            if let source = record.baseAddress { (chunk.base + offset).copyMemory(from: source, byteCount: record.count) }
            chunk.count += record.count
            return offset
        }
        entries.append(Entry(info: view.info, chunk: firstChunk + chunks.count - 1, place: view.place.moved(to: offset)))
        weight += view.info.weight
        while count > limits.count || (weight > limits.maxBytes && count > 1) { dropOldest() }
    }

    /// The last chunk, if it has room for `bytes` more and is this history's alone; else a new
    /// one, appended. A chunk never grows past the capacity it was given. (Unretained: the
    /// chunk is the last of `chunks`, which holds it until the next mutation.)
    private mutating func makeRoom(_ bytes: Int) -> Unmanaged<Chunk> {
        let last = chunks.count - 1
        if last >= 0, chunks[last].capacity - chunks[last].count >= bytes, isKnownUniquelyReferenced(&chunks[last]) {
            return .passUnretained(chunks[last])
        }
        chunks.append(Chunk(capacity: max(Self.chunkSize, bytes)))
        return .passUnretained(chunks[last + 1])
    }

    private mutating func dropOldest() {
        let dropped = entries[head]
        weight -= dropped.info.weight
        head += 1
        // Chunks wholly before the oldest record left are freed.
        let oldestChunk = head < entries.count ? entries[head].chunk : firstChunk + chunks.count
        if oldestChunk > firstChunk {
            chunks.removeFirst(oldestChunk - firstChunk)
            firstChunk = oldestChunk
        }
        if head >= 1024 && head * 2 >= entries.count {
            entries.removeFirst(head)
            head = 0
        }
    }

    /// Removes the `n` newest records (revisions undone after a storage failure).
    public mutating func removeLast(_ n: Int) {
        for _ in 0..<min(n, count) {
            let last = entries.removeLast()
            weight -= last.info.weight
            let index = last.chunk - firstChunk
            if !isKnownUniquelyReferenced(&chunks[index]) { chunks[index] = chunks[index].copy() }
            chunks[index].count = last.place.start
        }
        while let last = chunks.last, last.count == 0 { chunks.removeLast() }
        if count == 0 {
            entries.removeAll()
            head = 0
            chunks.removeAll()
        }
    }

    /// The oldest revision held and not expired at `now`, if any.
    public func oldestRevision(now: Int64) -> UInt64? {
        firstLive(now: now).map { entries[$0].info.revision }
    }

    /// The index of the oldest record not expired at `now`.
    private func firstLive(now: Int64) -> Int? {
        guard count > 0 else { return nil }
        guard let maxAge = limits.maxAge else { return head }
        // Times never go back within a repository: binary search.
        var low = head
        var high = entries.count
        while low < high {
            let mid = (low + high) / 2
            if entries[mid].info.time < now - maxAge { low = mid + 1 } else { high = mid }
        }
        return low < entries.count ? low : nil
    }

    /// The range of records with revisions above `revision` — or `nil` when the history (as
    /// of `now`) no longer reaches back to `revision + 1` while `current` is above it.
    public func records(after revision: UInt64, current: UInt64, now: Int64) -> Range<Int>? {
        if revision >= current { return entries.count..<entries.count }
        guard let first = firstLive(now: now) else { return nil }
        let oldest = entries[first].info.revision
        guard oldest <= revision + 1 else { return nil }
        return (first + Int(revision + 1 - oldest))..<entries.count
    }

    /// Calls `body` with each record of `range` (from `records(after:…)`), oldest first.
    public func forEach(in range: Range<Int>, _ body: (RevisionView) -> Void) {
        for i in range {
            let entry = entries[i]
            body(RevisionView(info: entry.info, place: entry.place, bytes: chunks[entry.chunk - firstChunk].bytes))
        }
    }

    /// Calls `body` with the newest record.
    @inlinable
    public func withNewest<R>(_ body: (RevisionView) -> R) -> R? {
        guard let entry = entries.last, count > 0 else { return nil }
        // The chunk lives as long as `chunks`, which `self` (borrowed for this call) holds.
        return body(RevisionView(info: entry.info, place: entry.place, bytes: chunks[entry.chunk - firstChunk].bytes))
    }
}
