// ObsStore — the write-ahead log's frames: how a record is framed in a segment, and how
// replay tells a valid frame from the end of the log and from a damaged or torn one; the
// segments' headers and the frame that ends a segment; and reading a segment (mapped for
// replay, or read whole to fold into a snapshot).
//
// A frame is `u32 length · u32 CRC-32C of the payload · payload · zero padding to 8 bytes`,
// little-endian, starting on an 8-byte boundary. An all-zero frame header (length 0, CRC 0)
// is the end of the log in its segment: what the preallocated, unwritten part of a segment
// holds, and what a failed group is voided with when it cannot be cut off (WriteAheadLog).
//
// In a segment of format 2 or 3 every group begins with a group-start frame, whose
// payload is the one byte 0xFD (a record begins with its kind, 1 to 6: LogRecord.swift). Replay
// uses it to tell a torn last group from damage: a crash during a group's write (a power loss
// under `sync = always`) may leave any of its pages unwritten, so a bad frame can be followed
// by valid frames of the same group — never acknowledged, since the group's sync had not
// returned — while damage to an earlier group is followed by a later group's start. What such
// a crash leaves is zeros, not garbage — a sector the disk never got reads as the zeros the
// log wrote ahead, or as unwritten space — so a bad frame counts as torn only if one of its
// 512-byte sectors is all zeros (etcd's write-ahead log judges torn entries the same way); a
// byte flipped anywhere is damage. Format 1 segments (obsd before group starts) have no group
// starts, and are read as before.
//
// A segment's header: format 3 (`OBSDWAL3`, 32 bytes) is `magic · u64 base position · u64
// reserved · u32 CRC-32C of the 24 bytes before · u32 zero`, where `reserved` is the size the
// segment was preallocated to — the file is never shorter while its header says so (0: no
// such promise); formats 1 and 2 (`OBSDWAL1`, `OBSDWAL2`) are `magic · u64 base`, 16 bytes.
// When the log rolls over to a new segment, the segment it leaves gets, right after its log,
// an end-of-segment frame: payload 0xFE then the u64 base of the next segment. It is no part
// of the log (no position counts it): it says the log goes on, so that the next segment,
// removed, is missed.

import SystemPackage

extension WriteAheadLog {
    /// The size of a frame's header (length and checksum).
    static let frameHeaderSize = 8

    /// Encodes one frame around `payload` (see the header).
    static func frame(_ payload: UnsafeRawBufferPointer, into group: inout [UInt8]) {
        let crc = CRC32C.checksum(payload)
        withUnsafeBytes(of: UInt32(payload.count).littleEndian) { group.append(contentsOf: $0) }
        withUnsafeBytes(of: crc.littleEndian) { group.append(contentsOf: $0) }
        group.append(contentsOf: payload)
        let padding = (8 - payload.count % 8) % 8
        if padding > 0 { group.append(contentsOf: repeatElement(0, count: padding)) }
    }

    enum Frame {
        case end
        case frame(payload: Range<Int>, next: Int)
        case bad
    }

