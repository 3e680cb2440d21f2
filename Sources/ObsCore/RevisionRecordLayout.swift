// ObsCore — one revision as flat bytes: how the history keeps it and how it travels to the
// event loops that deliver it. No object per revision: a record is a run of bytes in a
// buffer the history or a loop's inbox owns, read through `RevisionView`.
//
// A record is `[table | body | keys]`:
// - the body is the revision's `change` event minus the head each subscriber writes itself
//   (`{"event":"change","sub":N` and its `by`): `,"repo":…,"rev":…,"changes":[…]` then the
//   event's tail (`]`, the lease member of a lease's end, `}\n`), encoded once when the
//   revision is made;
// - the table gives, per change, the range of its object in the body and of its key's raw
//   bytes — inside that object when the key needs no escaping, else in the keys area — so
//   routing reads keys without decoding JSON, and a subscriber that selects some of a
//   revision's changes gets exactly those objects, not re-encoded.

import ObsProtocol
import ObsValues
import ObservableKit

/// What a revision carries besides its changes, kept beside its bytes.
public struct RevisionInfo: Sendable, Equatable {
    public var revision: UInt64
    /// When it was made, in seconds since 1970 (never earlier than the revision before it).
    public var time: Int64
    /// Who wrote it (nil: not recorded).
    public var writer: Writer?
    /// The connection of this process that wrote it (0: none — loaded, another daemon's, a lease's end).
    public var origin: UInt64
    /// What it weighs against the history's and a revision's byte limits (see `weight(of:)`).
    public var weight: Int

    public init(revision: UInt64, time: Int64, writer: Writer?, origin: UInt64, weight: Int) {
        self.revision = revision
        self.time = time
        self.writer = writer
        self.origin = origin
        self.weight = weight
    }

    /// What one change weighs: its key, old and new value, and 32 bytes for what goes with them.
    @inlinable
    public static func weight(of change: Change<CanonicalJSON>) -> Int {
        change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 32
    }
}

/// Where a record's parts lie in the buffer that holds it.
public struct RecordPlace: Sendable {
    /// The record's first byte (its table).
    public var start: Int
    public var changeCount: Int
    /// The body: `prefixEnd` ends `"changes":[`, `suffixStart` begins the tail `]…}\n`.
    public var bodyStart: Int
    public var prefixEnd: Int
    public var suffixStart: Int
    public var bodyEnd: Int
    /// The end of the keys area (the record's end).
    public var end: Int

    @inlinable public var length: Int { end - start }

    @inlinable
    public init(start: Int, changeCount: Int, bodyStart: Int, prefixEnd: Int, suffixStart: Int, bodyEnd: Int, end: Int) {
        self.start = start
        self.changeCount = changeCount
        self.bodyStart = bodyStart
        self.prefixEnd = prefixEnd
        self.suffixStart = suffixStart
        self.bodyEnd = bodyEnd
        self.end = end
    }

    /// The same record moved to `offset`.
    @inlinable
    public func moved(to offset: Int) -> RecordPlace {
        let d = offset - start
        return RecordPlace(
            start: offset, changeCount: changeCount, bodyStart: bodyStart + d, prefixEnd: prefixEnd + d, suffixStart: suffixStart + d,
            bodyEnd: bodyEnd + d, end: end + d)
    }
}

/// Encodes revisions as records.
public enum RevisionRecordLayout {
    /// Bytes of one table entry, two little-endian `UInt32`: where the change's object starts
    /// (relative to the record's start; it ends where the next one's comma is, or the last one
    /// where the tail begins), and where its key is — `keyInBody | length` when its bytes are
    /// the object's key string as it is (after `{"key":"`), else where the keys area holds it,
    /// after a `UInt32` length.
    public static let tableEntry = 8
    @usableFromInline static let keyInBody: UInt32 = 1 << 31

    /// `,"repo":<name>,"rev":` — how every body of repository `repo` begins (made once).
    public static func prefix(repo: String) -> [UInt8] {
        var bytes: [UInt8] = []
        bytes.writeMember(",\"repo\":", repo)
        bytes.writeRaw(",\"rev\":")
        return bytes
    }

