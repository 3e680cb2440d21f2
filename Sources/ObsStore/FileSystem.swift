// ObsStore — the store's file system calls, all of them: every other file of the module
// opens, reads, writes, syncs, cuts, maps, lists, renames and removes files through what is
// here, in swift-system's terms (`FileDescriptor`, `FilePath`, `Errno`). Where swift-system
// has the call it is used (open, close, pread, pwrite, ftruncate, lseek, fstat), its untyped
// throw made `throws(Errno)`; the Linux calls swift-system 1.8.1 lacks — fdatasync, fsync,
// posix_fallocate, posix_fadvise, flock, mkdir, unlink, rename, access, opendir/readdir,
// mmap, and CLinux's statx identity and sync_file_range — are wrapped once each below. Each
// throws the `Errno` of its failure (no other file of the module reads `errno`), retrying
// EINTR where the call may be interrupted and calling it again is safe. `StorageError` says
// what an `Errno` means to the store (StorageError.swift). The write-ahead log's calls that
// a test fails on cue go through `FileOperations` (FileOperations.swift), whose system
// implementation calls these.

import CLinux
import SystemPackage

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

/// `body`'s result, its throw typed (swift-system's calls throw only `Errno`).
@inline(__always)
private func typed<T>(_ body: () throws -> T) throws(Errno) -> T {
    do {
        return try body()
    } catch let error as Errno {
        throw error
    } catch {
        throw Errno.ioError  // never: swift-system throws nothing else
    }
}

/// The result of a system call that returns -1 and sets `errno` when it fails, called again
/// after EINTR.
@inline(__always)
private func retrying<T: FixedWidthInteger>(_ call: () -> T) throws(Errno) -> T {
    while true {
        let result = call()
        if result != -1 { return result }
        let error = Errno(rawValue: errno)
        if error != .interrupted { throw error }
    }
}

/// A system call that returns 0, or -1 and sets `errno`, called once.
@inline(__always)
private func once(_ call: () -> Int32) throws(Errno) {
    if call() != 0 { throw Errno(rawValue: errno) }
}

/// A write that stopped before its end: the bytes it wrote, and why it stopped.
struct PartialWrite {
    let written: Int
    let errno: Errno
}

/// Writes all of `bytes` at `offset` with `write` (one pwrite, returning the bytes it wrote),
/// again after EINTR and after a short write: nil when all were written. A regular file takes
/// no byte of a non-empty write only when it is full: that stops it with ENOSPC.
@inline(__always)
func writeFully(
    _ bytes: UnsafeRawBufferPointer, at offset: Int, _ write: (UnsafeRawBufferPointer, Int64) throws(Errno) -> Int
) -> PartialWrite? {
    var written = 0
    while written < bytes.count {
        let n: Int
        do throws(Errno) {
            n = try write(UnsafeRawBufferPointer(rebasing: bytes[written...]), Int64(offset + written))
        } catch {
            if error == .interrupted { continue }
            return PartialWrite(written: written, errno: error)
        }
        if n == 0 { return PartialWrite(written: written, errno: .noSpace) }
        written += n
    }
    return nil
}

extension Array where Element == UInt8 {
    /// `withUnsafeMutableBytes`, `body`'s typed throw kept (the standard library's rethrows
    /// it as `any Error`).
    mutating func withMutableBytes<R, E: Error>(_ body: (UnsafeMutableRawBufferPointer) throws(E) -> R) throws(E) -> R {
        try withUnsafeMutableBytes { raw in Result { () throws(E) in try body(raw) } }.get()
    }
}

extension FilePath {
    /// Opens the file, close-on-exec; `permissions` for a file `options` create.
    func open(
        _ mode: FileDescriptor.AccessMode, options: FileDescriptor.OpenOptions = [], permissions: FilePermissions = .ownerReadWrite
    ) throws(Errno) -> FileDescriptor {
        try typed { try FileDescriptor.open(self, mode, options: options.union(.closeOnExec), permissions: permissions) }
    }

    /// Creates the directory (mkdir).
    func createDirectory(permissions: FilePermissions) throws(Errno) {
        try once { withCString { mkdir($0, permissions.rawValue) } }
    }

    /// Removes the file (unlink).
    func remove() throws(Errno) {
        try once { withCString { unlink($0) } }
    }

    /// Renames the file to `target`, replacing what is there.
    func rename(to target: FilePath) throws(Errno) {
        try once { withCString { from in target.withCString { to in Glibc.rename(from, to) } } }
    }

    /// Whether anything is at the path (access F_OK).
    var exists: Bool { withCString { access($0, F_OK) } == 0 }

    /// The file's size (stat).
    func size() throws(Errno) -> Int { Int(try stat().size) }

    /// The names in the directory (opendir, readdir), `.` and `..` with them.
    func entries() throws(Errno) -> [String] {
        guard let dir = withCString({ opendir($0) }) else { throw Errno(rawValue: errno) }
        defer { closedir(dir) }
        var names: [String] = []
        while let entry = readdir(dir) {
            names.append(withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) })
        }
        return names
    }

    /// Up to `limit` bytes from the start of the file, with one read — for the small files a
    /// daemon writes with one write, and those of /proc (whose size says nothing).
    func readPrefix(_ limit: Int) throws(Errno) -> [UInt8] {
        let fd = try open(.readOnly)
        defer { try? fd.close() }
        var bytes = [UInt8](repeating: 0, count: limit)
        let n = try bytes.withMutableBytes { (raw) throws(Errno) in try fd.read(into: raw, at: 0) }
        return Array(bytes[..<n])
    }
}

