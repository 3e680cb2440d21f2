// ObsStore — the write-ahead log: where a write becomes durable before it is acknowledged.
//
// Append-only segment files `wal/<base position, 16 hex digits>.wal`
// (WriteAheadLog+Directory.swift), preallocated, each a header (format 3, `OBSDWAL3`: 32
// bytes, with the size the segment was preallocated to; segments an earlier obsd wrote,
// `OBSDWAL2` and `OBSDWAL1`, have 16, are read as they were written and never appended to)
// and then frames, each group's beginning with a group-start frame (WriteAheadLog+Frames.swift).
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
// frame header, at the end of the file, or at the frame that ends the segment. A frame that
// fails its length or checksum check in the last segment, with no group written after its own
// (no valid group start after it; in a format 1 segment, no valid frame at all), is the torn
// tail of a write a crash interrupted: it is cut off, with everything after it, and reported.
// Anywhere else it is damage, and replay refuses with the file and offset. Whatever lies after
// the end of the last segment — the remains of a voided group, or of a group whose first page
// a crash lost — was never acknowledged, since nothing is appended behind a zeroed header; as
// appends go on there, it is cut off and reported too. Segments wholly before the checkpoint
// of the compacted state are deleted.
//
// Acknowledged writes lost outside obsd — a segment cut short or removed, the log emptied —
// would otherwise look like a shorter log, and their revision numbers would be handed out
// again in the same epoch, which the contract forbids (an epoch changes whenever the daemon
// cannot show it still holds every revision it acknowledged). So the log keeps evidence of
// how far it went, and replay refuses to start, naming the file, when it finds less:
// - A segment is preallocated before its header is written, and the header records the size
//   (`reserved`); a crash never leaves the file shorter. Only obsd shortens a segment — when it
//   cuts a failed group or a torn tail — and it first rewrites the header to promise no size,
//   then cuts, preallocates again and records the size again: a crash anywhere in between
//   leaves a header that promises nothing or a file as long as promised. A last segment shorter
//   than its header says was cut outside obsd. (One exception: a last segment with no frame
//   yet that no segment names may be a roll-over a crash interrupted; nothing was lost.)
// - At a roll-over, the new segment is made durable first (preallocated, header written and
//   synced, directory synced); then the segment left behind gets an end-of-segment frame
//   naming it. A last segment that names a next one means the next one was removed.
// - The snapshot is written only once the log's first segment is durable and it never covers
//   a position no segment holds, so a snapshot beside a log directory without a segment means
//   the log was removed.
// Refusing, rather than renewing every epoch and going on, keeps the decision with the
// operator, who may still have the file (a backup, a mistaken `truncate`): `obsd --repair-log`
// starts without what was lost, every repository in a new epoch, as for a damaged record.

import SystemPackage

final class WriteAheadLog {
    /// The header of the segments this obsd writes (format 3: the header records the size the
    /// segment was preallocated to; WriteAheadLog+Frames.swift).
    static let magic: [UInt8] = Array("OBSDWAL3".utf8)
    /// The header of segments an earlier obsd wrote: format 2 (groups begin with a start
    /// frame), format 1 (no group starts).
    static let magicFormat2: [UInt8] = Array("OBSDWAL2".utf8)
    static let magicFormat1: [UInt8] = Array("OBSDWAL1".utf8)
    /// The size of a format 3 header, and of the headers of the formats before.
    static let headerSize = 32
    static let legacyHeaderSize = 16

    /// The size of the header of a segment of `format`.
    static func headerSize(format: Int) -> Int { format >= 3 ? headerSize : legacyHeaderSize }

    /// The format of the segment whose bytes begin with `header` (1, 2 or 3), or nil if it is
    /// not a segment (a format 3 header must be whole, its checksum right).
    static func format(of header: some Collection<UInt8>) -> Int? {
        guard let format = formatNamed(by: header) else { return nil }
        guard format == 3 else { return format }
        let bytes = Array(header.prefix(headerSize))
        guard bytes.count == headerSize else { return nil }
        let crc = bytes.withUnsafeBytes { UInt32(littleEndian: $0.loadUnaligned(fromByteOffset: 24, as: UInt32.self)) }
        return bytes.withUnsafeBytes({ CRC32C.checksum(UnsafeRawBufferPointer(rebasing: $0[..<24])) }) == crc ? 3 : nil
    }

