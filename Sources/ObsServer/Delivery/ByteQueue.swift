// ObsServer — a connection's unsent bytes: one growable buffer, appended at the end, sent
// from the front. Replies and events are encoded straight into it (it is a `JSONSink`); a
// `send` takes what the socket accepts and the rest waits. Its storage is reused, so a
// connection that keeps up allocates nothing per message.

import CLinux
import ObsValues

#if canImport(Glibc)
import Glibc
#endif

struct ByteQueue: JSONSink {
    private(set) var storage: [UInt8] = []
    /// Bytes before this offset were sent.
    private var start = 0

    /// Bytes waiting to be sent.
    var count: Int { storage.count - start }
    var isEmpty: Bool { start == storage.count }

    /// Bytes ever appended (a position in the stream of everything this queue carried).
    private(set) var appended = 0

    @inlinable
    mutating func writeByte(_ byte: UInt8) {
        storage.append(byte)
        appended += 1
    }

    @inlinable
    mutating func writeBytes(_ bytes: UnsafeRawBufferPointer) {
        storage.append(contentsOf: bytes)
        appended += bytes.count
    }

    /// Appends another queue's unsent bytes.
    mutating func append(_ other: ByteQueue) {
        other.storage.withUnsafeBytes { writeBytes(UnsafeRawBufferPointer(rebasing: $0[other.start...])) }
    }

    /// What `send` did.
    enum Sent {
        /// Everything queued is sent (n bytes).
        case all(Int)
        /// The socket took `n` bytes and no more for now.
        case some(Int)
        /// The peer is gone or the socket failed (errno).
        case failed(Int32)
    }

    /// Sends what the socket takes.
    mutating func send(to fd: Int32) -> Sent {
        var sent = 0
        while start < storage.count {
            let n = storage.withUnsafeBytes { raw in obs_send(fd, raw.baseAddress! + start, UInt(raw.count - start)) }
            if n > 0 {
                start += n
                sent += n
                continue
            }
            let e = errno
            if n < 0 && e == EINTR { continue }
            if n < 0 && (e == EAGAIN || e == EWOULDBLOCK) {
                compact()
                return .some(sent)
            }
            return .failed(n < 0 ? e : EPIPE)
        }
        clear()
        return .all(sent)
    }

    /// Drops everything queued.
    mutating func clear() {
        storage.removeAll(keepingCapacity: storage.capacity <= 256 << 10)
        start = 0
    }

    /// Moves the unsent bytes to the front once the sent ones take most of the buffer.
    private mutating func compact() {
        if start >= 64 << 10, start * 2 >= storage.count {
            storage.removeFirst(start)
            start = 0
        }
    }

    /// Reads the unsent bytes (tests, and a write that moves them elsewhere).
    func withUnsentBytes<R>(_ body: (UnsafeRawBufferPointer) -> R) -> R {
        storage.withUnsafeBytes { body(UnsafeRawBufferPointer(rebasing: $0[start...])) }
    }
}
