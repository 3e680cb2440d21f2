// ObsStore — the system calls the write-ahead log creates, appends, syncs and cuts its
// segments with. Production uses the system's (`SystemFileOperations`, the default); a test
// hands the store its own to make one call fail on cue — a full disk at a segment
// roll-over, a cut that fails with EIO — which no real file system does deterministically.
// The store holds no test switch: only this dependency.

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

/// The calls of the log that can fail on a sick disk. Each behaves as the system call of
/// the same name: it returns what that returns and, on failure, sets `errno`.
protocol FileOperations: Sendable {
    func open(_ path: String, _ flags: Int32, _ mode: mode_t) -> Int32
    func pwrite(_ fd: Int32, _ buffer: UnsafeRawPointer, _ count: Int, _ offset: off_t) -> Int
    func fdatasync(_ fd: Int32) -> Int32
    func ftruncate(_ fd: Int32, _ length: off_t) -> Int32
}

/// The system calls themselves.
struct SystemFileOperations: FileOperations {
    func open(_ path: String, _ flags: Int32, _ mode: mode_t) -> Int32 { Glibc.open(path, flags, mode) }
    func pwrite(_ fd: Int32, _ buffer: UnsafeRawPointer, _ count: Int, _ offset: off_t) -> Int { Glibc.pwrite(fd, buffer, count, offset) }
    func fdatasync(_ fd: Int32) -> Int32 { Glibc.fdatasync(fd) }
    func ftruncate(_ fd: Int32, _ length: off_t) -> Int32 { Glibc.ftruncate(fd, length) }
}

extension FileOperations {
    /// Writes all of `bytes` at `offset` (retrying after EINTR and short writes); the number
    /// of bytes written before a failure, with `errno`, or nil when all were.
    func writeAll(_ fd: Int32, _ bytes: UnsafeRawBufferPointer, at offset: Int) -> (written: Int, errno: Int32)? {
        var written = 0
        while written < bytes.count {
            let n = pwrite(fd, bytes.baseAddress! + written, bytes.count - written, off_t(offset + written))
            if n < 0 {
                if errno == EINTR { continue }
                return (written, errno)
            }
            // A regular file never takes zero bytes of a non-empty write but when it is full.
            if n == 0 { return (written, ENOSPC) }
            written += n
        }
        return nil
    }
}