    /// The format the magic at the start of `header` names, its checksum unchecked (for a
    /// reader beside the committer, which may be rewriting a header's reserved size).
    static func formatNamed(by header: some Collection<UInt8>) -> Int? {
        let prefix = header.prefix(8)
        if prefix.elementsEqual(magic) { return 3 }
        if prefix.elementsEqual(magicFormat2) { return 2 }
        if prefix.elementsEqual(magicFormat1) { return 1 }
        return nil
    }

    let directory: Directory
    let segmentSize: Int
    private let files: any FileOperations
    /// The current (last) segment (-1: none yet).
    private var fd = FileDescriptor(rawValue: -1)
    private var base: UInt64 = 0
    /// Where the next frame goes, within the current segment: never before its header.
    private var offset = 0
    /// The size of the current segment's header (where its first frame goes).
    private var headerLength = WriteAheadLog.headerSize
    /// The size the current segment's header says it was preallocated to (0: no promise, or a
    /// segment of an earlier format).
    private var reserved: UInt64 = 0
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
        /// Under `repair`: the acknowledged writes found lost outside obsd (a segment cut short
        /// or removed, the log emptied), said with the file; the log goes on without them.
        var lost: String? = nil
        var records = 0
    }

    /// A log in `directory` (not yet opened); `files` makes its system calls.
    init(directory: String, segmentSize: Int = 64 << 20, files: any FileOperations = SystemFileOperations()) {
        self.directory = Directory(path: directory)
        self.segmentSize = segmentSize
        self.files = files
    }

    deinit { if fd.rawValue >= 0 { try? fd.close() } }

    // MARK: Opening and replay

    /// Opens the log (creating it), calls `body` with every frame's payload and end position
    /// after `checkpoint`, in order, and leaves the log ready to append after the last one.
    /// `expectingLog`: a snapshot covers the log through `checkpoint`, so the log must hold a
    /// segment there. Acknowledged writes found lost outside obsd (see the header) refuse, with
    /// the file. `repair`: a damaged record, instead of refusing, ends the log — it is cut
    /// there, with everything after it, later segments included — and lost writes are
    /// reported (`Replay.lost`) and the log goes on without them (an operator's decision:
    /// `obsd --repair-log`).
    func open(
        after checkpoint: UInt64, repair: Bool = false, expectingLog: Bool = false,
        _ body: (UnsafeRawBufferPointer, UInt64) throws(StorageError) -> Void
    ) throws(StorageError) -> Replay {
        let created: Bool
        do throws(Errno) {
            try FilePath(directory.path).createDirectory(permissions: .ownerReadWriteExecute)
            created = true
        } catch where error == .fileExists {
            created = false
        } catch {
            throw StorageError(error, "cannot create \(directory.path)")
        }
        if created {
            // Its entry durable before a segment in it is relied on (by a snapshot written next).
            let parent = directory.path.split(separator: "/", omittingEmptySubsequences: false).dropLast().joined(separator: "/")
            try DataDirectory.sync(parent.isEmpty ? (directory.path.hasPrefix("/") ? "/" : ".") : parent)
        }
        var replay = Replay()
        /// Acknowledged writes found lost: refused, or under `repair` reported.
        func lose(_ what: String) throws(StorageError) {
            guard repair else {
                throw StorageError(
                    .corrupt,
                    "\(what); refusing to start rather than hand their revision numbers out again in the same epoch (restore the file, or start without them: obsd --repair-log, and every repository starts a new epoch)"
                )
            }
            replay.lost = replay.lost.map { $0 + "; " + what } ?? what
        }
        /// Where the last valid frame of the log ends.
        var logEnd: UInt64 = 0
        /// Where the segment read before says the log goes on (its end-of-segment frame).
        var continuation: UInt64? = nil
        /// Whether a segment was found (read, or wholly covered by the snapshot).
        var found = false
        let segments = try directory.segments()
        for (i, segment) in segments.enumerated() {
            var last = i == segments.count - 1
            // A segment the snapshot wholly covers is not read (it is deleted once the store is open).
            if !last, segments[i + 1] <= checkpoint {
                found = true
                continue
            }
            let path = directory.file(segment)
            /// Whether the segment before names this one as where the log goes on.
            let named = continuation == segment
            continuation = nil
            /// Whether this segment must be whole: the segment before names it, or the snapshot
            /// covers the log into it (or it is the first the snapshot relies on). Otherwise, as
            /// the last segment, it may be a roll-over a crash interrupted before any write went to it.
            let reliedOn = named || segment < checkpoint || (!found && expectingLog)
            let mapped = try Mapped(path)
            let bytes = mapped.bytes
            guard let format = Self.format(of: bytes), bytes.count >= Self.headerSize(format: format),
                UInt64(littleEndian: bytes.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) == segment
            else {
                if last, !Self.anyValidFrame(in: bytes, after: Self.legacyHeaderSize - 8) {
                    // A segment whose creation a crash interrupted (its header never synced, or
                    // torn) with no record after it — unless the log before says it goes on
                    // there, or a snapshot relies on it.
                    if reliedOn {
                        try lose("\(path) is empty (\(mapped.fileSize) bytes, no valid header and no record), but \(named ? "the segment before it names it as where the write-ahead log goes on" : "the snapshot covers the write-ahead log into it"): the acknowledged writes it held are gone")
                        found = true
                    }
                    try? FilePath(path).remove()
                    continue
                }
                throw StorageError(.corrupt, "\(path) is not an obsd write-ahead log segment (bad header); refusing to start")
            }
            found = true
            // Segments follow one another with no gap: each starts where the log before it
            // ends (or at the snapshot's position). A later start means segments are missing.
            guard segment <= max(checkpoint, logEnd, 1) else {
                throw StorageError(
                    .corrupt,
                    "\(path) starts at log position \(segment), but \(i == 0 ? "the snapshot covers the log only through \(checkpoint)" : "the segment before it ends at \(logEnd)"): the segments between are missing; refusing to start"
                )
            }
            let headerLength = Self.headerSize(format: format)
            let promised = format >= 3 ? Self.reserved(in: bytes) : 0
            logEnd = max(logEnd, segment + UInt64(headerLength))
            var end = headerLength
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
                    if let target = Self.segmentEndTarget(frame) {
                        continuation = target  // the log goes on in that segment; this one's ends here
                        break scan
                    }
                    let groupStart = Self.isGroupStart(frame)
                    if position > checkpoint, !groupStart {
                        try body(frame, position)
                        replay.records += 1
                    }
                    emptyGroup = groupStart ? end : nil
                    end = next
                    logEnd = position
                case .bad:
                    // Where the next segment starts, the log goes on there: what lies here is
                    // an end-of-segment frame a crash tore, never part of the log.
                    if !last, segments[i + 1] == segment + UInt64(end) { break scan }
                    // Torn: in the last segment, with no valid frame after it — or, in a format
                    // 2 or 3 segment, with a sector of it zeroed (lost, not garbled) and no group
                    // written after its own (see WriteAheadLog+Frames.swift).
                    let torn =
                        last
                        && (!Self.anyValidFrame(in: bytes, after: end)
                            || (format >= 2 && Self.hasLostSector(in: bytes, frameAt: end) && !Self.anyGroupStart(in: bytes, after: end)))
                    if !torn, repair {
                        replay.repairedBytes = Self.usedBytes(in: bytes, from: end)
                        replay.repairedAt = "\(path) at offset \(end)"
                        // The later segments go first: a crash before this one is cut leaves
                        // it last and damaged, which a second repair cuts.
                        for later in segments[(i + 1)...] where (try? FilePath(directory.file(later)).remove()) != nil { replay.removedSegments += 1 }
                        if replay.removedSegments > 0 { try DataDirectory.sync(directory.path) }
                        last = true  // the log now ends here
                        continuation = nil
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
            // Evidence of acknowledged writes lost outside obsd (see the header).
            var cutNamingFrame = false
            if let target = continuation {
                try lose("\(directory.file(target)) is missing: \(path) says the write-ahead log goes on there, so the acknowledged writes it held are gone")
                cutNamingFrame = true  // under repair: the log ends here, and goes on here
                continuation = nil
            } else if promised > 0, mapped.fileSize < Int(clamping: promised), reliedOn || end > headerLength || replay.tornBytes > 0 {
                // (A last segment nothing relies on, with no frame, may be a roll-over a crash
                // interrupted before its preallocation was durable: nothing was written to it.)
                try lose("\(path) is \(mapped.fileSize) bytes, shorter than the \(promised) it was preallocated to: it was cut outside obsd (a crash never shortens it), and the acknowledged writes in what was cut are gone")
            }
            fd = try attempt("cannot open \(path)") { () throws(Errno) in
                try files.open(FilePath(path), .readWrite, options: [], permissions: .ownerReadWrite)
            }
            base = segment
            offset = end
            self.headerLength = headerLength
            reserved = promised
            // A segment of an earlier format is not appended to: the next group starts a format 3 one.
            if format < 3 { sealed = true }
            if replay.tornBytes == 0, replay.repairedAt == nil, !cutNamingFrame {
                replay.leftoverBytes = Self.usedBytes(in: bytes, from: end)
                if replay.leftoverBytes > 0 { replay.leftoverAt = "\(path) at offset \(end)" }
            }
            if replay.tornBytes > 0 || replay.leftoverBytes > 0 || replay.repairedAt != nil || cutNamingFrame {
                // Appends go on at the end: cut what lies there, so that no later frame
                // sits before garbage, or before the valid-looking frames of a voided group.
                try attempt("cannot cut what follows the end of the write-ahead log off \(path) at offset \(end)") { () throws(Errno) in try cut(at: end) }
            } else if format >= 3, promised == 0 || mapped.fileSize < Int(clamping: promised) {
                preallocate()  // a promise a crash kept from being made (again): made now
            }
            if replay.repairedAt != nil { break }  // the segments after it are gone
        }
        if !found, expectingLog {
            try lose("\(directory.path) holds no log segment, but the snapshot covers the write-ahead log only through position \(checkpoint): the log after it, and the acknowledged writes in it, are gone")
        }
        // Appends go after the checkpoint even where the log ends before it (its unsynced
        // tail lost with the machine under `sync = relaxed`, after the compacted state took
        // it): a position at or before the checkpoint would be skipped by the next replay.
        // A new segment starts where the log's last frame ends (or at its first position).
        if fd.rawValue < 0 || position < checkpoint { try startSegment(at: max(checkpoint, logEnd, position, 1)) }
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
        if sealed || (offset > headerLength && offset + group.count > segmentSize) { try startSegment(at: position) }
        let start = offset
        lastGroup = start
        if let failure = group.withUnsafeBytes({ files.writeAll(fd, $0, at: start) }) {
            throw StorageError(failure.errno, "cannot write to the write-ahead log \(directory.file(base)) at offset \(start + failure.written)")
        }
        offset += group.count
        return base + UInt64(start)
    }

    /// Makes everything appended durable.
    func sync() throws(StorageError) {
        try attempt("cannot sync the write-ahead log \(directory.file(base))") { () throws(Errno) in try files.fdatasync(fd) }
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
        let cutFailure: StorageError
        do throws(Errno) {
            try cut(at: start)
            return .cut
        } catch {
            cutFailure = StorageError(error, "cannot cut a failed write off \(path) at offset \(start)")
        }
        sealed = true  // nothing more goes behind this group, voided or not
        let zeros = [UInt8](repeating: 0, count: Self.frameHeaderSize)
        if let failure = zeros.withUnsafeBytes({ files.writeAll(fd, $0, at: start) }) {
            let cause = StorageError(failure.errno, "nor void it (zero its first frame header)")
            throw StorageError(cause.kind, "\(cutFailure.description); \(cause.description)")
        }
        do throws(Errno) {
            try files.fdatasync(fd)
        } catch {
            let cause = StorageError(error, "nor void it (sync its zeroed frame header)")
            throw StorageError(cause.kind, "\(cutFailure.description); \(cause.description)")
        }
        return .voided(cutFailure: cutFailure)
    }

    // MARK: Segments

    /// Starts a new segment at `position`: preallocated, then its header (recording the size)
    /// written and synced, and its directory entry synced; only then does the segment left
    /// behind get its end-of-segment frame naming it (see the header). On failure the current
    /// segment stays the one appended to (a group that cannot roll over fails with nothing
    /// written).
    private func startSegment(at position: UInt64) throws(StorageError) {
        let path = directory.file(position)
        let new = try attempt("cannot create \(path)") { () throws(Errno) in
            try files.open(FilePath(path), .readWrite, options: [.create, .exclusiveCreate], permissions: .ownerReadWrite)
        }
        func abandon(_ failure: StorageError) -> StorageError {
            try? new.close()
            try? FilePath(path).remove()
            return failure
        }
        // The space first, durably, then the header that promises it (best effort: a file
        // system that cannot preallocate gets a header that promises nothing, and is written
        // as it grows).
        var reserved: UInt64 = 0
        do throws(Errno) {
            try new.preallocate(at: 0, count: segmentSize)
            try files.fdatasync(new)
            reserved = UInt64(segmentSize)
        } catch {}
        let header = Self.header(base: position, reserved: reserved)
        if let failure = header.withUnsafeBytes({ files.writeAll(new, $0, at: 0) }) {
            throw abandon(StorageError(failure.errno, "cannot write the header of \(path)"))
        }
        do throws(Errno) {
            try files.fdatasync(new)
        } catch {
            throw abandon(StorageError(error, "cannot sync \(path)"))
        }
        do throws(StorageError) {
            try directory.sync()
        } catch {
            throw abandon(error)
        }
        if fd.rawValue >= 0 {
            // Everything in the old segment is synced before appends move on (under
            // `sync = relaxed` it may not have been yet).
            do throws(Errno) {
                try files.fdatasync(fd)
            } catch {
                throw abandon(StorageError(error, "cannot sync \(directory.file(base))"))
            }
            // Then it says where the log goes on, right after its log (over a voided group's
            // zeroed frame header too: replay reads no further). Best effort: without it, only
            // the new segment's removal would go unnoticed; a write torn by a crash lies where
            // the new segment starts, which replay knows for no part of the log.
            if Self.segmentEnd(next: position).withUnsafeBytes({ files.writeAll(fd, $0, at: offset) }) == nil { try? files.fdatasync(fd) }
            try? fd.close()
        }
        fd = new
        base = position
        offset = Self.headerSize
        headerLength = Self.headerSize
        self.reserved = reserved
        sealed = false
        newSegment = false  // its directory entry is durable already
        zeroedTo = offset
    }

    /// Cuts the current segment at `at`, durably (what follows goes), keeping its header's
    /// promise: the header first stops promising a size, then the file is cut, then it is
    /// preallocated and the size promised again — a crash in between never leaves it shorter
    /// than its header says. Moves the end of the log there. Throws when the cut did not
    /// happen.
    private func cut(at: Int) throws(Errno) {
        if reserved > 0 { try writeHeader(reserved: 0) }
        try files.truncate(fd, to: Int64(at))
        try files.fdatasync(fd)
        offset = at
        preallocate()
    }

    /// Reserves the segment's space again so appends do not grow the file, and — durably, then
    /// — promises that size in its header (best effort: a file system that cannot keeps a
    /// header that promises nothing, and is written as it grows).
    private func preallocate() {
        zeroedTo = offset
        do throws(Errno) {
            try fd.preallocate(at: offset, count: max(0, segmentSize - offset))
            guard headerLength == Self.headerSize else { return }
            let size = try fd.size()
            try files.fdatasync(fd)
            try writeHeader(reserved: UInt64(size))
        } catch {}
    }

    /// Rewrites the current segment's header to promise `reserved` bytes, durably; throws when
    /// it did not. `self.reserved` stays what the file may promise: a larger promise whose write
    /// or sync failed may still have reached the file (so a later cut withdraws it first); a
    /// smaller one counts only once it is durable.
    private func writeHeader(reserved: UInt64) throws(Errno) {
        self.reserved = max(self.reserved, reserved)
        let header = Self.header(base: base, reserved: reserved)
        if let failure = header.withUnsafeBytes({ files.writeAll(fd, $0, at: 0) }) { throw failure.errno }
        try files.fdatasync(fd)
        self.reserved = reserved
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
        guard fd.rawValue >= 0, zeroedTo < segmentSize, offset + Self.zeroMargin > zeroedTo else { return }
        let from = max(zeroedTo, offset)
        let count = min(Self.zeroChunk, segmentSize - from)
        guard count > 0 else { return }
        let written = Self.zeros.withUnsafeBytes { try? fd.write(UnsafeRawBufferPointer(rebasing: $0[..<count]), at: Int64(from)) }
        guard written == count else {
            zeroedTo = segmentSize  // not again in this segment
            return
        }
        zeroedTo = from + count
        fd.startWriteback(at: from, count: count)
    }
}
