// ObsCore — a run of revision records in one buffer: revisions waiting to be durable, or
// waiting in an event loop's inbox to be delivered. Appending copies a record's bytes; the
// buffer is reused, so a steady stream of revisions allocates nothing.

/// Revision records in one growable buffer, each with a tag (the inbox's repository).
public struct RecordBatch<Tag> {
    public struct Entry {
        public var tag: Tag
        public var info: RevisionInfo
        public var place: RecordPlace

        @inlinable
        init(tag: Tag, info: RevisionInfo, place: RecordPlace) {
            self.tag = tag
            self.info = info
            self.place = place
        }
    }

    // Inlinable (and so specialized where the batch is used: the server's inboxes, per
    // revision) — a generic call per revision instantiated the batch's metadata every time.
    @usableFromInline var bytes: [UInt8] = []
    @usableFromInline var entries: [Entry] = []
    /// Entries before this one were taken off the front.
    @usableFromInline var head = 0

    public init() {}

    @inlinable public var isEmpty: Bool { head == entries.count }
    @inlinable public var count: Int { entries.count - head }

    /// Appends a copy of `view`'s record.
    @inlinable
    public mutating func append(_ view: RevisionView, tag: Tag) {
        let offset = bytes.count
        bytes.append(contentsOf: view.record)
        entries.append(Entry(tag: tag, info: view.info, place: view.place.moved(to: offset)))
    }

    /// Appends a record already in `bytes`' layout: encodes it with `encode`, which appends
    /// to the buffer and returns where the record lies.
    @inlinable
    public mutating func append(tag: Tag, info: RevisionInfo, _ encode: (inout [UInt8]) -> RecordPlace) {
        let place = encode(&bytes)
        entries.append(Entry(tag: tag, info: info, place: place))
    }

    /// The entry at `index` (0: the first not yet taken), read in place.
    @inlinable
    public func withEntry<R>(_ index: Int, _ body: (Tag, RevisionView) -> R) -> R {
        let entry = entries[head + index]
        return bytes.withUnsafeBytes { body(entry.tag, RevisionView(info: entry.info, place: entry.place, bytes: $0)) }
    }

    /// Calls `body` with every entry, oldest first.
    @inlinable
    public func forEach(_ body: (Tag, RevisionView) -> Void) {
        bytes.withUnsafeBytes { raw in
            for i in head..<entries.count {
                let entry = entries[i]
                body(entry.tag, RevisionView(info: entry.info, place: entry.place, bytes: raw))
            }
        }
    }

    /// Calls `body` with the buffer the entries' records lie in (for views of several
    /// entries at once: `RevisionView(info: entry(i).info, place: entry(i).place, bytes:)`).
    @inlinable
    public func withBytes<R>(_ body: (UnsafeRawBufferPointer) -> R) -> R {
        bytes.withUnsafeBytes(body)
    }

    /// The tag and info of entry `index`.
    @inlinable
    public func entry(_ index: Int) -> Entry { entries[head + index] }

    /// Takes the first `n` entries off the front (their bytes stay until the batch empties).
    @inlinable
    public mutating func removeFirst(_ n: Int) {
        head += n
        if head >= entries.count { removeAll() }
    }

    /// Removes the `n` newest entries and their bytes.
    @inlinable
    public mutating func removeLast(_ n: Int) {
        for _ in 0..<min(n, count) {
            let last = entries.removeLast()
            bytes.removeSubrange(last.place.start...)
        }
        if isEmpty { removeAll() }
    }

    /// Empties the batch, keeping its buffers' capacity (bounded: a burst's buffers are
    /// released once they grew past 4 MiB).
    @inlinable
    public mutating func removeAll() {
        let keep = bytes.capacity <= 4 << 20
        bytes.removeAll(keepingCapacity: keep)
        entries.removeAll(keepingCapacity: keep)
        head = 0
    }

    /// Swaps contents with `other` (an inbox hands its batch to the loop this way).
    @inlinable
    public mutating func swapWith(_ other: inout RecordBatch<Tag>) {
        swap(&bytes, &other.bytes)
        swap(&entries, &other.entries)
        swap(&head, &other.head)
    }
}

extension RecordBatch: Sendable where Tag: Sendable {}
extension RecordBatch.Entry: Sendable where Tag: Sendable {}