extension FileDescriptor {
    /// Reads into `buffer` at `offset` with one pread (again after EINTR): the bytes read, 0
    /// at the end of the file.
    func read(into buffer: UnsafeMutableRawBufferPointer, at offset: Int) throws(Errno) -> Int {
        try typed { try read(fromAbsoluteOffset: Int64(offset), into: buffer) }
    }

    /// Reads into `buffer` at `offset` until it is full or the file ends: the bytes read.
    func readFully(into buffer: UnsafeMutableRawBufferPointer, at offset: Int) throws(Errno) -> Int {
        var done = 0
        while done < buffer.count {
            let n = try read(into: UnsafeMutableRawBufferPointer(rebasing: buffer[done...]), at: offset + done)
            if n == 0 { break }
            done += n
        }
        return done
    }

    /// The file's first `count` bytes: EIO when it ends before.
    func read(count: Int) throws(Errno) -> [UInt8] {
        var bytes = [UInt8](repeating: 0, count: count)
        let n = try bytes.withMutableBytes { (raw) throws(Errno) in try readFully(into: raw, at: 0) }
        guard n == count else { throw .ioError }
        return bytes
    }

    /// Writes `bytes` at `offset` with one pwrite (again after EINTR): the bytes written.
    func write(_ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(Errno) -> Int {
        try typed { try write(toAbsoluteOffset: offset, bytes) }
    }

    /// Writes all of `bytes` at `offset` (`writeFully`): nil when all were written.
    func writeAll(_ bytes: UnsafeRawBufferPointer, at offset: Int) -> PartialWrite? {
        writeFully(bytes, at: offset) { (bytes, offset) throws(Errno) in try write(bytes, at: offset) }
    }

    /// Cuts (or extends) the file to `length` bytes (ftruncate, again after EINTR).
    func truncate(to length: Int64) throws(Errno) {
        try typed { try resize(to: length) }
    }

    /// Makes the file's data durable (fdatasync, again after EINTR).
    func dataSync() throws(Errno) {
        _ = try retrying { fdatasync(rawValue) }
    }

    /// Makes the file — or the directory: its entries — durable (fsync, again after EINTR).
    func sync() throws(Errno) {
        _ = try retrying { fsync(rawValue) }
    }

    /// The file's size (fstat).
    func size() throws(Errno) -> Int { Int(try stat().size) }

    /// Allocates `count` bytes of the file from `offset` (posix_fallocate, again after EINTR),
    /// growing it if it is shorter.
    func preallocate(at offset: Int, count: Int) throws(Errno) {
        while true {
            let code = posix_fallocate(rawValue, off_t(offset), off_t(count))  // the errno itself, not -1
            if code == 0 { return }
            if code != EINTR { throw Errno(rawValue: code) }
        }
    }

    /// Tells the kernel the file is read from start to end (posix_fadvise; a hint).
    func adviseSequential() {
        _ = posix_fadvise(rawValue, 0, 0, POSIX_FADV_SEQUENTIAL)
    }

    /// Starts writing back `count` bytes from `offset` without waiting (sync_file_range; a hint).
    func startWriteback(at offset: Int, count: Int) {
        _ = obs_start_writeback(rawValue, Int64(offset), Int64(count))
    }

    /// Takes the file's exclusive lock, failing rather than waiting while another holds it
    /// (flock LOCK_EX | LOCK_NB).
    func lockExclusively() throws(Errno) {
        _ = try retrying { flock(rawValue, LOCK_EX | LOCK_NB) }
    }

    /// Which file this is — its inode and, where the file system keeps it, its birth time
    /// (statx) — as the store records it: `<inode>:<birth seconds>.<birth nanoseconds>`, the
    /// birth left empty where unknown. A copy of the file, or a restored backup, has another.
    func identity() throws(Errno) -> String {
        var id = obs_file_identity()
        try once { obs_file_identity_of(rawValue, &id) }
        return id.has_birth != 0 ? "\(id.inode):\(id.birth_seconds).\(id.birth_nanoseconds)" : "\(id.inode):"
    }

    /// Where the file's data ends when nothing but a hole follows it (unwritten,
    /// preallocated space reads as one): the file's first hole, if no data lies after it;
    /// else `size` (lseek SEEK_HOLE, SEEK_DATA).
    func endOfData(size: Int) -> Int {
        let hole = SeekOrigin(rawValue: 4), data = SeekOrigin(rawValue: 3)  // SEEK_HOLE, SEEK_DATA (Linux)
        guard let start = try? typed({ try seek(offset: 0, from: hole) }), start >= 0, start < size else { return size }
        do throws(Errno) {
            _ = try typed { try seek(offset: start, from: data) }
            return size
        } catch {
            return error == .noSuchAddressOrDevice ? Int(start) : size  // ENXIO: no data after it
        }
    }

    /// The file's first `count` bytes mapped read-only and populated (mmap); `unmap` them.
    func map(count: Int) throws(Errno) -> UnsafeRawBufferPointer {
        let mapped = mmap(nil, count, PROT_READ, MAP_PRIVATE | MAP_POPULATE, rawValue, 0)
        guard let mapped, mapped != MAP_FAILED else { throw Errno(rawValue: errno) }
        return UnsafeRawBufferPointer(start: mapped, count: count)
    }

    /// Unmaps what `map` mapped.
    static func unmap(_ bytes: UnsafeRawBufferPointer) {
        if let base = bytes.baseAddress { munmap(UnsafeMutableRawPointer(mutating: base), bytes.count) }
    }
}
