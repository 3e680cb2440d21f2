// ObsStore — the write-ahead log: where a write becomes durable before it is acknowledged.
//
// Append-only segment files `wal/<base position, 16 hex digits>.wal`
// (WriteAheadLog+Directory.swift), preallocated, each a 16-byte header (`OBSDWAL2` + its base
// position; `OBSDWAL1` in a segment an earlier obsd wrote, read as it was written and never
// appended to) and then frames, each group's beginning with a group-start frame
// (WriteAheadLog+Frames.swift).
// A position (log sequence number) is a byte offset in the log as if its segments were one
// file, each cut where its log ends: a segment's base is where the previous one's last frame
// ends, and a frame's position is where it ends. A group of frames is written with one
// `pwrite` at the end of the log and, under `sync = always`, made durable with one
// `fdatasync` — group commit.
//
// A group that fails (its write or its sync) is undone so that no replay can find it: cut
// off (`ftruncate` to where it began — after the segment's header, also when the group had
// just opened the segment — then `fdatasync`) or, if the cut fails, voided: its first frame
// header overwritten with zeros and synced, which ends the log in that segment. A voided
// segment is sealed: the next group starts a new segment, so nothing is ever written behind
// a zeroed header, where replay would not look. If even the void fails, the group may be
// replayed, and the caller must say so (Committer.swift).
//
// Replay reads every frame after a position. In each segment the log ends at an all-zero
// frame header or at the end of the file. A frame that fails its length or checksum check
// in the last segment, with no group written after its own (no valid group start after it;
// in a format 1 segment, no valid frame at all), is the torn tail of a write a crash
// interrupted: it is cut off, with everything after it, and reported. Anywhere else it is
// damage, and replay refuses with the file and offset. Whatever lies after the end of the last segment — the
// remains of a voided group, or of a group whose first page a crash lost — was never
// acknowledged, since nothing is appended behind a zeroed header; as appends go on there,
// it is cut off and reported too. Segments wholly before the checkpoint of the compacted
// state are deleted.

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif
import CLinux

final class WriteAheadLog {
    /// The header of the segments this obsd writes (format 2: groups begin with a start frame).
    static let magic: [UInt8] = Array("OBSDWAL2".utf8)
    /// The header of segments an earlier obsd wrote (format 1: no group starts).
    static let magicFormat1: [UInt8] = Array("OBSDWAL1".utf8)
    static let headerSize = 16

    /// The format of the segment whose bytes begin with `header` (1 or 2), or nil if it is
    /// not a segment.
    static func format(of header: some Collection<UInt8>) -> Int? {
        let prefix = header.prefix(8)
        if prefix.elementsEqual(magic) { return 2 }
        if prefix.elementsEqual(magicFormat1) { return 1 }
        return nil
    }

    let directory: Directory
    let segmentSize: Int
    private let files: any FileOperations
    /// The current (last) segment.
    private var fd: Int32 = -1
    private var base: UInt64 = 0
    /// Where the next frame goes, within the current segment: never before its header.
    private var offset = 0
    /// Where the group of the last `append` begins in the current segment, until it is
    /// undone (nil: nothing of it was written).
    private var lastGroup: Int? = nil
    /// The current segment holds a voided group: the next group starts a new segment.
    private var sealed = false
    /// Segments whose directory entry is not yet durable (fsync of the directory pending).
    private var newSegment = false
    /// How far the current segment holds written zeros (`zeroAhead`): appends before it
    /// overwrite data blocks the file system has already allocated and converted.
    private var zeroedTo = 0

    /// What replay found.
    struct Replay {
        /// Bytes of a torn write cut off the end, and where.
        var tornBytes = 0
        var tornAt: String? = nil
        /// Bytes cut off after the end of the log (a voided group, or a group whose first
        /// page a crash lost), and where.
        var leftoverBytes = 0
        var leftoverAt: String? = nil
        /// Under `repair`: bytes cut from the first damaged record on, where, and the later
        /// segments removed.
        var repairedBytes = 0
        var repairedAt: String? = nil
        var removedSegments = 0
        var records = 0
    }

    /// A log in `directory` (not yet opened); `files` makes its system calls.
    init(directory: String, segmentSize: Int = 64 << 20, files: any FileOperations = SystemFileOperations()) {
        self.directory = Directory(path: directory)
        self.segmentSize = segmentSize
        self.files = files
    }

