// ObsStore — the snapshot file: the compacted state, written whole by the checkpointer and
// read in large blocks at start-up (the write-ahead log after it is replayed on top).
//
// `obsd.snapshot` is `OBSDSNP1` and then blocks, each `u32 kind · u32 length · u32 CRC-32C
// (of kind, length and payload) · payload`, little-endian:
//
// - HEAD, first: u32 format version (3) · u64 the log position it covers (every frame
//   ending there or before is in it) · u16 length, its own file identity (inode and birth
//   time, recorded when it was created: a copy is another file) · i64 when it was written.
// - Per repository: REPO (u16 length, name · u8 length, epoch · u64 revision), then HIST
//   blocks — its retained history, oldest first, each revision `u32 length · u64 revision ·
//   i64 time · u32 weight · u8 flags (1 writer, 2 lease end) · [u32 uid · u32 gid · i32 pid] ·
//   [u64 lease · u8 end] · its changes as the log encodes them (LogRecord)` — then ENTR
//   blocks — its entries as FlatRecord encodes them, whole records, at most 1 MiB a block
//   unless one record is larger, so a block becomes a slab of the table as it is — then ATTA
//   blocks: the lease each attached key is attached to, `u32 count · (u16 key length, key ·
//   u64 lease)…` — then TOMB blocks, at least one: its tombstones (Tombstones.swift), each
//   block `u64 floor · u32 count · (u16 key length, key · u64 revision)…`, the floor (every
//   deletion above it is remembered) the same in each, the deletions oldest first, each
//   above the floor and at most the repository's revision, every key absent from its entries.
// - LEAS, after the repositories: u64 the next lease id · u32 count · per lease `u64 id ·
//   u32 uid · u32 gid · i32 pid · i64 ttl (0: bound to its connection) · u8 ended (0: live,
//   else the reason it ended: 1 expired, 2 revoked, 3 closed)` — every live lease, and the
//   ended ones some key is still attached to (a restart deletes those keys).
// - DONE, last: u32 repositories · u64 entries · u64 history revisions. Nothing follows it.
//
// Version 2 (obsd before tombstones were stored) has no TOMB blocks, version 1 (before
// leases were stored here) no ATTA or LEAS blocks either; both are still read — a repository
// without TOMB loads knowing no deletion at or below its revision (a catch-up from there is
// a snapshot), and the next snapshot written is of version 3.
//
// It is written beside as `obsd.snapshot.new`, synced, and renamed over the old one, so a
// crash leaves the old or the new, whole. Whatever else is found — not a snapshot, a block
// cut short or missing its end (torn), a checksum that fails (damaged), a block that passes
// its checksum but breaks these rules — stops start-up with the file, the offset and the
// cause: never a state silently different from the one stored.

import SystemPackage

enum SnapshotFormat {
    static let magic: [UInt8] = Array("OBSDSNP1".utf8)
    static let version: UInt32 = 3
    /// The versions start-up reads (1: no leases; 2: no tombstones).
    static let readable: ClosedRange<UInt32> = 1...3
    /// The first version whose repositories have TOMB blocks.
    static let tombstonesSince: UInt32 = 3
    static let fileName = "obsd.snapshot"
    static let partialName = "obsd.snapshot.new"
    static let blockHeader = 12
    /// Entry and history blocks are cut at about this size.
    static let blockSize = 1 << 20

    enum Kind: UInt32 {
        case head = 1, repository, entries, history, done, attachments, leases, tombstones

        var name: String {
            switch self {
            case .head: "HEAD"
            case .repository: "REPO"
            case .entries: "ENTR"
            case .history: "HIST"
            case .done: "DONE"
            case .attachments: "ATTA"
            case .leases: "LEAS"
            case .tombstones: "TOMB"
            }
        }
    }

    /// The checksum of a block: its kind and length, then its payload.
    static func checksum(kind: UInt32, payload: UnsafeRawBufferPointer) -> UInt32 {
        var head = (kind.littleEndian, UInt32(payload.count).littleEndian)
        let crc = withUnsafeBytes(of: &head) { CRC32C.checksum($0) }
        return CRC32C.checksum(payload, continuing: crc)
    }

    /// The identity of an open file (`FileDescriptor.identity`).
    static func identity(of fd: FileDescriptor, path: String) throws(StorageError) -> String {
        try attempt("cannot stat \(path)") { () throws(Errno) in try fd.identity() }
    }
}

/// Little-endian fields appended to a payload.
struct PayloadWriter {
    var bytes: [UInt8] = []

    mutating func u8(_ v: UInt8) { bytes.append(v) }
    mutating func u16(_ v: UInt16) { withUnsafeBytes(of: v.littleEndian) { bytes.append(contentsOf: $0) } }
    mutating func u32(_ v: UInt32) { withUnsafeBytes(of: v.littleEndian) { bytes.append(contentsOf: $0) } }
    mutating func u64(_ v: UInt64) { withUnsafeBytes(of: v.littleEndian) { bytes.append(contentsOf: $0) } }
    mutating func text(_ s: String, lengthBytes: Int) {
        let utf8 = Array(s.utf8)
        if lengthBytes == 1 { u8(UInt8(truncatingIfNeeded: utf8.count)) } else { u16(UInt16(truncatingIfNeeded: utf8.count)) }
        bytes.append(contentsOf: utf8)
    }
}