    /// Appends the record of a revision with `changes` (of the repository whose `prefix` this
    /// is; and, for a lease's end, `tail` — its `,"lease":{…}` member — before the closing
    /// brace) to `bytes`; returns where its parts lie.
    ///
    /// A record is written through a pointer into a buffer sized for it (on the stack when
    /// small), then appended with one copy (an array written a byte at a time checks its
    /// capacity and uniqueness at every byte: that was most of a write's cost).
    public static func append<C: RecordChanges>(
        prefix: [UInt8], revision: UInt64, changes: C, into bytes: inout [UInt8], tail: [UInt8] = []
    ) -> RecordPlace {
        let offset = bytes.count
        return withEncoded(prefix: prefix, revision: revision, changes: changes, tail: tail) { record, place in
            bytes.append(contentsOf: record)
            return place.moved(to: offset)
        }
    }

    /// Calls `body` with the record (see `append`) encoded in a buffer of its own, and where
    /// its parts lie there.
    @inlinable
    public static func withEncoded<C: RecordChanges, R>(
        prefix: [UInt8], revision: UInt64, changes: C, tail: [UInt8] = [],
        _ body: (UnsafeRawBufferPointer, RecordPlace) -> R
    ) -> R {
        let bound = bound(prefix: prefix, changes: changes, tail: tail)
        return withUnsafeTemporaryAllocation(byteCount: bound, alignment: 8) { buffer in
            var sink = PointerSink(buffer.baseAddress.unsafelyUnwrapped)
            let place = encode(prefix: prefix, revision: revision, changes: changes, into: &sink, tail: tail)
            assert(sink.count <= bound, "a record's bound was too small")
            return body(UnsafeRawBufferPointer(start: buffer.baseAddress, count: sink.count), place)
        }
    }

    /// At least the size of the record `append` writes for `changes`.
    @inlinable
    @_specialize(where C == RawChanges)
    public static func bound<C: RecordChanges>(prefix: [UInt8], changes: C, tail: [UInt8] = []) -> Int {
        var bound = prefix.count + tail.count + 64
        for i in 0..<changes.count {
            // A key's escapes take up to 6 bytes per byte, and it may be written twice.
            bound += tableEntry + 32 + 6 * changes.withKeyBytes(i) { $0.count } + changes.byteCount(i)
        }
        return bound
    }

    /// Writes the record into `sink` (see `append`). (Specialized for every write's record:
    /// reached through the history's chunk, it was otherwise called unspecialized, each
    /// change's parts read through witness tables.)
    @inlinable
    @_specialize(where S == PointerSink, C == RawChanges)
    static func encode<S: RecordSink, C: RecordChanges>(
        prefix: [UInt8], revision: UInt64, changes: C, into bytes: inout S, tail: [UInt8]
    ) -> RecordPlace {
        let start = bytes.count
        let count = changes.count
        bytes.writeZeros(count * tableEntry)
        let bodyStart = bytes.count
        bytes.writeRaw(prefix)
        bytes.writeDecimal(revision)
        bytes.writeRaw(",\"changes\":[")
        let prefixEnd = bytes.count
        for i in 0..<count {
            if i > 0 { bytes.writeByte(UInt8(ascii: ",")) }
            let changeStart = bytes.count
            changes.writeChange(i, into: &bytes)
            bytes.setTable(start, i, 0, changeStart - start)
            let (escaped, length) = changes.withKeyBytes(i) { (needsEscaping($0), $0.count) }
            if !escaped { bytes.setTable(start, i, 1, Int(keyInBody) | length) }
        }
        let suffixStart = bytes.count
        bytes.writeByte(UInt8(ascii: "]"))
        bytes.writeRaw(tail)
        bytes.writeRaw("}\n")
        let bodyEnd = bytes.count
        for i in 0..<count {
            changes.withKeyBytes(i) { key in
                guard needsEscaping(key) else { return }
                bytes.setTable(start, i, 1, bytes.count - start)
                var length = UInt32(key.count).littleEndian
                withUnsafeBytes(of: &length) { bytes.writeBytes($0) }
                bytes.writeBytes(key)
            }
        }
        return RecordPlace(
            start: start, changeCount: count, bodyStart: bodyStart, prefixEnd: prefixEnd, suffixStart: suffixStart, bodyEnd: bodyEnd,
            end: bytes.count)
    }
}

