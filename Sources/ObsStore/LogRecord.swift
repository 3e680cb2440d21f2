// ObsStore — what the write-ahead log's frames hold (LogFrame.swift): a compact binary form
// of each. Little-endian; the first byte says which it is:
//
//   3 revision    u16 repo length, repo · u8 epoch length, epoch · u64 revision · i64 time ·
//                 u8 flags (1 writer, 2 lease end, 4 moves) · [u32 uid · u32 gid · i32 pid] ·
//                 [u64 lease · u8 end] · [moves] · changes
//   4 attachments u16 repo length, repo · u64 the repository's revision (unchanged) · moves
//   5 granted     u64 lease · u32 uid · u32 gid · i32 pid · i64 ttl (0: bound to its connection)
//   6 ended       u64 lease · u8 reason (1 expired, 2 revoked, 3 closed) · u32 uid · u32 gid · i32 pid
//
//   moves:   u32 count · per key: u16 key length, key · u64 the lease it is attached to after (0: none)
//   changes: u32 count · per change: u16 key length, key · u8 flags (1 old, 2 new, 4 old plain,
//            8 new plain) · [u32 length, old bytes] · [u32 length, new bytes]
//
// A revision's epoch lets a repository created since the last checkpoint be recreated with
// it; its moves are the lease attachments its write changed (a `set` attaches its key to the
// lease it names, or to none; a `delete`, or a lease's end, detaches), kept in the same frame
// so the one is durable exactly when the other is. Revisions of versions 1 and 2 (obsd before
// leases rode in the log, when a journal beside it held them) are still read: version 1 has
// no writer field, neither has moves.
//
// The log itself reserves two first bytes for its own frames: 0xFD (a group's start) and
// 0xFE (a segment's end) — WriteAheadLog+Frames.swift.
//
// Values are written canonical and read back as they were written: the log's checksum,
// not a second validation, vouches for them.

import ObsValues
import ObservableKit

enum LogRecord {
    /// The first byte of a payload.
    enum Kind: UInt8 {
        case legacyRevision1 = 1, legacyRevision2, revision, attachments, leaseGranted, leaseEnded
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

    /// The changes encoded by `encode(_:into:)`, filling `bytes` exactly.
    static func decodeChanges(_ bytes: UnsafeRawBufferPointer) throws(Malformed) -> [Change<CanonicalJSON>] {
        var reader = Reader(bytes: bytes)
        let changes = try reader.changes()
        guard reader.offset == bytes.count else { throw Malformed() }
        return changes
    }

    /// A frame's payload, read in place.
    enum Entry {
        case revision(View)
        case attachments(repo: UnsafeRawBufferPointer, revision: UInt64, moves: Moves)
        case leaseGranted(PersistedLeases.Lease)
        case leaseEnded(id: UInt64, reason: LeaseEnd.Reason, owner: Writer)

        init(_ payload: UnsafeRawBufferPointer) throws(Malformed) {
            guard let first = payload.first, let kind = Kind(rawValue: first) else { throw Malformed() }
            var reader = Reader(bytes: payload)
            reader.offset = 1
            switch kind {
            case .legacyRevision1, .legacyRevision2, .revision:
                self = .revision(try View(payload))
            case .attachments:
                let repo = try reader.take(Int(try reader.u16()))
                let revision = try reader.u64()
                let moves = try Moves(try reader.take(payload.count - reader.offset))
                self = .attachments(repo: repo, revision: revision, moves: moves)
            case .leaseGranted:
                let id = try reader.u64()
                let owner = try reader.writer()
                let ttl = Int64(bitPattern: try reader.u64())
                guard reader.offset == payload.count, id > 0, ttl >= 0 else { throw Malformed() }
                self = .leaseGranted(PersistedLeases.Lease(id: id, owner: owner, ttl: ttl == 0 ? nil : ttl))
            case .leaseEnded:
                let id = try reader.u64()
                guard let reason = LeaseJournalRecord.reason(try reader.byte()) else { throw Malformed() }
                let owner = try reader.writer()
                guard reader.offset == payload.count, id > 0 else { throw Malformed() }
                self = .leaseEnded(id: id, reason: reason, owner: owner)
            }
        }
    }

    /// Attachment moves read in place (`moves` above).
    struct Moves {
        let bytes: UnsafeRawBufferPointer
        let count: Int

        static var none: Moves { Moves(bytes: UnsafeRawBufferPointer(start: nil, count: 0), count: 0) }

        private init(bytes: UnsafeRawBufferPointer, count: Int) {
            self.bytes = bytes
            self.count = count
        }

