// ObsServer — the socket file on disk: preparing its path before binding, and removing
// it at shutdown.
//
// Before binding: create the parent directory if needed; refuse a path that exists and
// is not a socket; refuse to start if another daemon answers on it; remove a stale socket
// left by a daemon that died. Binding: under a staging name beside the path, given its mode
// and owner there, then renamed into place. After shutdown: remove the file only if it is still ours
// (same device and inode), never a successor's.

import ObsProtocol

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// Why the daemon cannot use its socket path.
public struct SocketPathError: Error, CustomStringConvertible, Sendable {
    public let description: String
}

enum SocketFile {
    /// Identity of a file: device and inode.
    struct Identity: Equatable, Sendable {
        let device: UInt64
        let inode: UInt64
    }

    static func identity(of path: String) -> Identity? {
        var st = stat()
        guard lstat(path, &st) == 0 else { return nil }
        return Identity(device: UInt64(st.st_dev), inode: UInt64(st.st_ino))
    }

    /// Makes `path` ready to bind.
    static func prepare(_ path: String) throws {
        if let problem = SocketPath.problem(path) { throw SocketPathError(description: problem) }
        try makeParentDirectory(of: path)
        var st = stat()
        guard lstat(path, &st) == 0 else {
            if errno == ENOENT { return }
            throw SocketPathError(description: "cannot inspect \(path): \(errnoText())")
        }
        guard (st.st_mode & S_IFMT) == S_IFSOCK else {
            throw SocketPathError(description: "\(path) exists and is not a socket; refusing to replace it")
        }
        if isAnswering(path) {
            throw SocketPathError(description: "another obsd is already serving \(path); stop it first, or choose another --socket")
        }
        guard unlink(path) == 0 || errno == ENOENT else {
            throw SocketPathError(description: "cannot remove the stale socket \(path): \(errnoText())")
        }
    }

    /// Removes the socket file if it is still the one identified by `identity`.
    static func remove(_ path: String, ifStill identity: Identity?) {
        guard let identity, self.identity(of: path) == identity else { return }
        unlink(path)
    }

    /// Sets the socket file's permission bits and, when given, its owner and group.
    static func setOwnership(_ path: String, mode: UInt32, owner: UInt32?, group: UInt32?) throws {
        if owner != nil || group != nil {
            // -1 (uid_t.max) leaves that half unchanged.
            guard chown(path, owner ?? uid_t.max, group ?? gid_t.max) == 0 else {
                throw SocketPathError(
                    description: "cannot set the owner of \(path) to \(owner.map(String.init) ?? "-"):\(group.map(String.init) ?? "-"): \(errnoText())")
            }
        }
        guard chmod(path, mode_t(mode)) == 0 else {
            throw SocketPathError(description: "cannot set mode \(String(mode, radix: 8)) on \(path): \(errnoText())")
        }
    }

    /// A name beside `path` to bind under before the socket has its mode and owner (nil if
    /// it would not fit a socket address: then `path` is bound and set up in place).
    static func stagingPath(for path: String) -> String? {
        let slash = path.lastIndex(of: "/")
        let directory = slash.map { String(path[...$0]) } ?? ""
        let name = slash.map { String(path[path.index(after: $0)...]) } ?? path
        let staging = directory + ".\(name).\(getpid()).binding"
        return staging.utf8.count <= 107 ? staging : nil
    }

    /// Renames the set-up socket at `staging` to `path` (atomic: a client sees no socket, or
    /// this one with its final mode and owner).
    static func moveIntoPlace(_ staging: String, _ path: String) throws {
        guard rename(staging, path) == 0 else {
            let error = SocketPathError(description: "cannot move the socket from \(staging) to \(path): \(errnoText())")
            unlink(staging)
            throw error
        }
    }

    /// Removes a staging socket that will not be moved into place.
    static func discard(_ staging: String) { unlink(staging) }

    private static func makeParentDirectory(of path: String) throws {
        guard let slash = path.lastIndex(of: "/"), slash != path.startIndex else { return }
        var current = path.hasPrefix("/") ? "" : "."
        for part in path[..<slash].split(separator: "/") {
            current += "/" + part
            if mkdir(current, 0o755) != 0 && errno != EEXIST {
                throw SocketPathError(description: "cannot create directory \(current) for the socket: \(errnoText())")
            }
        }
    }

    /// Whether a daemon accepts connections on `path`.
    private static func isAnswering(_ path: String) -> Bool {
        #if canImport(Darwin)
        let fd = socket(AF_UNIX, SOCK_STREAM, 0)
        #else
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        #endif
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            let bytes = Array(path.utf8.prefix(raw.count - 1))
            raw.copyBytes(from: bytes)
            raw[bytes.count] = 0
        }
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size))
            }
        }
        return result == 0
    }

    static func errnoText() -> String {
        String(cString: strerror(errno))
    }
}