/// Whether a key's JSON string differs from its bytes (`"`, `\` and control characters are
/// escaped, as `writeJSONString` does).
@inlinable
func needsEscaping(_ key: UnsafeRawBufferPointer) -> Bool {
    key.contains { $0 < 0x20 || $0 == UInt8(ascii: "\"") || $0 == UInt8(ascii: "\\") }
}

/// Where a record is written: a growable array, or a pointer into a buffer sized for it.
public protocol RecordSink: JSONSink {
    /// Bytes written so far.
    var count: Int { get }
    mutating func writeZeros(_ n: Int)
    /// Sets field `field` of table entry `entry` of the record that starts at `start`.
    mutating func setTable(_ start: Int, _ entry: Int, _ field: Int, _ value: Int)
}

extension Array: RecordSink where Element == UInt8 {
    @inlinable
    public mutating func writeZeros(_ n: Int) { append(contentsOf: repeatElement(0, count: n)) }

    @inlinable
    public mutating func setTable(_ start: Int, _ entry: Int, _ field: Int, _ value: Int) {
        let at = start + entry * RevisionRecordLayout.tableEntry + field * 4
        withUnsafeMutableBytes { $0.storeBytes(of: UInt32(truncatingIfNeeded: value).littleEndian, toByteOffset: at, as: UInt32.self) }
    }
}

/// Writes through a pointer, with no checks: the caller sized the buffer (`append`'s bound).
@usableFromInline
struct PointerSink: RecordSink {
    @usableFromInline let base: UnsafeMutableRawPointer
    @usableFromInline var count = 0

    @inlinable
    init(_ base: UnsafeMutableRawPointer) { self.base = base }

    @inlinable
    mutating func writeByte(_ byte: UInt8) {
        base.storeBytes(of: byte, toByteOffset: count, as: UInt8.self)
        count += 1
    }

    @inlinable
    mutating func writeBytes(_ bytes: UnsafeRawBufferPointer) {
        guard let source = bytes.baseAddress else { return }
        (base + count).copyMemory(from: source, byteCount: bytes.count)
        count += bytes.count
    }

    @inlinable
    mutating func writeZeros(_ n: Int) {
        (base + count).initializeMemory(as: UInt8.self, repeating: 0, count: n)
        count += n
    }

    @inlinable
    mutating func setTable(_ start: Int, _ entry: Int, _ field: Int, _ value: Int) {
        let at = start + entry * RevisionRecordLayout.tableEntry + field * 4
        base.storeBytes(of: UInt32(truncatingIfNeeded: value).littleEndian, toByteOffset: at, as: UInt32.self)
    }
}

/// A record read in place: valid only while the buffer that holds it is not mutated.
public struct RevisionView {
    public let info: RevisionInfo
    public let place: RecordPlace
    /// The buffer's bytes (the record lies at `place`).
    public let bytes: UnsafeRawBufferPointer

    @inlinable
    public init(info: RevisionInfo, place: RecordPlace, bytes: UnsafeRawBufferPointer) {
        self.info = info
        self.place = place
        self.bytes = bytes
    }

    @inlinable public var revision: UInt64 { info.revision }
    @inlinable public var changeCount: Int { place.changeCount }

