// ObsStore — the write-ahead log: where a write becomes durable before it is acknowledged.
//
// Append-only segment files `wal/<base position, 16 hex digits>.wal`, preallocated, each a
// 16-byte header (`OBSDWAL1` + its base position) and then frames: `u32 length · u32
// CRC-32C of the payload · payload · zero padding to 8 bytes`. A position (log sequence
// number) is a byte offset in the log as if its segments were one file; a frame's
// position is where it ends. A group of frames is written with one `pwrite` at the end of
// the log and, under `sync = always`, made durable with one `fdatasync` — group commit.
//
// Replay reads every frame after a position. A frame that fails its length or checksum
// check at the end of the last segment, with no valid frame after it, is the torn tail of
// a write a crash interrupted: it is cut off and reported. Anywhere else it is damage, and
// replay refuses with the file and offset. Segments wholly before the checkpoint of the
// compacted state are deleted.

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

final class WriteAheadLog {
    static let magic: [UInt8] = Array("OBSDWAL1".utf8)
    static let headerSize = 16

    /// The log's directory: its segment files, listed and deleted from any thread.
    struct Directory: Sendable {
        let path: String

        /// The file of the segment that starts at `base`.
        func file(_ base: UInt64) -> String {
            let hex = String(base, radix: 16)
            return path + "/" + String(repeating: "0", count: max(0, 16 - hex.count)) + hex + ".wal"
        }

        /// The segments' base positions, ascending.
        func segments() throws(StorageError) -> [UInt64] {
            guard let dir = opendir(path) else { throw StorageError.from(errno, "cannot read \(path)") }
            defer { closedir(dir) }
            var bases: [UInt64] = []
            while let entry = readdir(dir) {
                let name = withUnsafeBytes(of: entry.pointee.d_name) { raw in
                    String(decoding: raw.prefix(while: { $0 != 0 }), as: UTF8.self)
                }
                guard name.hasSuffix(".wal"), name.utf8.count == 20, let base = UInt64(name.prefix(16), radix: 16) else { continue }
                bases.append(base)
            }
            return bases.sorted()
        }

        /// Deletes the segments that lie wholly at or before `checkpoint` (applied to the
        /// compacted state, which is durable): those followed by a segment that starts at
        /// or before it. Never the last one, which the committer appends to.
        func removeSegments(through checkpoint: UInt64) {
            guard let segments = try? segments() else { return }
            for (i, segment) in segments.enumerated() where i + 1 < segments.count && segments[i + 1] <= checkpoint {
                unlink(file(segment))
            }
        }
    }

    let directory: Directory
    let segmentSize: Int
    /// The current (last) segment.
    private var fd: Int32 = -1
    private var base: UInt64 = 0
    /// Where the next frame goes, within the current segment.
    private var offset = 0
    /// Segments whose directory entry is not yet durable (fsync of the directory pending).
    private var newSegment = false

    /// What replay found.
    struct Replay {
        /// Bytes of a torn write cut off the end, and where.
        var tornBytes = 0
        var tornAt: String? = nil
        var records = 0
    }

    init(directory: String, segmentSize: Int = 64 << 20) {
        self.directory = Directory(path: directory)
        self.segmentSize = segmentSize
    }

    deinit { if fd >= 0 { close(fd) } }

    // MARK: Opening and replay

