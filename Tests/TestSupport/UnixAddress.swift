// Test support: binding and connecting Unix-domain sockets by path.

import Foundation

#if canImport(Glibc)
import Glibc
#endif

/// Runs `call` (`bind` or `connect`) on `fd` with the `sockaddr_un` of `path`; returns its result.
public func withUnixAddress(
    _ path: String, _ fd: Int32, _ call: (Int32, UnsafePointer<sockaddr>, socklen_t) -> Int32
) -> Int32 {
    var address = sockaddr_un()
    address.sun_family = sa_family_t(AF_UNIX)
    let bytes = Array(path.utf8)
    precondition(bytes.count < MemoryLayout.size(ofValue: address.sun_path), "socket path too long for a test: \(path)")
    withUnsafeMutableBytes(of: &address.sun_path) { raw in
        raw.copyBytes(from: bytes)
        raw[bytes.count] = 0
    }
    return withUnsafePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { call(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
    }
}