/// Little-endian fields read from a payload whose checksum passed; a field that runs past the
/// end is `nil` (the caller names the block).
struct PayloadReader {
    let bytes: UnsafeRawBufferPointer
    var offset = 0

    init(_ bytes: UnsafeRawBufferPointer) { self.bytes = bytes }

    var atEnd: Bool { offset == bytes.count }

    mutating func take(_ n: Int) -> UnsafeRawBufferPointer? {
        guard n >= 0, n <= bytes.count - offset else { return nil }
        defer { offset += n }
        return UnsafeRawBufferPointer(rebasing: bytes[offset..<(offset + n)])
    }

    mutating func u8() -> UInt8? { take(1)?[0] }
    mutating func u16() -> UInt16? { take(2).map { UInt16(littleEndian: $0.loadUnaligned(as: UInt16.self)) } }
    mutating func u32() -> UInt32? { take(4).map { UInt32(littleEndian: $0.loadUnaligned(as: UInt32.self)) } }
    mutating func u64() -> UInt64? { take(8).map { UInt64(littleEndian: $0.loadUnaligned(as: UInt64.self)) } }
    mutating func text(lengthBytes: Int) -> String? {
        guard let n = lengthBytes == 1 ? u8().map(Int.init) : u16().map(Int.init), let raw = take(n) else { return nil }
        return String(validating: raw, as: UTF8.self)
    }
}

/// Reads a snapshot's blocks in order, each checked (see the file header).
final class SnapshotInput {
    let path: String
    private let fd: FileDescriptor
    let size: Int
    /// Where the next block begins.
    private(set) var offset = SnapshotFormat.magic.count
    private var buffer: UnsafeMutableRawBufferPointer
    /// The block whose header was read last, until its payload is read.
    private var pending: (kind: SnapshotFormat.Kind, length: Int, crc: UInt32, at: Int)? = nil

    /// Opens `path` and checks that it is a snapshot.
    init(path: String) throws(StorageError) {
        self.path = path
        let fd = try FileDescriptor.opening(path)
        self.fd = fd
        do throws(Errno) {
            size = try fd.size()
        } catch {
            try? fd.close()
            throw StorageError(error, "cannot stat \(path)")
        }
        buffer = .allocate(byteCount: 64 << 10, alignment: 16)
        fd.adviseSequential()
        var magic = [UInt8](repeating: 0, count: SnapshotFormat.magic.count)
        let n = try? magic.withMutableBytes { (raw) throws(Errno) in try fd.read(into: raw, at: 0) }
        guard n == magic.count, magic == SnapshotFormat.magic else {
            // Fully initialized: deinit closes and frees.
            throw StorageError(.corrupt, "\(path) is not an obsd snapshot (it does not begin with OBSDSNP1); refusing to start")
        }
    }

    deinit {
        try? fd.close()
        buffer.deallocate()
    }

    /// The next block's kind and payload length; its payload is read next (`payload()` or
    /// `payload(into:)`). Throws when the file ends before the end marker, or mid-block.
    func next() throws(StorageError) -> (kind: SnapshotFormat.Kind, length: Int, at: Int) {
        var header = (UInt32(0), UInt32(0), UInt32(0))
        guard offset + SnapshotFormat.blockHeader <= size else { throw torn(at: offset, needing: SnapshotFormat.blockHeader) }
        try readFully(&header, count: SnapshotFormat.blockHeader, at: offset)
        let (rawKind, rawLength, crc) = (UInt32(littleEndian: header.0), Int(UInt32(littleEndian: header.1)), UInt32(littleEndian: header.2))
        let at = offset
        guard let kind = SnapshotFormat.Kind(rawValue: rawKind) else {
            throw StorageError(.corrupt, "\(path) is damaged: the block at offset \(at) has an unknown kind (\(rawKind)); refusing to start")
        }
        guard at + SnapshotFormat.blockHeader + rawLength <= size else {
            throw torn(at: at, needing: SnapshotFormat.blockHeader + rawLength)
        }
        pending = (kind, rawLength, crc, at)
        offset = at + SnapshotFormat.blockHeader + rawLength
        return (kind, rawLength, at)
    }

    /// The pending block's payload, checked; valid until the next read.
    func payload() throws(StorageError) -> UnsafeRawBufferPointer {
        guard let block = pending else { return UnsafeRawBufferPointer(start: nil, count: 0) }
        if buffer.count < block.length {
            buffer.deallocate()
            buffer = .allocate(byteCount: max(block.length, buffer.count * 2), alignment: 16)
        }
        try payload(into: buffer.baseAddress!)
        return UnsafeRawBufferPointer(start: buffer.baseAddress, count: block.length)
    }

