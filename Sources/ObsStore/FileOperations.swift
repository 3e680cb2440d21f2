// ObsStore — the system calls the write-ahead log creates, appends, syncs and cuts its
// segments with. Production uses the system's (`SystemFileOperations`, the default: the
// calls of FileSystem.swift); a test hands the store its own to make one call fail on cue —
// a full disk at a segment roll-over, a cut that fails with EIO — which no real file system
// does deterministically. The store holds no test switch: only this dependency.

import SystemPackage

/// The calls of the log that can fail on a sick disk. Each behaves as the system call it
/// names (open, pwrite, fdatasync, ftruncate): it returns what that returns and, on failure,
/// throws the `Errno` it sets.
protocol FileOperations: Sendable {
    func open(
        _ path: FilePath, _ mode: FileDescriptor.AccessMode, options: FileDescriptor.OpenOptions, permissions: FilePermissions
    ) throws(Errno) -> FileDescriptor
    /// One pwrite of `bytes` at `offset`: the bytes written.
    func write(_ fd: FileDescriptor, _ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(Errno) -> Int
    func fdatasync(_ fd: FileDescriptor) throws(Errno)
    /// ftruncate.
    func truncate(_ fd: FileDescriptor, to length: Int64) throws(Errno)
}

/// The system calls themselves.
struct SystemFileOperations: FileOperations {
    func open(
        _ path: FilePath, _ mode: FileDescriptor.AccessMode, options: FileDescriptor.OpenOptions, permissions: FilePermissions
    ) throws(Errno) -> FileDescriptor {
        try path.open(mode, options: options, permissions: permissions)
    }

    func write(_ fd: FileDescriptor, _ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(Errno) -> Int {
        try fd.write(bytes, at: offset)
    }

    func fdatasync(_ fd: FileDescriptor) throws(Errno) { try fd.dataSync() }

    func truncate(_ fd: FileDescriptor, to length: Int64) throws(Errno) { try fd.truncate(to: length) }
}

extension FileOperations {
    /// Writes all of `bytes` at `offset` with `write` (`writeFully`: again after EINTR and
    /// short writes): nil when all were written, else how far it got and why not further.
    func writeAll(_ fd: FileDescriptor, _ bytes: UnsafeRawBufferPointer, at offset: Int) -> PartialWrite? {
        writeFully(bytes, at: offset) { (bytes, offset) throws(Errno) in try write(fd, bytes, at: offset) }
    }
}
