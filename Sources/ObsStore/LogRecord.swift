// ObsStore — a revision as the write-ahead log holds it: a compact binary form of the
// record and its repository's epoch (so a repository created since the last checkpoint is
// recreated with it). Little-endian:
//
//   u8 version (2) · u16 repo length, repo · u8 epoch length, epoch · u64 revision · i64 time
//   u8 flags (1 writer, 2 lease end) · [u32 uid · u32 gid · i32 pid] · [u64 lease · u8 end]
//   u32 changes · per change: u16 key length, key · u8 flags (1 old, 2 new, 4 old plain,
//   8 new plain) · [u32 length, old bytes] · [u32 length, new bytes]
//
// Version 1 (obsd 0.3.0 before writers were recorded) has no writer field; it is still read.
//
// Values are written canonical and read back as they were written: the log's checksum,
// not a second validation, vouches for them.

import ObsValues
import ObservableKit

enum LogRecord {
    static let version: UInt8 = 2

    /// Appends the encoding of `record` to `out`.
    static func encode(_ record: RevisionRecord, epoch: String, into out: inout [UInt8]) {
        out.append(version)
        appendShort(record.repo.utf8, &out)
        out.append(UInt8(min(epoch.utf8.count, 255)))  // epochs are at most 64 bytes (Epoch.isValid)
        out.append(contentsOf: epoch.utf8.prefix(255))
        append(record.revision, &out)
        append(UInt64(bitPattern: record.time), &out)
        appendWriterAndLeaseEnd(record.writer, record.leaseEnd, to: &out)
        encode(record.changes, into: &out)
    }

    /// Appends the encoding of a revision's changes (`u32 count` and the changes, as above).
    static func encode(_ changes: [Change<CanonicalJSON>], into out: inout [UInt8]) {
        append(UInt32(changes.count), &out)
        for change in changes {
            appendShort(change.key.string.utf8, &out)
            var flags: UInt8 = 0
            if let old = change.old { flags |= 1 | (old.isPlain ? 4 : 0) }
            if let new = change.new { flags |= 2 | (new.isPlain ? 8 : 0) }
            out.append(flags)
            if let old = change.old { appendValue(old, &out) }
            if let new = change.new { appendValue(new, &out) }
        }
    }

    /// Why a checksummed payload does not decode (a bug or a foreign writer, not bit rot).
    struct Malformed: Error {}

