// ObsStore — a revision's frame in the write-ahead log (WriteAheadLog+Frames.swift), written in
// place: the same bytes as `LogRecord.encode` then `WriteAheadLog.frame`, with no buffer in
// between — from a `RevisionRecord`, or from one change given as bytes where they lie
// (`SingleRevision`: the daemon's single-key writes, encoded as they are queued, with no
// record object or value copied out for it).

import ObsValues
import ObservableKit

/// The changes of a revision as a frame is written from them.
protocol LogChanges {
    var count: Int { get }
    /// Calls `body` with each change's key, and old and new value with whether each is plain
    /// (nil: absent), in order.
    func forEach(_ body: (UnsafeRawBufferPointer, (bytes: UnsafeRawBufferPointer, plain: Bool)?, (bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void)
}

extension Array: LogChanges where Element == Change<CanonicalJSON> {
    func forEach(_ body: (UnsafeRawBufferPointer, (bytes: UnsafeRawBufferPointer, plain: Bool)?, (bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void) {
        func withBytes(_ value: CanonicalJSON?, _ body: ((bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void) {
            guard let value else { return body(nil) }
            value.bytes.withUnsafeBytes { body(($0, value.isPlain)) }
        }
        for change in self {
            change.key.withUTF8 { key in
                withBytes(change.old) { old in withBytes(change.new) { new in body(UnsafeRawBufferPointer(key), old, new) } }
            }
        }
    }
}

extension SingleRevision: LogChanges {
    var count: Int { 1 }

    func forEach(_ body: (UnsafeRawBufferPointer, (bytes: UnsafeRawBufferPointer, plain: Bool)?, (bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void) {
        body(key, old.map { ($0, oldIsPlain) }, new.map { ($0, newIsPlain) })
    }
}

extension LogRecord {
    /// Appends the frame of `record`'s encoding to `group` (the committer's path for what is
    /// queued as a record).
    static func appendFrame(_ record: RevisionRecord, epoch: String, to group: inout [UInt8]) {
        appendFrame(
            repo: record.repo, epoch: epoch, revision: record.revision, time: record.time, writer: record.writer, leaseEnd: record.leaseEnd,
            changes: record.changes, to: &group)
    }

    /// Appends the frame of a revision of `repo` (in history `epoch`) with `changes` to `group`.
    static func appendFrame(
        repo: String, epoch: String, revision: UInt64, time: Int64, writer: Writer?, leaseEnd: SharedLeaseEnd?, changes: some LogChanges,
        to group: inout [UInt8]
    ) {
        var size = 1 + 2 + repo.utf8.count + 1 + min(epoch.utf8.count, 255) + 8 + 8 + 1 + (writer == nil ? 0 : 12) + (leaseEnd == nil ? 0 : 9) + 4
        changes.forEach { key, old, new in size += 2 + key.count + 1 + (old.map { 4 + $0.bytes.count } ?? 0) + (new.map { 4 + $0.bytes.count } ?? 0) }
        let frame = (WriteAheadLog.frameHeaderSize + size + 7) & ~7
        let start = group.count
        group.append(contentsOf: repeatElement(0, count: frame))
        group.withUnsafeMutableBytes { raw in
            let base = raw.baseAddress! + start + WriteAheadLog.frameHeaderSize
            var at = 0
            func put<I: FixedWidthInteger>(_ value: I) {
                (base + at).storeBytes(of: value.littleEndian, as: I.self)
                at += MemoryLayout<I>.size
            }
            func put(_ bytes: UnsafeRawBufferPointer) {
                if let source = bytes.baseAddress, bytes.count > 0 { (base + at).copyMemory(from: source, byteCount: bytes.count) }
                at += bytes.count
            }
            func putText(_ text: String, lengthBytes: Int, limit: Int) {
                func write(_ utf8: UnsafeBufferPointer<UInt8>) {
                    let n = min(utf8.count, limit)
                    if lengthBytes == 1 { put(UInt8(truncatingIfNeeded: n)) } else { put(UInt16(truncatingIfNeeded: n)) }
                    put(UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(utf8)[..<n]))
                }
                if text.utf8.withContiguousStorageIfAvailable(write) == nil { Array(text.utf8).withUnsafeBufferPointer(write) }
            }
            put(version)
            putText(repo, lengthBytes: 2, limit: .max)
            putText(epoch, lengthBytes: 1, limit: 255)
            put(revision)
            put(UInt64(bitPattern: time))
            put((writer == nil ? 0 : 1) | (leaseEnd == nil ? 0 : 2) as UInt8)
            if let writer {
                put(writer.uid)
                put(writer.gid)
                put(UInt32(bitPattern: writer.pid))
            }
            if let leaseEnd {
                put(leaseEnd.lease)
                put(LeaseRecord.code(leaseEnd.reason))
            }
            put(UInt32(changes.count))
            changes.forEach { key, old, new in
                put(UInt16(truncatingIfNeeded: key.count))
                put(key)
                var flags: UInt8 = 0
                if let old { flags |= 1 | (old.plain ? 4 : 0) }
                if let new { flags |= 2 | (new.plain ? 8 : 0) }
                put(flags)
                if let old {
                    put(UInt32(old.bytes.count))
                    put(old.bytes)
                }
                if let new {
                    put(UInt32(new.bytes.count))
                    put(new.bytes)
                }
            }
            assert(at == size, "a log record's size was miscounted")
            let payload = UnsafeRawBufferPointer(start: base, count: size)
            let header = raw.baseAddress! + start
            header.storeBytes(of: UInt32(size).littleEndian, as: UInt32.self)
            header.storeBytes(of: CRC32C.checksum(payload).littleEndian, toByteOffset: 4, as: UInt32.self)
        }
    }
}
