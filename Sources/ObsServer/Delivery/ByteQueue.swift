// ObsServer — a connection's unsent bytes: one growable buffer, appended at the end, sent
// from the front. Replies and events are encoded straight into it (it is a `JSONSink`); a
// `send` takes what the socket accepts and the rest waits. Its memory is its own (noncopyable:
// no copy-on-write checks, no reference counting per write) and reused, so a connection that
// keeps up allocates nothing per message.

import CLinux
import ObsValues

#if canImport(Glibc)
import Glibc
#endif

struct ByteQueue: JSONSink, ~Copyable {
    private var base: UnsafeMutableRawPointer?
    private var capacity = 0
    /// Bytes before `start` were sent; bytes up to `end` are written.
    private var start = 0
    private var end = 0
    /// Bytes ever appended (a position in the stream of everything this queue carried).
    private(set) var appended = 0

    init() {}

    deinit { base?.deallocate() }

    /// Bytes waiting to be sent.
    var count: Int { end - start }
    var isEmpty: Bool { start == end }

    @inline(__always)
    mutating func writeByte(_ byte: UInt8) {
        if end == capacity { grow(1) }
        base.unsafelyUnwrapped.storeBytes(of: byte, toByteOffset: end, as: UInt8.self)
        end += 1
        appended += 1
    }

    @inline(__always)
    mutating func writeBytes(_ bytes: UnsafeRawBufferPointer) {
        let n = bytes.count
        guard n > 0 else { return }
        if end + n > capacity { grow(n) }
        (base.unsafelyUnwrapped + end).copyMemory(from: bytes.baseAddress.unsafelyUnwrapped, byteCount: n)
        end += n
        appended += n
    }

    /// Makes room for `n` more bytes: moves the unsent bytes to the front, or doubles.
    @inline(never)
    private mutating func grow(_ n: Int) {
        let unsent = end - start
        if let base, start > 0, unsent + n <= capacity / 2 {
            base.copyMemory(from: base + start, byteCount: unsent)
        } else {
            let size = max(1024, (unsent + n) * 2)
            let fresh = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: 16)
            if let base {
                fresh.copyMemory(from: base + start, byteCount: unsent)
                base.deallocate()
            }
            base = fresh
            capacity = size
        }
        start = 0
        end = unsent
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
        while start < end {
            let n = obs_send(fd, base.unsafelyUnwrapped + start, UInt(end - start))
            if n > 0 {
                start += n
                sent += n
                continue
            }
            let e = errno
            if n < 0 && e == EINTR { continue }
            if n < 0 && (e == EAGAIN || e == EWOULDBLOCK) { return .some(sent) }
            return .failed(n < 0 ? e : EPIPE)
        }
        clear()
        return .all(sent)
    }

    /// Drops everything queued (a large buffer a burst left behind is freed).
    mutating func clear() {
        start = 0
        end = 0
        if capacity > 256 << 10 {
            base?.deallocate()
            base = nil
            capacity = 0
        }
    }

    /// Exchanges this queue's memory with `other`'s; both must be empty. What each queue
    /// `appended` stays with it (a position in its own stream, not in its memory).
    mutating func exchangeMemory(with other: inout ByteQueue) {
        precondition(isEmpty && other.isEmpty, "memory exchanged with bytes in it")
        swap(&base, &other.base)
        swap(&capacity, &other.capacity)
        start = 0
        end = 0
        other.start = 0
        other.end = 0
    }

    /// Reads the unsent bytes.
    func withUnsentBytes<R>(_ body: (UnsafeRawBufferPointer) -> R) -> R {
        body(UnsafeRawBufferPointer(start: base.map { $0 + start }, count: end - start))
    }
}