    deinit { if fd >= 0 { close(fd) } }

    // MARK: Opening and replay

    /// Opens the log (creating it), calls `body` with every frame's payload and end position
    /// after `checkpoint`, in order, and leaves the log ready to append after the last one.
    /// `repair`: a damaged record, instead of refusing, ends the log — it is cut there, with
    /// everything after it, later segments included (an operator's decision: `obsd --repair-log`).
    func open(
        after checkpoint: UInt64, repair: Bool = false, _ body: (UnsafeRawBufferPointer, UInt64) throws(StorageError) -> Void
    ) throws(StorageError) -> Replay {
        if mkdir(directory.path, 0o700) != 0 && errno != EEXIST {
            throw StorageError.from(errno, "cannot create \(directory.path)")
        }
        var replay = Replay()
        /// Where the last valid frame of the log ends.
        var logEnd: UInt64 = 0
        let segments = try directory.segments()
        for (i, segment) in segments.enumerated() {
            var last = i == segments.count - 1
            // A segment the snapshot wholly covers is not read (it is deleted once the store is open).
            if !last, segments[i + 1] <= checkpoint { continue }
            let path = directory.file(segment)
            let mapped = try Mapped(path)
            let bytes = mapped.bytes
            guard bytes.count >= Self.headerSize, let format = Self.format(of: bytes),
                UInt64(littleEndian: bytes.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) == segment
            else {
                if last, bytes.allSatisfy({ $0 == 0 }) {
                    unlink(path)  // a segment whose creation a crash interrupted (its header never synced)
                    continue
                }
                throw StorageError(.corrupt, "\(path) is not an obsd write-ahead log segment (bad header); refusing to start")
            }
            // Segments follow one another with no gap: each starts where the log before it
            // ends (or at the snapshot's position). A later start means segments are missing.
            guard segment <= max(checkpoint, logEnd, 1) else {
                throw StorageError(
                    .corrupt,
                    "\(path) starts at log position \(segment), but \(i == 0 ? "the snapshot covers the log only through \(checkpoint)" : "the segment before it ends at \(logEnd)"): the segments between are missing; refusing to start"
                )
            }
            logEnd = max(logEnd, segment + UInt64(Self.headerSize))
            var end = Self.headerSize
            /// Where a group-start frame with no record after it yet begins.
            var emptyGroup: Int? = nil
            scan: while true {
                // Frames the snapshot covers are walked by their lengths, not checksummed.
                let covered = segment + UInt64(end) < checkpoint
                switch Self.frame(in: bytes, at: end, verify: !covered) {
                case .end:
                    // A group start with nothing after it (its records' pages lost) goes too.
                    if last, let emptyGroup, segment + UInt64(emptyGroup) >= checkpoint {
                        end = emptyGroup
                        logEnd = segment + UInt64(emptyGroup)
                    }
                    break scan
                case .frame(var payload, var next):
                    var position = segment + UInt64(next)
                    if covered && position > checkpoint {
                        // A frame across the snapshot's position: checked after all (failing
                        // its checksum, it is a bad frame).
                        guard case .frame(let p, let n) = Self.frame(in: bytes, at: end) else { fallthrough }
                        (payload, next, position) = (p, n, segment + UInt64(n))
                    }
                    let frame = UnsafeRawBufferPointer(rebasing: bytes[payload])
                    let groupStart = Self.isGroupStart(frame)
                    if position > checkpoint, !groupStart {
                        try body(frame, position)
                        replay.records += 1
                    }
                    emptyGroup = groupStart ? end : nil
                    end = next
                    logEnd = position
                case .bad:
                    // Torn: in the last segment, with no valid frame after it — or, in a format
                    // 2 segment, with a sector of it zeroed (lost, not garbled) and no group
                    // written after its own (see WriteAheadLog+Frames.swift).
                    let torn =
                        last
                        && (!Self.anyValidFrame(in: bytes, after: end)
                            || (format == 2 && Self.hasLostSector(in: bytes, frameAt: end) && !Self.anyGroupStart(in: bytes, after: end)))
                    if !torn, repair {
                        replay.repairedBytes = Self.usedBytes(in: bytes, from: end)
                        replay.repairedAt = "\(path) at offset \(end)"
                        // The later segments go first: a crash before this one is cut leaves
                        // it last and damaged, which a second repair cuts.
                        for later in segments[(i + 1)...] where unlink(directory.file(later)) == 0 { replay.removedSegments += 1 }
                        if replay.removedSegments > 0 { try DataDirectory.sync(directory.path) }
                        last = true  // the log now ends here
                        break scan
                    }
                    guard torn else {
                        throw StorageError(
                            .corrupt,
                            "\(path): damaged record at offset \(end) (length or checksum wrong, with valid records after it); refusing to start rather than skip acknowledged writes (obsd --repair-log cuts the log there, dropping what follows)"
                        )
                    }
                    // A torn group none of whose records survived goes whole, its start too.
                    if let emptyGroup, segment + UInt64(emptyGroup) >= checkpoint {
                        end = emptyGroup
                        logEnd = segment + UInt64(emptyGroup)
                    }
                    replay.tornBytes = Self.usedBytes(in: bytes, from: end)
                    replay.tornAt = "\(path) at offset \(end)"
                    break scan
                }
            }
            guard last else { continue }  // behind its end, an earlier segment may hold a voided group: never read
            fd = files.open(path, O_RDWR | O_CLOEXEC, 0)
            guard fd >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
            base = segment
            offset = end
            // A format 1 segment is not appended to: the next group starts a format 2 one.
            if format == 1 { sealed = true }
            if replay.tornBytes == 0, replay.repairedAt == nil {
                replay.leftoverBytes = Self.usedBytes(in: bytes, from: end)
                if replay.leftoverBytes > 0 { replay.leftoverAt = "\(path) at offset \(end)" }
            }
            if replay.tornBytes > 0 || replay.leftoverBytes > 0 || replay.repairedAt != nil {
                // Appends go on at the end: cut what lies there, so that no later frame
                // sits before garbage, or before the valid-looking frames of a voided group.
                guard files.ftruncate(fd, off_t(end)) == 0, files.fdatasync(fd) == 0 else {
                    throw StorageError.from(errno, "cannot cut what follows the end of the write-ahead log off \(path) at offset \(end)")
                }
                preallocate()
            }
            if replay.repairedAt != nil { break }  // the segments after it are gone
        }
        // Appends go after the checkpoint even where the log ends before it (its unsynced
        // tail lost with the machine under `sync = relaxed`, after the compacted state took
        // it): a position at or before the checkpoint would be skipped by the next replay.
        // A new segment starts where the log's last frame ends (or at its first position).
        if fd < 0 || position < checkpoint { try startSegment(at: max(checkpoint, logEnd, position, 1)) }
        return replay
    }