    @inlinable
    func table(_ entry: Int, _ field: Int) -> Int {
        Int(UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: place.start + entry * RevisionRecordLayout.tableEntry + field * 4, as: UInt32.self)))
    }

    /// The raw bytes of change `i`'s key.
    @inlinable
    public func keyBytes(_ i: Int) -> UnsafeRawBufferPointer {
        let field = UInt32(table(i, 1))
        if field & RevisionRecordLayout.keyInBody != 0 {
            let start = place.start + table(i, 0) + 8
            return UnsafeRawBufferPointer(rebasing: bytes[start..<(start + Int(field & ~RevisionRecordLayout.keyInBody))])
        }
        let start = place.start + Int(field)
        let length = Int(UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: start, as: UInt32.self)))
        return UnsafeRawBufferPointer(rebasing: bytes[(start + 4)..<(start + 4 + length)])
    }

    /// Change `i`'s key.
    @inlinable
    public func key(_ i: Int) -> Key {
        Key(String(decoding: keyBytes(i), as: UTF8.self))
    }

    /// Change `i`'s object in the body (`{"key":…,"old":…,"new":…}`).
    @inlinable
    public func changeObject(_ i: Int) -> UnsafeRawBufferPointer {
        let end = i + 1 < changeCount ? place.start + table(i + 1, 0) - 1 : place.suffixStart
        return UnsafeRawBufferPointer(rebasing: bytes[(place.start + table(i, 0))..<end])
    }

    /// The whole body.
    @inlinable
    public var body: UnsafeRawBufferPointer { UnsafeRawBufferPointer(rebasing: bytes[place.bodyStart..<place.bodyEnd]) }

    /// The whole record (to copy it elsewhere).
    @inlinable
    public var record: UnsafeRawBufferPointer { UnsafeRawBufferPointer(rebasing: bytes[place.start..<place.end]) }

    /// Whether `selection` picks any of its changes.
    @inlinable
    public func touches(_ selection: Selection) -> Bool {
        if case .all = selection { return true }
        for i in 0..<changeCount where selection.matches(key(i)) { return true }
        return false
    }

    /// The changes `selection` picks.
    @inlinable
    public func selected(by selection: Selection) -> SelectedChanges {
        if case .all = selection { return .all }
        var positions: [Int] = []
        for i in 0..<changeCount where selection.matches(key(i)) { positions.append(i) }
        return positions.count == changeCount ? .all : .some(positions)
    }

    /// Writes the body with the changes `selected` picks (all: the body as it is).
    @inlinable
    public func writeBody<S: JSONSink & ~Copyable>(_ sink: inout S, selected: SelectedChanges) {
        switch selected {
        case .all:
            sink.writeBytes(body)
        case .some(let positions):
            sink.writeBytes(UnsafeRawBufferPointer(rebasing: bytes[place.bodyStart..<place.prefixEnd]))
            for (n, i) in positions.enumerated() {
                if n > 0 { sink.writeByte(UInt8(ascii: ",")) }
                sink.writeBytes(changeObject(i))
            }
            sink.writeBytes(UnsafeRawBufferPointer(rebasing: bytes[place.suffixStart..<place.bodyEnd]))
        }
    }

    /// Writes the whole `change` event for subscription `sub` (with `by` when `writers`).
    @inlinable
    public func writeEvent<S: JSONSink & ~Copyable>(_ sink: inout S, sub: UInt64, writers: Bool, selected: SelectedChanges) {
        EventEncoder.writeChangeHead(&sink, sub: sub)
        if writers, let writer = info.writer { EventEncoder.writeBy(&sink, writer) }
        writeBody(&sink, selected: selected)
    }

    /// The changes, decoded (coalescing folds them; rare).
    public func changes(_ selected: SelectedChanges) -> [Change<CanonicalJSON>] {
        let positions: [Int] = switch selected {
        case .all: Array(0..<changeCount)
        case .some(let p): p
        }
        return positions.compactMap { i in
            ChangeObject.decode(changeObject(i), key: key(i))
        }
    }
}

/// Reads a change object back (`{"key":…,"old":…,"new":…}`, as `EventEncoder.writeChange`
/// wrote it from canonical values).
enum ChangeObject {
    static func decode(_ bytes: UnsafeRawBufferPointer, key: Key) -> Change<CanonicalJSON>? {
        guard case .object(let o)? = try? JSONParser.parse(bytes, maxDepth: Int.max) else { return nil }
        return Change(key: key, old: o["old"].map(CanonicalJSON.init), new: o["new"].map(CanonicalJSON.init))
    }
}