    /// The frame at `at`: a valid one, the end of the log in this segment (an all-zero frame
    /// header, or zeros to the end of the file), or one that fails its checks. Without
    /// `verify`, only its length is checked (frames a snapshot already covers are walked,
    /// not read).
    static func frame(in bytes: UnsafeRawBufferPointer, at: Int, verify: Bool = true) -> Frame {
        guard at + frameHeaderSize <= bytes.count else {
            // At or past the end: a file cut inside the padding of the frame before leaves the
            // next frame's place past it (a cut format 3 segment is then refused as shorter
            // than its preallocation; under repair, the log ends there).
            return at >= bytes.count || bytes[at...].allSatisfy { $0 == 0 } ? .end : .bad
        }
        let length = Int(UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: at, as: UInt32.self)))
        let crc = UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: at + 4, as: UInt32.self))
        if length == 0 { return crc == 0 ? .end : .bad }
        let payload = (at + frameHeaderSize)..<(at + frameHeaderSize + length)
        guard payload.upperBound <= bytes.count else { return .bad }
        if verify {
            guard CRC32C.checksum(UnsafeRawBufferPointer(rebasing: bytes[payload])) == crc else { return .bad }
        }
        return .frame(payload: payload, next: (payload.upperBound + 7) & ~7)
    }

    /// The payload of a group-start frame (see the header).
    static let groupStartByte: UInt8 = 0xFD

    /// Begins a group: appends its group-start frame to `group`, before its records.
    static func startGroup(into group: inout [UInt8]) {
        withUnsafeBytes(of: groupStartByte) { frame($0, into: &group) }
    }

    /// Whether `group` begins with a group-start frame.
    static func startsGroup(_ group: UnsafeRawBufferPointer) -> Bool {
        guard case .frame(let payload, _) = frame(in: group, at: 0) else { return false }
        return isGroupStart(UnsafeRawBufferPointer(rebasing: group[payload]))
    }

    /// Whether `payload` is a group-start frame's (not a record's).
    static func isGroupStart(_ payload: UnsafeRawBufferPointer) -> Bool {
        payload.count == 1 && payload[0] == groupStartByte
    }

    /// Whether a valid group-start frame begins anywhere after a bad frame: a group was written
    /// after the one the bad frame is in.
    static func anyGroupStart(in bytes: UnsafeRawBufferPointer, after at: Int) -> Bool {
        var candidate = (at + 8) & ~7
        while candidate + frameHeaderSize <= bytes.count {
            if case .frame(let payload, _) = frame(in: bytes, at: candidate), isGroupStart(UnsafeRawBufferPointer(rebasing: bytes[payload])) {
                return true
            }
            candidate += 8
        }
        return false
    }

    /// The payload's first byte of the frame that ends a segment (see the header).
    static let segmentEndByte: UInt8 = 0xFE

    /// The frame that ends a segment whose log goes on in the segment starting at `next`.
    static func segmentEnd(next: UInt64) -> [UInt8] {
        var payload = [segmentEndByte]
        withUnsafeBytes(of: next.littleEndian) { payload.append(contentsOf: $0) }
        var out: [UInt8] = []
        payload.withUnsafeBytes { frame($0, into: &out) }
        return out
    }

    /// Where the log goes on, if `payload` is an end-of-segment frame's.
    static func segmentEndTarget(_ payload: UnsafeRawBufferPointer) -> UInt64? {
        guard payload.count == 9, payload[0] == segmentEndByte else { return nil }
        return UInt64(littleEndian: payload.loadUnaligned(fromByteOffset: 1, as: UInt64.self))
    }

    /// The header of a format 3 segment starting at `base`, preallocated to `reserved` bytes
    /// (0: no promise).
    static func header(base: UInt64, reserved: UInt64) -> [UInt8] {
        var header = magic
        withUnsafeBytes(of: base.littleEndian) { header.append(contentsOf: $0) }
        withUnsafeBytes(of: reserved.littleEndian) { header.append(contentsOf: $0) }
        let crc = header.withUnsafeBytes { CRC32C.checksum($0) }
        withUnsafeBytes(of: crc.littleEndian) { header.append(contentsOf: $0) }
        header.append(contentsOf: [0, 0, 0, 0])
        return header
    }

    /// The size a format 3 header says its segment was preallocated to (0: none said).
    static func reserved(in header: some Collection<UInt8>) -> UInt64 {
        let bytes = Array(header.prefix(24))
        guard bytes.count == 24 else { return 0 }
        return bytes.withUnsafeBytes { UInt64(littleEndian: $0.loadUnaligned(fromByteOffset: 16, as: UInt64.self)) }
    }

    /// Rewrites the reserved size in a format 3 header (and its checksum).
    static func setReserved(_ reserved: UInt64, in header: inout [UInt8]) {
        let base = header.withUnsafeBytes { UInt64(littleEndian: $0.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) }
        header.replaceSubrange(0..<min(header.count, headerSize), with: Self.header(base: base, reserved: reserved))
    }

    /// The unit a disk writes whole or not at all, at the least.
    static let sectorSize = 512

    /// Whether the bad frame at `at` lost a sector: its length is sane (it ends before the next
    /// valid frame) and a whole sector that begins inside it, before that frame, is all zeros —
    /// what a write a crash cut short leaves. (The sector may reach past the frame: it held
    /// the frames after it too.)
    static func hasLostSector(in bytes: UnsafeRawBufferPointer, frameAt at: Int) -> Bool {
        guard at + frameHeaderSize <= bytes.count else { return false }
        var next = (at + 8) & ~7  // the next valid frame
        while next + frameHeaderSize <= bytes.count {
            if case .frame = frame(in: bytes, at: next) { break }
            next += 8
        }
        let length = Int(UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: at, as: UInt32.self)))
        let end = at + frameHeaderSize + length
        guard length > 0, end <= next else { return false }
        var sector = (at / sectorSize + 1) * sectorSize  // the first sector boundary inside it
        while sector < end, sector + sectorSize <= next {
            if bytes[sector..<(sector + sectorSize)].allSatisfy({ $0 == 0 }) { return true }
            sector += sectorSize
        }
        return false
    }

    /// Whether a valid frame starts anywhere after a bad one (frames start on 8-byte boundaries).
    static func anyValidFrame(in bytes: UnsafeRawBufferPointer, after at: Int) -> Bool {
        var candidate = (at + 8) & ~7
        while candidate + frameHeaderSize <= bytes.count {
            if case .frame = frame(in: bytes, at: candidate) { return true }
            candidate += 8
        }
        return false
    }

    /// The bytes from `at` to the last non-zero byte: what a torn write, or a voided group
    /// behind its zeroed header, left.
    static func usedBytes(in bytes: UnsafeRawBufferPointer, from at: Int) -> Int {
        guard at < bytes.count else { return 0 }
        var last = bytes.count
        // A preallocated segment ends in megabytes of zeros: skip them a word at a time.
        while last - 8 >= at, bytes.loadUnaligned(fromByteOffset: last - 8, as: UInt64.self) == 0 { last -= 8 }
        while last > at, bytes[last - 1] == 0 { last -= 1 }
        return last - at
    }

    /// A segment file mapped read-only (replay reads it in place), up to where the file
    /// system says its data ends when nothing follows that but unwritten space: a
    /// preallocated segment's megabytes of zeros are neither read nor faulted in. It must not
    /// be read past a point the file is cut back to.
    final class Mapped {
        let bytes: UnsafeRawBufferPointer
        /// The file's size (what is mapped may end before it, at unwritten space).
        let fileSize: Int

        init(_ path: String) throws(StorageError) {
            let file = try FileDescriptor.opening(path)
            defer { try? file.close() }
            fileSize = try attempt("cannot stat \(path)") { () throws(Errno) in try file.size() }
            // Up to the first hole (unwritten, preallocated space reads as one), if no data follows it.
            let size = file.endOfData(size: fileSize)
            guard size > 0 else {
                bytes = UnsafeRawBufferPointer(start: nil, count: 0)
                return
            }
            bytes = try attempt("cannot map \(path)") { () throws(Errno) in try file.map(count: size) }
        }

        deinit { FileDescriptor.unmap(bytes) }
    }

    /// The whole file at `path`, or its first `limit` bytes.
    static func read(_ path: String, limit: Int = .max) throws(StorageError) -> [UInt8] {
        let file = try FileDescriptor.opening(path)
        defer { try? file.close() }
        return try file.contents(of: path, limit: limit)
    }
}

