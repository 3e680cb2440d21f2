// ObsStore — a frame of the write-ahead log (WriteAheadLog+Frames.swift) written in place: the
// payload `LogRecord` describes, framed, straight into the group's buffer with no buffer in
// between — from values, or from one change given as the bytes where they lie (the daemon's
// single-key writes, encoded as they are queued, with no record object or value copied out).

import ObsValues
import ObservableKit

extension LogRecord {
    /// A frame's header: u32 length · u32 CRC-32C of the payload (WriteAheadLog.frameHeaderSize).
    static let frameHeader = 8

    /// Appends the frame of `frame` to `group`.
    static func appendFrame(_ frame: LogFrame, to group: inout [UInt8]) {
        switch frame {
        case .revision(let revision):
            appendFrame(size: revisionSize(revision), to: &group) { w in writeRevision(revision, &w) }
        case .attachments(let repo, let revision, let moves):
            let size = 1 + 2 + repo.utf8.count + 8 + movesSize(moves)
            appendFrame(size: size, to: &group) { w in
                w.put(Kind.attachments.rawValue)
                w.putText(repo, lengthBytes: 2, limit: .max)
                w.put(revision)
                w.putMoves(moves)
            }
        case .leaseGranted(let lease):
            appendFrame(size: 1 + 8 + 12 + 8, to: &group) { w in
                w.put(Kind.leaseGranted.rawValue)
                w.put(lease.id)
                w.putWriter(lease.owner)
                w.put(UInt64(bitPattern: lease.ttl ?? 0))
            }
        case .leaseEnded(let id, let reason, let owner):
            appendFrame(size: 1 + 8 + 1 + 12, to: &group) { w in
                w.put(Kind.leaseEnded.rawValue)
                w.put(id)
                w.put(LeaseJournalRecord.code(reason))
                w.putWriter(owner)
            }
        }
    }

    private static func revisionSize(_ r: RevisionFrame) -> Int {
        var size = 1 + 2 + r.repo.utf8.count + 1 + min(r.epoch.utf8.count, 255) + 8 + 8 + 1 + (r.writer == nil ? 0 : 12) + (r.leaseEnd == nil ? 0 : 9)
        if !r.moves.isEmpty { size += movesSize(r.moves) }
        size += 4
        r.changes.forEach { key, old, new in size += 2 + key.count + 1 + (old.map { 4 + $0.bytes.count } ?? 0) + (new.map { 4 + $0.bytes.count } ?? 0) }
        return size
    }

    private static func movesSize(_ moves: [AttachmentMove]) -> Int {
        moves.reduce(4) { $0 + 2 + $1.key.utf8Count + 8 }
    }

    private static func writeRevision(_ r: RevisionFrame, _ w: inout FrameWriter) {
        w.put(Kind.revision.rawValue)
        w.putText(r.repo, lengthBytes: 2, limit: .max)
        w.putText(r.epoch, lengthBytes: 1, limit: 255)  // epochs are at most 64 bytes (Epoch.isValid)
        w.put(r.revision)
        w.put(UInt64(bitPattern: r.time))
        w.put((r.writer == nil ? 0 : 1) | (r.leaseEnd == nil ? 0 : 2) | (r.moves.isEmpty ? 0 : 4) as UInt8)
        if let writer = r.writer { w.putWriter(writer) }
        if let leaseEnd = r.leaseEnd {
            w.put(leaseEnd.lease)
            w.put(LeaseJournalRecord.code(leaseEnd.reason))
        }
        if !r.moves.isEmpty { w.putMoves(r.moves) }
        w.put(UInt32(r.changes.count))
        r.changes.forEach { key, old, new in
            w.put(UInt16(truncatingIfNeeded: key.count))
            w.put(key)
            var flags: UInt8 = 0
            if let old { flags |= 1 | (old.plain ? 4 : 0) }
            if let new { flags |= 2 | (new.plain ? 8 : 0) }
            w.put(flags)
            if let old {
                w.put(UInt32(old.bytes.count))
                w.put(old.bytes)
            }
            if let new {
                w.put(UInt32(new.bytes.count))
                w.put(new.bytes)
            }
        }
    }

    /// Appends a frame of a `size`-byte payload that `write` writes, padded to 8 bytes.
    private static func appendFrame(size: Int, to group: inout [UInt8], _ write: (inout FrameWriter) -> Void) {
        let frame = (frameHeader + size + 7) & ~7
        let start = group.count
        group.append(contentsOf: repeatElement(0, count: frame))
        group.withUnsafeMutableBytes { raw in
            let header = raw.baseAddress! + start
            var writer = FrameWriter(base: header + frameHeader)
            write(&writer)
            assert(writer.at == size, "a log record's size was miscounted")
            let payload = UnsafeRawBufferPointer(start: header + frameHeader, count: size)
            header.storeBytes(of: UInt32(size).littleEndian, as: UInt32.self)
            header.storeBytes(of: CRC32C.checksum(payload).littleEndian, toByteOffset: 4, as: UInt32.self)
        }
    }

    /// Writes a payload's fields in place.
    private struct FrameWriter {
        let base: UnsafeMutableRawPointer
        var at = 0

        mutating func put<I: FixedWidthInteger>(_ value: I) {
            (base + at).storeBytes(of: value.littleEndian, as: I.self)
            at += MemoryLayout<I>.size
        }

        mutating func put(_ bytes: UnsafeRawBufferPointer) {
            if let source = bytes.baseAddress, bytes.count > 0 { (base + at).copyMemory(from: source, byteCount: bytes.count) }
            at += bytes.count
        }

        mutating func putText(_ text: String, lengthBytes: Int, limit: Int) {
            var text = text
            text.withUTF8 { utf8 in
                let n = min(utf8.count, limit)
                if lengthBytes == 1 { put(UInt8(truncatingIfNeeded: n)) } else { put(UInt16(truncatingIfNeeded: n)) }
                put(UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(utf8)[..<n]))
            }
        }

        mutating func putWriter(_ writer: Writer) {
            put(writer.uid)
            put(writer.gid)
            put(UInt32(bitPattern: writer.pid))
        }

        mutating func putMoves(_ moves: [AttachmentMove]) {
            put(UInt32(moves.count))
            for move in moves {
                putText(move.key.string, lengthBytes: 2, limit: .max)
                put(move.to ?? 0)
            }
        }
    }
}
