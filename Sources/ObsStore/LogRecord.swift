// ObsStore — a revision as the write-ahead log holds it: a compact binary form of the
// record and its repository's epoch (so a repository created since the last checkpoint is
// recreated with it). Little-endian:
//
//   u8 version (2) · u16 repo length, repo · u8 epoch length, epoch · u64 revision · i64 time
//   u8 has writer · [u32 uid · u32 gid · i32 pid]
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
        out.append(UInt8(truncatingIfNeeded: epoch.utf8.count))
        out.append(contentsOf: epoch.utf8.prefix(255))
        append(record.revision, &out)
        append(UInt64(bitPattern: record.time), &out)
        if let writer = record.writer {
            out.append(1)
            append(writer.uid, &out)
            append(writer.gid, &out)
            append(UInt32(bitPattern: writer.pid), &out)
        } else {
            out.append(0)
        }
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
        var writer: Writer? = nil
        if format >= 2, try reader.byte() == 1 {
            writer = Writer(uid: try reader.u32(), gid: try reader.u32(), pid: Int32(bitPattern: try reader.u32()))
        }
        let changes = try reader.changes()
        guard reader.offset == bytes.count else { throw Malformed() }
        return (RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: changes), time: time, writer: writer), epoch)
    }

    /// The changes encoded by `encode(_:into:)`, filling `bytes` exactly.
    static func decodeChanges(_ bytes: UnsafeRawBufferPointer) throws(Malformed) -> [Change<CanonicalJSON>] {
        var reader = Reader(bytes: bytes)
        let changes = try reader.changes()
        guard reader.offset == bytes.count else { throw Malformed() }
        return changes
    }

    // MARK: Helpers

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
