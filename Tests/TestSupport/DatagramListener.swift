// Test support shared by test targets: a datagram socket standing in for systemd's
// notify or journal socket.

import Foundation

/// A datagram socket the test owns, bound at `path`.
public final class DatagramListener {
    public let path: String
    private let fd: Int32

    public init(path: String) throws {
        self.path = path
        unlink(path)
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        let rc = withUnixAddress(path, fd) { bind($0, $1, $2) }
        guard rc == 0 else { throw CocoaError(.fileWriteUnknown) }
        setTimeout(.seconds(5))
    }

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
        let n = recv(fd, &buffer, buffer.count, 0)
        return n >= 0 ? Array(buffer[..<n]) : nil
    }

    /// The next datagram as text, or nil after `timeout`.
    public func receiveText(timeout: Duration) -> String? {
        setTimeout(timeout)
        defer { setTimeout(.seconds(5)) }
        return receive().map { String(decoding: $0, as: UTF8.self) }
    }
}