    /// Opens the log (creating it), calls `body` with every frame's payload and end position
    /// after `checkpoint`, in order, and leaves the log ready to append after the last one.
    func open(after checkpoint: UInt64, _ body: (UnsafeRawBufferPointer, UInt64) throws(StorageError) -> Void) throws(StorageError) -> Replay {
        if mkdir(directory.path, 0o700) != 0 && errno != EEXIST {
            throw StorageError.from(errno, "cannot create \(directory.path)")
        }
        var replay = Replay()
        /// Where the last valid frame of the log ends.
        var logEnd: UInt64 = 0
        let segments = try directory.segments()
        for (i, segment) in segments.enumerated() {
            let last = i == segments.count - 1
            let path = directory.file(segment)
            let bytes = try read(path)
            guard bytes.count >= Self.headerSize, Array(bytes[0..<8]) == Self.magic,
                bytes.withUnsafeBytes({ UInt64(littleEndian: $0.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) }) == segment
            else {
                if last, bytes.allSatisfy({ $0 == 0 }) {
                    unlink(path)  // a segment whose creation a crash interrupted (its header never synced)
                    continue
                }
                throw StorageError(.corrupt, "\(path) is not an obsd write-ahead log segment (bad header); refusing to start")
            }
            var at = Self.headerSize
            var end = at
            scan: while true {
                switch Self.frame(in: bytes, at: at) {
                case .end:
                    break scan
                case .frame(let payload, let next):
                    let position = segment + UInt64(next)
                    if position > checkpoint {
                        let result = bytes.withUnsafeBytes { raw in
                            Result { () throws(StorageError) in try body(UnsafeRawBufferPointer(rebasing: raw[payload]), position) }
                        }
                        try result.get()
                        replay.records += 1
                    }
                    at = next
                    end = next
                    logEnd = position
                    continue
                case .bad:
                    guard last, !Self.anyValidFrame(in: bytes, after: at) else {
                        throw StorageError(
                            .corrupt,
                            "\(path): damaged record at offset \(at) (length or checksum wrong, with valid records after it); refusing to start rather than skip acknowledged writes"
                        )
                    }
                    replay.tornBytes = Self.usedBytes(in: bytes, from: at)
                    replay.tornAt = "\(path) at offset \(at)"
                    break scan
                }
            }
            if last {
                fd = Glibc.open(path, O_RDWR | O_CLOEXEC)
                guard fd >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
                base = segment
                offset = end
                if replay.tornBytes > 0 {
                    // Cut the torn write off, so a later append never sits before garbage.
                    guard ftruncate(fd, off_t(end)) == 0, fdatasync(fd) == 0 else {
                        throw StorageError.from(errno, "cannot cut the torn tail off \(path)")
                    }
                    preallocate()
                }
            }
        }
        // Appends go after the checkpoint even where the log ends before it (its unsynced
        // tail lost with the machine under `sync = relaxed`, after the compacted state took
        // it): a position at or before the checkpoint would be skipped by the next replay.
        // A new segment starts where the log's last frame ends (or at its first position).
        if fd < 0 || position < checkpoint { try startSegment(at: max(checkpoint, logEnd, position, 1)) }
        return replay
    }

    private enum Frame {
        case end
        case frame(payload: Range<Int>, next: Int)
        case bad
    }