    /// The record and epoch in `bytes`.
    static func decode(_ bytes: UnsafeRawBufferPointer) throws(Malformed) -> (record: RevisionRecord, epoch: String) {
        var reader = Reader(bytes: bytes)
        let format = try reader.byte()
        guard format == 1 || format == version else { throw Malformed() }
        let repo = try reader.string(Int(try reader.u16()))
        let epoch = try reader.string(Int(try reader.byte()))
        let revision = try reader.u64()
        let time = Int64(bitPattern: try reader.u64())
        let (writer, leaseEnd) = format >= 2 ? try reader.writerAndLeaseEnd() : (nil, nil)
        let changes = try reader.changes()
        guard reader.offset == bytes.count else { throw Malformed() }
        return (RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: changes), time: time, writer: writer, leaseEnd: leaseEnd), epoch)
    }

    /// The changes encoded by `encode(_:into:)`, filling `bytes` exactly.
    static func decodeChanges(_ bytes: UnsafeRawBufferPointer) throws(Malformed) -> [Change<CanonicalJSON>] {
        var reader = Reader(bytes: bytes)
        let changes = try reader.changes()
        guard reader.offset == bytes.count else { throw Malformed() }
        return changes
    }

    /// A record read in place, nothing decoded into objects: what the checkpointer folds
    /// into a snapshot.
    struct View {
        let repo: UnsafeRawBufferPointer
        let epoch: UnsafeRawBufferPointer
        let revision: UInt64
        let time: Int64
        let writer: Writer?
        let leaseEnd: SharedLeaseEnd?
        /// The changes' encoding (`u32 count` and the changes), as a snapshot's history keeps it.
        let changes: UnsafeRawBufferPointer

        init(_ payload: UnsafeRawBufferPointer) throws(Malformed) {
            var reader = Reader(bytes: payload)
            let format = try reader.byte()
            guard format == 1 || format == version else { throw Malformed() }
            repo = try reader.take(Int(try reader.u16()))
            epoch = try reader.take(Int(try reader.byte()))
            revision = try reader.u64()
            time = Int64(bitPattern: try reader.u64())
            (writer, leaseEnd) = format >= 2 ? try reader.writerAndLeaseEnd() : (nil, nil)
            changes = try reader.take(payload.count - reader.offset)
        }

        /// Calls `body` with each change's key, and old and new value with whether each is
        /// plain (nil: absent); returns the revision's weight (`RevisionRecord.byteSize`).
        func forEachChange(
            _ body: (UnsafeRawBufferPointer, (bytes: UnsafeRawBufferPointer, plain: Bool)?, (bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void
        ) throws(Malformed) -> Int {
            var reader = Reader(bytes: changes)
            let count = Int(try reader.u32())
            guard count <= changes.count else { throw Malformed() }
            var weight = 0
            for _ in 0..<count {
                let key = try reader.take(Int(try reader.u16()))
                let flags = try reader.byte()
                let old = flags & 1 != 0 ? (try reader.take(Int(try reader.u32())), flags & 4 != 0) : nil
                let new = flags & 2 != 0 ? (try reader.take(Int(try reader.u32())), flags & 8 != 0) : nil
                weight += key.count + (old?.0.count ?? 0) + (new?.0.count ?? 0) + 32
                body(key, old, new)
            }
            guard reader.offset == changes.count else { throw Malformed() }
            return weight
        }
    }

    /// Checks that `bytes` are changes as `encode(_:into:)` writes them — lengths that add
    /// up, keys in UTF-8 — without decoding them into objects (a snapshot's history, read at
    /// start-up and decoded one revision at a time later).
    static func checkChanges(_ bytes: UnsafeRawBufferPointer) throws(Malformed) {
        var reader = Reader(bytes: bytes)
        let count = Int(try reader.u32())
        guard count <= bytes.count else { throw Malformed() }
        for _ in 0..<count {
            let key = try reader.take(Int(try reader.u16()))
            if !Reader.isASCII(key), String(validating: key, as: UTF8.self) == nil { throw Malformed() }
            let flags = try reader.byte()
            if flags & 1 != 0 { _ = try reader.take(Int(try reader.u32())) }
            if flags & 2 != 0 { _ = try reader.take(Int(try reader.u32())) }
        }
        guard reader.offset == bytes.count else { throw Malformed() }
    }

    // MARK: Helpers

    /// The flags byte: 1 a writer follows, 2 a lease's end follows it.
    static func flags(_ record: RevisionRecord) -> UInt8 {
        (record.writer == nil ? 0 : 1) | (record.leaseEnd == nil ? 0 : 2)
    }

    /// Appends the flags byte, then the writer and the lease end it announces (the log's
    /// records and the snapshot's history revisions share this part).
    static func appendWriterAndLeaseEnd(_ writer: Writer?, _ leaseEnd: SharedLeaseEnd?, to out: inout [UInt8]) {
        out.append((writer == nil ? 0 : 1) | (leaseEnd == nil ? 0 : 2))
        if let writer {
            append(writer.uid, &out)
            append(writer.gid, &out)
            append(UInt32(bitPattern: writer.pid), &out)
        }
        if let leaseEnd {
            append(leaseEnd.lease, &out)
            out.append(LeaseRecord.code(leaseEnd.reason))
        }
    }

    private static func appendShort(_ text: String.UTF8View, _ out: inout [UInt8]) {
        // Repository names and keys are bounded by the protocol (128 and 1024 bytes).
        append(UInt16(truncatingIfNeeded: text.count), &out)
        out.append(contentsOf: text)
    }

    private static func appendValue(_ value: CanonicalJSON, _ out: inout [UInt8]) {
        append(UInt32(value.bytes.count), &out)
        out.append(contentsOf: value.bytes)
    }

    private static func append<I: FixedWidthInteger>(_ value: I, _ out: inout [UInt8]) {
        withUnsafeBytes(of: value.littleEndian) { out.append(contentsOf: $0) }
    }

    private struct Reader {
        let bytes: UnsafeRawBufferPointer
        var offset = 0

        mutating func take(_ n: Int) throws(Malformed) -> UnsafeRawBufferPointer {
            guard n >= 0, offset + n <= bytes.count else { throw Malformed() }
            defer { offset += n }
            return UnsafeRawBufferPointer(rebasing: bytes[offset..<(offset + n)])
        }

        mutating func byte() throws(Malformed) -> UInt8 { try take(1)[0] }

        /// The flags byte and the writer and lease end it announces.
        mutating func writerAndLeaseEnd() throws(Malformed) -> (Writer?, SharedLeaseEnd?) {
            let flags = try byte()
            guard flags & ~3 == 0 else { throw Malformed() }
            let writer = flags & 1 == 0 ? nil : Writer(uid: try u32(), gid: try u32(), pid: Int32(bitPattern: try u32()))
            guard flags & 2 != 0 else { return (writer, nil) }
            let lease = try u64()
            guard let reason = LeaseRecord.reason(try byte()) else { throw Malformed() }
            return (writer, SharedLeaseEnd(lease: lease, reason: reason))
        }
        mutating func u16() throws(Malformed) -> UInt16 { UInt16(littleEndian: try take(2).loadUnaligned(as: UInt16.self)) }
        mutating func u32() throws(Malformed) -> UInt32 { UInt32(littleEndian: try take(4).loadUnaligned(as: UInt32.self)) }
        mutating func u64() throws(Malformed) -> UInt64 { UInt64(littleEndian: try take(8).loadUnaligned(as: UInt64.self)) }

        mutating func string(_ n: Int) throws(Malformed) -> String {
            let bytes = try take(n)
            // Keys are mostly ASCII: checked a word at a time, they need no decoder's validation.
            if Self.isASCII(bytes) { return String(decoding: bytes, as: UTF8.self) }
            guard let s = String(validating: bytes, as: UTF8.self) else { throw Malformed() }
            return s
        }

        static func isASCII(_ bytes: UnsafeRawBufferPointer) -> Bool {
            var i = 0
            while i + 8 <= bytes.count {
                if bytes.loadUnaligned(fromByteOffset: i, as: UInt64.self) & 0x8080_8080_8080_8080 != 0 { return false }
                i += 8
            }
            while i < bytes.count {
                if bytes[i] >= 0x80 { return false }
                i += 1
            }
            return true
        }

        mutating func changes() throws(Malformed) -> [Change<CanonicalJSON>] {
            let count = Int(try u32())
            guard count <= bytes.count else { throw Malformed() }
            var changes: [Change<CanonicalJSON>] = []
            changes.reserveCapacity(count)
            for _ in 0..<count {
                let key = Key(try string(Int(try u16())))
                let flags = try byte()
                let old = flags & 1 != 0 ? try value(plain: flags & 4 != 0) : nil
                let new = flags & 2 != 0 ? try value(plain: flags & 8 != 0) : nil
                changes.append(Change(key: key, old: old, new: new))
            }
            return changes
        }

        mutating func value(plain: Bool) throws(Malformed) -> CanonicalJSON {
            let n = Int(try u32())
            return CanonicalJSON(canonical: Array(try take(n)), isPlain: plain)
        }
    }
}
