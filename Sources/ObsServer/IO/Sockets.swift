// ObsServer — the socket calls of the daemon's event loops, each with its errno turned into a
// `SocketError` that names what failed: creating, binding and listening on a Unix socket,
// accepting, reading, sending, peer credentials.

import CLinux

#if canImport(Glibc)
import Glibc
#endif

/// A socket call that failed: what was attempted, and the system's reason.
public struct SocketError: Error, Sendable, CustomStringConvertible {
    public let code: Int32
    public let description: String

    static func from(_ code: Int32, _ what: String) -> SocketError {
        SocketError(code: code, description: "\(what): \(String(cString: strerror(code)))")
    }
}

enum Sockets {
    /// A non-blocking, close-on-exec Unix stream socket bound to `path` (replacing a socket
    /// file there: callers pass a path they own) and listening.
    static func listen(on path: String, backlog: Int32 = 1024) throws(SocketError) -> Int32 {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw SocketError.from(errno, "cannot create a socket for \(path)") }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: address.sun_path) else {
            close(fd)
            throw SocketError(code: ENAMETOOLONG, description: "socket path \(path) is longer than a socket address holds")
        }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            raw.copyBytes(from: bytes)
            raw[bytes.count] = 0
        }
        unlink(path)
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        guard bound == 0 else {
            let e = errno
            close(fd)
            throw SocketError.from(e, "cannot bind \(path)")
        }
        guard Glibc.listen(fd, backlog) == 0 else {
            let e = errno
            close(fd)
            unlink(path)
            throw SocketError.from(e, "cannot listen on \(path)")
        }
        return fd
    }

    /// Prepares a socket systemd passed (already bound and listening): non-blocking.
    static func adopt(_ fd: Int32) throws(SocketError) {
        try setNonBlocking(fd)
    }

    static func setNonBlocking(_ fd: Int32) throws(SocketError) {
        let flags = fcntl(fd, F_GETFL)
        guard flags >= 0, fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0 else {
            throw SocketError.from(errno, "cannot make socket \(fd) non-blocking")
        }
    }

    /// The peer's credentials (SO_PEERCRED), as a daemon running as `daemonUID` sees them.
    static func peer(of fd: Int32, daemonUID: UInt32) -> Peer? {
        var uid: UInt32 = 0
        var gid: UInt32 = 0
        var pid: Int32 = 0
        guard obs_peer_credentials(fd, &uid, &gid, &pid) == 0 else { return nil }
        return Peer(uid: uid, gid: gid, pid: pid, daemonUID: daemonUID)
    }

    /// Sets the kernel's send buffer (tests use a small one to make a socket fill up).
    static func setSendBuffer(_ fd: Int32, bytes: Int32) {
        var size = bytes
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, socklen_t(MemoryLayout<Int32>.size))
    }
}