    /// Reads the pending block's payload into `memory` (room for its length), checked.
    func payload(into memory: UnsafeMutableRawPointer) throws(StorageError) {
        guard let block = pending else { return }
        pending = nil
        try readFully(memory, count: block.length, at: block.at + SnapshotFormat.blockHeader)
        let payload = UnsafeRawBufferPointer(start: memory, count: block.length)
        guard SnapshotFormat.checksum(kind: block.kind.rawValue, payload: payload) == block.crc else {
            throw StorageError(
                .corrupt,
                "\(path) is damaged: the \(block.kind.name) block at offset \(block.at) (\(block.length) bytes) fails its checksum; refusing to start rather than load a state other than the one stored"
            )
        }
    }

    /// An error for a block that breaks the format though its checksum passed.
    func malformed(_ at: Int, _ what: String) -> StorageError {
        StorageError(.corrupt, "\(path): the block at offset \(at) has a valid checksum but no meaning to this obsd (\(what)); refusing to start")
    }

    /// The payload of the block at `at`, read and checked (again); the block read next, or
    /// whose header was read last, stays the same. (The checkpointer reads a repository's
    /// TOMB blocks twice rather than hold them.)
    func payload(again at: Int) throws(StorageError) -> UnsafeRawBufferPointer {
        let resume = (offset, pending)
        defer { (offset, pending) = resume }
        offset = at
        _ = try next()
        return try payload()
    }

    /// Whether the file ends where the last block read ends.
    var atEnd: Bool { offset == size }

    private func torn(at: Int, needing: Int) -> StorageError {
        let how = at == size ? "it ends at byte \(size) without its end marker" : "it ends at byte \(size), inside the block at offset \(at)"
        return StorageError(
            .corrupt,
            "\(path) is torn: \(how) — written incompletely (a copy cut short, or a file system that lost its end); refusing to start")
    }

    private func readFully<T>(_ value: inout T, count: Int, at: Int) throws(StorageError) {
        try withUnsafeMutableBytes(of: &value) { raw in Result { () throws(StorageError) in try readFully(raw.baseAddress!, count: count, at: at) } }.get()
    }

    private func readFully(_ memory: UnsafeMutableRawPointer, count: Int, at: Int) throws(StorageError) {
        var done = 0
        while done < count {
            let n: Int
            do throws(Errno) {
                n = try fd.read(into: UnsafeMutableRawBufferPointer(start: memory + done, count: count - done), at: at + done)
            } catch {
                throw StorageError(error, "cannot read \(path) at offset \(at + done)")
            }
            guard n > 0 else { throw torn(at: at, needing: count) }
            done += n
        }
    }
}

/// Writes a snapshot's blocks to `obsd.snapshot.new` (see the file header).
final class SnapshotOutput {
    let path: String
    private let fd: FileDescriptor
    private var buffer: [UInt8] = []
    private(set) var written = 0

    /// Creates the file (replacing a leftover one).
    init(path: String) throws(StorageError) {
        self.path = path
        fd = try attempt("cannot create \(path)") { () throws(Errno) in
            try FilePath(path).open(.writeOnly, options: [.create, .truncate], permissions: .ownerReadWrite)
        }
        buffer.reserveCapacity(4 << 20)
        buffer.append(contentsOf: SnapshotFormat.magic)
    }

    deinit { try? fd.close() }

    /// This file's identity (see `SnapshotFormat.identity`).
    func identity() throws(StorageError) -> String { try SnapshotFormat.identity(of: fd, path: path) }

    /// Appends a block.
    func block(_ kind: SnapshotFormat.Kind, _ payload: UnsafeRawBufferPointer) throws(StorageError) {
        let crc = SnapshotFormat.checksum(kind: kind.rawValue, payload: payload)
        withUnsafeBytes(of: kind.rawValue.littleEndian) { buffer.append(contentsOf: $0) }
        withUnsafeBytes(of: UInt32(payload.count).littleEndian) { buffer.append(contentsOf: $0) }
        withUnsafeBytes(of: crc.littleEndian) { buffer.append(contentsOf: $0) }
        buffer.append(contentsOf: payload)
        if buffer.count >= 4 << 20 { try flush() }
    }

    func block(_ kind: SnapshotFormat.Kind, _ payload: [UInt8]) throws(StorageError) {
        try payload.withUnsafeBytes { raw in Result { () throws(StorageError) in try block(kind, raw) } }.get()
    }

    /// Writes what is buffered, then makes the file durable.
    func sync() throws(StorageError) {
        try flush()
        try attempt("cannot sync \(path)") { () throws(Errno) in try fd.dataSync() }
    }

    private func flush() throws(StorageError) {
        if let failure = buffer.withUnsafeBytes({ fd.writeAll($0, at: written) }) {
            throw StorageError(failure.errno, "cannot write \(path) at offset \(written + failure.written)")
        }
        written += buffer.count
        buffer.removeAll(keepingCapacity: true)
    }
}