extension WriteAheadLog.Directory {
    /// Calls `body` with the payload and end position of every frame that ends after `after`
    /// and at or before `through`, in order — the frames a snapshot covering `through` adds
    /// to one covering `after`. Reads each segment only as far as `through`; the committer
    /// may append beyond it meanwhile. Throws when a frame in that range is damaged, or the
    /// log does not reach `through`.
    func forEachFrame(
        after: UInt64, through: UInt64, _ body: (UnsafeRawBufferPointer, UInt64) throws(StorageError) -> Void
    ) throws(StorageError) {
        guard through > after else { return }
        let bases = try segments()
        var reached = after
        for (i, base) in bases.enumerated() where base < through && (i + 1 == bases.count || bases[i + 1] > after) {
            let path = file(base)
            let bytes = try WriteAheadLog.read(path, limit: Int(through - base))
            guard let format = WriteAheadLog.formatNamed(by: bytes), bytes.count >= WriteAheadLog.headerSize(format: format) else {
                throw StorageError(.corrupt, "\(path) is not an obsd write-ahead log segment (bad header)")
            }
            /// Where the next segment starts, if there is one: this one's log ends there.
            let nextBase = i + 1 < bases.count ? bases[i + 1] : nil
            try bytes.withUnsafeBytes { raw in
                Result { () throws(StorageError) in
                    var at = WriteAheadLog.headerSize(format: format)
                    // The position after a segment's header holds nothing more than the one
                    // where the log before it ends: once that is reached, so is this one (a
                    // new segment with no frame yet).
                    let first = base + UInt64(at)
                    if first > after, first <= through, reached >= base { reached = first }
                    scan: while true {
                        switch WriteAheadLog.frame(in: raw, at: at) {
                        case .end:
                            break scan
                        case .frame(let payload, let next):
                            let bytes = UnsafeRawBufferPointer(rebasing: raw[payload])
                            if WriteAheadLog.segmentEndTarget(bytes) != nil { break scan }  // the log goes on in the next segment
                            let position = base + UInt64(next)
                            if position > through { break scan }
                            if position > after {
                                if !WriteAheadLog.isGroupStart(bytes) { try body(bytes, position) }
                                reached = position
                            }
                            at = next
                        case .bad:
                            // Only a frame cut at `through` (read no further) may look bad here,
                            // or an end-of-segment frame a crash tore, where the next segment starts.
                            if base + UInt64(at) >= through || nextBase == base + UInt64(at) { break scan }
                            throw StorageError(.corrupt, "\(path): damaged record at offset \(at)")
                        }
                    }
                }
            }.get()
        }
        guard reached == through else {
            throw StorageError(.corrupt, "\(self.path): the write-ahead log ends at position \(reached), before \(through), which it reached when written")
        }
    }
}

extension FileDescriptor {
    /// The file at `path` opened to read; the error names it ("cannot open <path>").
    static func opening(_ path: String) throws(StorageError) -> FileDescriptor {
        try attempt("cannot open \(path)") { () throws(Errno) in try FilePath(path).open(.readOnly) }
    }

    /// The whole file (this descriptor's, at `path`), or its first `limit` bytes; the error
    /// names the file and what failed (its stat, or a read: EIO when it ends before its size).
    func contents(of path: String, limit: Int = .max) throws(StorageError) -> [UInt8] {
        let size = try attempt("cannot stat \(path)") { () throws(Errno) in try self.size() }
        return try attempt("cannot read \(path)") { () throws(Errno) in try read(count: min(size, limit)) }
    }
}