    // MARK: Appending

    /// The position after the last frame.
    var position: UInt64 { base + UInt64(offset) }

    /// Appends one group of encoded frames (see `frame(_:into:)`) with one write — in a new
    /// segment when it does not fit in the current one or that one is sealed — and returns
    /// the position where the group begins: its frames end there plus where they end in
    /// `group`. Nothing is durable until `sync`. A group that fails here, or whose sync
    /// fails, must be undone (`undoFailedGroup`) before the next append.
    func append(_ group: [UInt8]) throws(StorageError) -> UInt64 {
        assert(group.withUnsafeBytes { Self.startsGroup($0) }, "a group begins with its group-start frame (startGroup)")
        lastGroup = nil
        if sealed || (offset > Self.headerSize && offset + group.count > segmentSize) { try startSegment(at: position) }
        let start = offset
        lastGroup = start
        if let failure = group.withUnsafeBytes({ files.writeAll(fd, $0, at: start) }) {
            throw StorageError.from(failure.errno, "cannot write to the write-ahead log \(directory.file(base)) at offset \(start + failure.written)")
        }
        offset += group.count
        return base + UInt64(start)
    }

    /// Makes everything appended durable.
    func sync() throws(StorageError) {
        if files.fdatasync(fd) != 0 { throw StorageError.from(errno, "cannot sync the write-ahead log \(directory.file(base))") }
        if newSegment {
            try directory.sync()
            newSegment = false
        }
    }

    /// How a failed group was undone.
    enum Undo {
        /// Nothing of it was written (it failed opening a new segment).
        case nothingWritten
        /// Cut off: the segment ends where the group began, durably.
        case cut
        /// The cut failed (`cutFailure`); the group's first frame header is zeros, durably,
        /// so replay ends the log before it; the next group starts a new segment.
        case voided(cutFailure: StorageError)
    }