    /// The frame at `at`: a valid one, the end of the data (zeros or the end of the file), or
    /// one that fails its checks.
    private static func frame(in bytes: [UInt8], at: Int) -> Frame {
        guard at + 8 <= bytes.count else { return at == bytes.count || bytes[at...].allSatisfy { $0 == 0 } ? .end : .bad }
        let (length, crc) = bytes.withUnsafeBytes { raw in
            (Int(UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: at, as: UInt32.self))),
             UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: at + 4, as: UInt32.self)))
        }
        if length == 0 { return crc == 0 ? .end : .bad }
        let payload = (at + 8)..<(at + 8 + length)
        guard payload.upperBound <= bytes.count else { return .bad }
        let actual = bytes.withUnsafeBytes { CRC32C.checksum(UnsafeRawBufferPointer(rebasing: $0[payload])) }
        guard actual == crc else { return .bad }
        return .frame(payload: payload, next: (payload.upperBound + 7) & ~7)
    }

    /// Whether a valid frame starts anywhere after a bad one (frames start on 8-byte boundaries).
    private static func anyValidFrame(in bytes: [UInt8], after at: Int) -> Bool {
        var candidate = (at + 8) & ~7
        while candidate + 8 <= bytes.count {
            if case .frame = frame(in: bytes, at: candidate) { return true }
            candidate += 8
        }
        return false
    }

    /// The bytes from `at` to the last non-zero byte: what a torn write left.
    private static func usedBytes(in bytes: [UInt8], from at: Int) -> Int {
        var last = bytes.count
        while last > at, bytes[last - 1] == 0 { last -= 1 }
        return last - at
    }

    // MARK: Appending

    /// The position after the last frame.
    var position: UInt64 { base + UInt64(offset) }

    /// Appends one group of encoded frames (see `frame(_:into:)`) with one write; returns
    /// the position after it. Nothing is durable until `sync`.
    func append(_ group: [UInt8]) throws(StorageError) -> UInt64 {
        if offset > Self.headerSize, offset + group.count > segmentSize { try startSegment(at: position) }
        var written = 0
        while written < group.count {
            let n = group.withUnsafeBytes { pwrite(fd, $0.baseAddress! + written, group.count - written, off_t(offset + written)) }
            if n < 0 {
                if errno == EINTR { continue }
                throw StorageError.from(errno, "cannot write to the write-ahead log in \(directory.path)")
            }
            written += n
        }
        offset += group.count
        return position
    }

    /// Makes everything appended durable.
    func sync() throws(StorageError) {
        if fdatasync(fd) != 0 { throw StorageError.from(errno, "cannot sync the write-ahead log in \(directory.path)") }
        if newSegment {
            try syncDirectory()
            newSegment = false
        }
    }

    /// Undoes appends after `position` (a group that failed), durably. `position` is where
    /// the failed group began: never before the current segment (a group that opens a new
    /// segment begins at its base).
    func truncate(to position: UInt64) throws(StorageError) {
        guard position >= base else {
            throw StorageError(.other, "cannot undo a failed write: position \(position) is before the current segment \(base)")
        }
        offset = Int(position - base)
        guard ftruncate(fd, off_t(offset)) == 0, fdatasync(fd) == 0 else {
            throw StorageError.from(errno, "cannot undo a failed write in the write-ahead log in \(directory.path)")
        }
        preallocate()
    }

    /// Encodes one frame around `payload` (see the header).
    static func frame(_ payload: UnsafeRawBufferPointer, into group: inout [UInt8]) {
        let crc = CRC32C.checksum(payload)
        withUnsafeBytes(of: UInt32(payload.count).littleEndian) { group.append(contentsOf: $0) }
        withUnsafeBytes(of: crc.littleEndian) { group.append(contentsOf: $0) }
        group.append(contentsOf: payload)
        let padding = (8 - payload.count % 8) % 8
        if padding > 0 { group.append(contentsOf: repeatElement(0, count: padding)) }
    }

    // MARK: Segments

    /// Starts a new segment at `position`. On failure the current segment stays the one
    /// appended to (a group that cannot roll over fails, and is cut off the current one).
    private func startSegment(at position: UInt64) throws(StorageError) {
        let path = directory.file(position)
        let new = Glibc.open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard new >= 0 else { throw StorageError.from(errno, "cannot create \(path)") }
        var header = Self.magic
        withUnsafeBytes(of: position.littleEndian) { header.append(contentsOf: $0) }
        let n = header.withUnsafeBytes { pwrite(new, $0.baseAddress!, $0.count, 0) }
        guard n == header.count else {
            let failure = n < 0 ? StorageError.from(errno, "cannot write \(path)") : StorageError(.full, "cannot write \(path): short write")
            close(new)
            unlink(path)
            throw failure
        }
        if fd >= 0 {
            // Everything in the old segment is synced before appends move on (under
            // `sync = relaxed` it may not have been yet).
            guard fdatasync(fd) == 0 else {
                let failure = StorageError.from(errno, "cannot sync \(directory.file(base))")
                close(new)
                unlink(path)
                throw failure
            }
            close(fd)
        }
        fd = new
        base = position
        offset = Self.headerSize
        newSegment = true
        preallocate()
    }

    /// Reserves the segment's space so appends do not grow the file (best effort: a file
    /// system that cannot is written as it grows).
    private func preallocate() {
        _ = posix_fallocate(fd, off_t(offset), off_t(max(0, segmentSize - offset)))
    }

    private func syncDirectory() throws(StorageError) {
        let dir = Glibc.open(directory.path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard dir >= 0 else { throw StorageError.from(errno, "cannot open \(directory.path)") }
        defer { close(dir) }
        if fsync(dir) != 0 { throw StorageError.from(errno, "cannot sync \(directory.path)") }
    }

    private func read(_ path: String) throws(StorageError) -> [UInt8] {
        let file = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard file >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
        defer { close(file) }
        var st = stat()
        guard fstat(file, &st) == 0 else { throw StorageError.from(errno, "cannot stat \(path)") }
        var bytes = [UInt8](repeating: 0, count: Int(st.st_size))
        var done = 0
        while done < bytes.count {
            let n = bytes.withUnsafeMutableBytes { pread(file, $0.baseAddress! + done, $0.count - done, off_t(done)) }
            if n < 0, errno == EINTR { continue }
            guard n > 0 else { throw StorageError.from(errno, "cannot read \(path)") }
            done += n
        }
        return bytes
    }
}

extension StorageError {
    /// An error for `errno`, of the kind it means.
    static func from(_ code: Int32, _ what: String) -> StorageError {
        let kind: Kind
        switch code {
        case ENOSPC, EDQUOT: kind = .full
        case EROFS, EACCES, EPERM: kind = .readOnly
        case EIO: kind = .io
        default: kind = .other
        }
        let hint = kind == .full ? " (the file system is full)" : ""
        return StorageError(kind, "\(what): \(String(cString: strerror(code)))\(hint)")
    }
}