        /// Checks `bytes` are moves whole.
        init(_ bytes: UnsafeRawBufferPointer) throws(Malformed) {
            var reader = Reader(bytes: bytes)
            let count = Int(try reader.u32())
            guard count <= bytes.count else { throw Malformed() }
            for _ in 0..<count {
                let key = try reader.take(Int(try reader.u16()))
                if !Reader.isASCII(key), String(validating: key, as: UTF8.self) == nil { throw Malformed() }
                _ = try reader.u64()
            }
            guard reader.offset == bytes.count else { throw Malformed() }
            self.bytes = bytes
            self.count = count
        }

        /// Calls `body` with each key's bytes and the lease it is attached to after (nil: none).
        func forEach(_ body: (UnsafeRawBufferPointer, UInt64?) -> Void) {
            guard count > 0 else { return }
            var at = 4
            for _ in 0..<count {
                let n = Int(UInt16(littleEndian: bytes.loadUnaligned(fromByteOffset: at, as: UInt16.self)))
                let key = UnsafeRawBufferPointer(rebasing: bytes[(at + 2)..<(at + 2 + n)])
                let lease = UInt64(littleEndian: bytes.loadUnaligned(fromByteOffset: at + 2 + n, as: UInt64.self))
                body(key, lease == 0 ? nil : lease)
                at += 2 + n + 8
            }
        }

        /// Applies the moves to `attachments`.
        func apply(to attachments: inout [Key: UInt64]) {
            forEach { key, lease in attachments[Key(String(decoding: key, as: UTF8.self))] = lease }
        }
    }

    /// A revision read in place, nothing decoded into objects: what the checkpointer folds
    /// into a snapshot and start-up replays.
    struct View {
        let repo: UnsafeRawBufferPointer
        let epoch: UnsafeRawBufferPointer
        let revision: UInt64
        let time: Int64
        let writer: Writer?
        let leaseEnd: LeaseEnd?
        /// The attachments its write moved (none before version 3).
        let moves: Moves
        /// The changes' encoding (`u32 count` and the changes), as a snapshot's history keeps it.
        let changes: UnsafeRawBufferPointer

        init(_ payload: UnsafeRawBufferPointer) throws(Malformed) {
            var reader = Reader(bytes: payload)
            guard let kind = Kind(rawValue: try reader.byte()), kind.rawValue <= Kind.revision.rawValue else { throw Malformed() }
            repo = try reader.take(Int(try reader.u16()))
            epoch = try reader.take(Int(try reader.byte()))
            revision = try reader.u64()
            time = Int64(bitPattern: try reader.u64())
            switch kind {
            case .legacyRevision1:
                (writer, leaseEnd, moves) = (nil, nil, .none)
            case .legacyRevision2:
                (writer, leaseEnd) = try reader.writerAndLeaseEnd(allowing: 3)
                moves = .none
            default:
                let flags = payload[reader.offset]
                (writer, leaseEnd) = try reader.writerAndLeaseEnd(allowing: 7)
                if flags & 4 != 0 {
                    let start = reader.offset
                    let count = Int(try reader.u32())
                    guard count <= payload.count else { throw Malformed() }
                    for _ in 0..<count {
                        _ = try reader.take(Int(try reader.u16()))
                        _ = try reader.u64()
                    }
                    moves = try Moves(UnsafeRawBufferPointer(rebasing: payload[start..<reader.offset]))
                } else {
                    moves = .none
                }
            }
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

        /// The revision as a record (its changes decoded into values).
        func record() throws(Malformed) -> RevisionRecord {
            RevisionRecord(
                repo: String(decoding: repo, as: UTF8.self), changeSet: ChangeSet(revision: revision, changes: try decodeChanges(changes)), time: time,
                writer: writer, leaseEnd: leaseEnd)
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
    static func appendWriterAndLeaseEnd(_ writer: Writer?, _ leaseEnd: LeaseEnd?, to out: inout [UInt8]) {
        out.append((writer == nil ? 0 : 1) | (leaseEnd == nil ? 0 : 2))
        if let writer {
            append(writer.uid, &out)
            append(writer.gid, &out)
            append(UInt32(bitPattern: writer.pid), &out)
        }
        if let leaseEnd {
            append(leaseEnd.lease, &out)
            out.append(LeaseJournalRecord.code(leaseEnd.reason))
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

        /// The flags byte (no bit outside `allowing`) and the writer and lease end it announces.
        mutating func writerAndLeaseEnd(allowing mask: UInt8 = 3) throws(Malformed) -> (Writer?, LeaseEnd?) {
            let flags = try byte()
            guard flags & ~mask == 0 else { throw Malformed() }
            let writer = flags & 1 == 0 ? nil : try self.writer()
            guard flags & 2 != 0 else { return (writer, nil) }
            let lease = try u64()
            guard let reason = LeaseJournalRecord.reason(try byte()) else { throw Malformed() }
            return (writer, LeaseEnd(lease: lease, reason: reason))
        }
        mutating func writer() throws(Malformed) -> Writer {
            Writer(uid: try u32(), gid: try u32(), pid: Int32(bitPattern: try u32()))
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