    /// Undoes the group of the last `append`, which failed or whose sync failed, so that no
    /// replay can find it (see the header). Throws when it cannot make sure of that: the
    /// group may still be in the log, whole or in part, and a restart may replay it.
    func undoFailedGroup() throws(StorageError) -> Undo {
        guard let start = lastGroup else { return .nothingWritten }
        lastGroup = nil
        offset = start  // the log ends where the group began, after the segment's header
        let path = directory.file(base)
        if files.ftruncate(fd, off_t(start)) == 0, files.fdatasync(fd) == 0 {
            preallocate()
            return .cut
        }
        let cutFailure = StorageError.from(errno, "cannot cut a failed write off \(path) at offset \(start)")
        sealed = true  // nothing more goes behind this group, voided or not
        let zeros = [UInt8](repeating: 0, count: Self.frameHeaderSize)
        if let failure = zeros.withUnsafeBytes({ files.writeAll(fd, $0, at: start) }) {
            let cause = StorageError.from(failure.errno, "nor void it (zero its first frame header)")
            throw StorageError(cause.kind, "\(cutFailure.description); \(cause.description)")
        }
        guard files.fdatasync(fd) == 0 else {
            let cause = StorageError.from(errno, "nor void it (sync its zeroed frame header)")
            throw StorageError(cause.kind, "\(cutFailure.description); \(cause.description)")
        }
        return .voided(cutFailure: cutFailure)
    }

    // MARK: Segments

    /// Starts a new segment at `position`. On failure the current segment stays the one
    /// appended to (a group that cannot roll over fails with nothing written).
    private func startSegment(at position: UInt64) throws(StorageError) {
        let path = directory.file(position)
        let new = files.open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard new >= 0 else { throw StorageError.from(errno, "cannot create \(path)") }
        var header = Self.magic
        withUnsafeBytes(of: position.littleEndian) { header.append(contentsOf: $0) }
        if let failure = header.withUnsafeBytes({ files.writeAll(new, $0, at: 0) }) {
            close(new)
            unlink(path)
            throw StorageError.from(failure.errno, "cannot write the header of \(path)")
        }
        if fd >= 0 {
            // Everything in the old segment is synced before appends move on (under
            // `sync = relaxed` it may not have been yet).
            guard files.fdatasync(fd) == 0 else {
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
        sealed = false
        newSegment = true
        preallocate()
    }

    /// Reserves the segment's space so appends do not grow the file (best effort: a file
    /// system that cannot is written as it grows).
    private func preallocate() {
        _ = posix_fallocate(fd, off_t(offset), off_t(max(0, segmentSize - offset)))
        zeroedTo = offset
    }

    /// How much `zeroAhead` writes at a time, and how close the log may come to the zeros'
    /// end before it does.
    static let zeroChunk = 1 << 20
    static let zeroMargin = 256 << 10
    private static let zeros = [UInt8](repeating: 0, count: zeroChunk)

    /// Writes zeros ahead of the log's end, a megabyte at a time, once the log comes within
    /// `zeroMargin` of the last ones, and starts writing them back. Preallocated space is
    /// unwritten extents: an `fdatasync` after appending into it must also convert the
    /// extents and write the inode — a second synchronous write per group commit (busbench,
    /// durable writes at 64 in flight: 0.70 × Redis's rate with it, 0.87–0.96 × without;
    /// docs/PERFORMANCE.md). Over written zeros a sync writes the group's data blocks alone,
    /// as PostgreSQL's zero-filled WAL segments do. Zeros past the log's end are its end to
    /// replay (an all-zero frame header), so this changes nothing the log means. Best effort,
    /// outside the file operations a test can fail: where it fails, appends convert extents
    /// as before.
    func zeroAhead() {
        guard fd >= 0, zeroedTo < segmentSize, offset + Self.zeroMargin > zeroedTo else { return }
        let from = max(zeroedTo, offset)
        let count = min(Self.zeroChunk, segmentSize - from)
        guard count > 0 else { return }
        let written = Self.zeros.withUnsafeBytes { Glibc.pwrite(fd, $0.baseAddress, count, off_t(from)) }
        guard written == count else {
            zeroedTo = segmentSize  // not again in this segment
            return
        }
        zeroedTo = from + count
        _ = obs_start_writeback(fd, Int64(from), Int64(count))
    }
}
