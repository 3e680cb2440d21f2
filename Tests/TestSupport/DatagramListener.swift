// Test support shared by test targets: a datagram socket standing in for systemd's
// notify or journal socket, which notes when the kernel queued each datagram (so a test of a
// sender's cadence measures the sender, not how late a busy machine let the test read).

import Foundation

/// A datagram socket the test owns, bound at `path`.
public final class DatagramListener {
    public let path: String
    private let fd: Int32
    /// When the kernel queued the datagram `receive` returned last (`SO_TIMESTAMPNS`, the
    /// real-time clock), as time since the epoch; nil before the first.
    public private(set) var lastQueued: Duration?

    public init(path: String) throws {
        self.path = path
        unlink(path)
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        let rc = withUnixAddress(path, fd) { bind($0, $1, $2) }
        guard rc == 0 else { throw CocoaError(.fileWriteUnknown) }
        setTimeout(.seconds(5))
        var on: Int32 = 1
        setsockopt(fd, SOL_SOCKET, Self.timestampOption, &on, socklen_t(MemoryLayout<Int32>.size))
    }

    /// `SO_TIMESTAMPNS` (= `SCM_TIMESTAMPNS`), which Glibc's headers define through a macro
    /// Swift does not import.
    private static let timestampOption: Int32 = 35

    deinit {
        close(fd)
        unlink(path)
    }

    private func setTimeout(_ timeout: Duration) {
        var tv = timeval(tv_sec: Int(timeout.components.seconds), tv_usec: Int(timeout.components.attoseconds / 1_000_000_000_000))
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
    }

    /// The next datagram (waits up to 5 s).
    public func receive() -> [UInt8]? {
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        // A control message: cmsghdr (size_t length, int level, int type) then a timespec.
        var control = [UInt8](repeating: 0, count: 64)
        let n = buffer.withUnsafeMutableBytes { data in
            control.withUnsafeMutableBytes { control in
                var vector = iovec(iov_base: data.baseAddress, iov_len: data.count)
                return withUnsafeMutablePointer(to: &vector) { vector in
                    var message = msghdr()
                    message.msg_iov = vector
                    message.msg_iovlen = 1
                    message.msg_control = control.baseAddress
                    message.msg_controllen = control.count
                    let n = recvmsg(fd, &message, 0)
                    if n >= 0, message.msg_controllen >= 16 + MemoryLayout<timespec>.size,
                        control.load(fromByteOffset: 8, as: Int32.self) == SOL_SOCKET,
                        control.load(fromByteOffset: 12, as: Int32.self) == Self.timestampOption
                    {
                        let queued = control.loadUnaligned(fromByteOffset: 16, as: timespec.self)
                        lastQueued = .seconds(queued.tv_sec) + .nanoseconds(queued.tv_nsec)
                    }
                    return n
                }
            }
        }
        return n >= 0 ? Array(buffer[..<n]) : nil
    }

    /// The next datagram as text, or nil after `timeout`.
    public func receiveText(timeout: Duration) -> String? {
        setTimeout(timeout)
        defer { setTimeout(.seconds(5)) }
        return receive().map { String(decoding: $0, as: UTF8.self) }
    }
}
