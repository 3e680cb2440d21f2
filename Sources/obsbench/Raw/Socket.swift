// obsbench — Unix-domain stream sockets without a framework: connect (blocking, so a full
// listen backlog waits instead of failing), then non-blocking for the event loop; and a
// blocking request/reply for the odd side question (obsd `stats`).

#if canImport(Glibc)
import Glibc
#endif

enum RawSocket {
    /// A connected socket to `path`, blocking; closed by the caller.
    static func connect(_ path: String) throws(BenchError) -> Int32 {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw BenchError("socket: \(errnoText())") }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        let fits = withUnsafeMutableBytes(of: &address.sun_path) { raw -> Bool in
            guard bytes.count < raw.count else { return false }
            raw.copyBytes(from: bytes)
            raw[bytes.count] = 0
            return true
        }
        guard fits else {
            close(fd)
            throw BenchError("socket path too long: \(path)")
        }
        let length = socklen_t(MemoryLayout<sockaddr_un>.size)
        var result: Int32
        repeat {
            result = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, length) }
            }
        } while result != 0 && errno == EINTR
        guard result == 0 else {
            let text = errnoText()
            close(fd)
            throw BenchError("connect \(path): \(text)")
        }
        return fd
    }

    static func setNonBlocking(_ fd: Int32) throws(BenchError) {
        let flags = fcntl(fd, F_GETFL)
        guard flags >= 0, fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0 else { throw BenchError("fcntl: \(errnoText())") }
    }

    /// Writes all of `bytes` to a blocking socket.
    static func writeAll(_ fd: Int32, _ bytes: [UInt8]) throws(BenchError) {
        var done = 0
        while done < bytes.count {
            let n = bytes.withUnsafeBytes { send(fd, $0.baseAddress! + done, $0.count - done, Int32(MSG_NOSIGNAL)) }
            if n < 0 && errno == EINTR { continue }
            guard n > 0 else { throw BenchError("write: \(errnoText())") }
            done += n
        }
    }

    /// Reads one line (without its newline) from a blocking socket, giving up after `seconds`.
    static func readLine(_ fd: Int32, seconds: Int = 10) throws(BenchError) -> [UInt8] {
        var timeout = timeval(tv_sec: seconds, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var line: [UInt8] = []
        var byte: UInt8 = 0
        while true {
            let n = read(fd, &byte, 1)
            if n < 0 && errno == EINTR { continue }
            guard n == 1 else { throw BenchError(n == 0 ? "the server closed the connection" : "read: \(errnoText())") }
            if byte == 0x0A { return line }
            line.append(byte)
        }
    }
}

func errnoText(_ code: Int32 = errno) -> String {
    String(cString: strerror(code))
}
