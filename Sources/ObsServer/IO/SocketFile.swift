// ObsServer — the socket file on disk: preparing its path before binding, and removing
// it at shutdown.
//
// Before binding: create the parent directory if needed; refuse a path that exists and
// is not a socket; refuse to start if another daemon answers on it; remove a stale socket
// left by a daemon that died. Binding: under a staging name beside the path, given its mode
// and owner there, then renamed into place. After shutdown: remove the file only if it is still ours
// (same device and inode), never a successor's.

import ObsProtocol
import SystemPackage

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

/// The file operations here go through swift-system where it has them (`Stat`, `FilePath`,
/// typed `Errno`); the calls it lacks (mkdir, unlink, rename, chmod, chown) are checked by
/// `check`, which reads `errno` into the same `Errno`.
enum SocketFile {
    /// Identity of a file: device and inode.
    struct Identity: Equatable, Sendable {
        let device: UInt64
        let inode: UInt64
    }

    static func identity(of path: String) -> Identity? {
        guard let st = try? Stat(FilePath(path), followTargetSymlink: false) else { return nil }
        return Identity(device: UInt64(st.deviceID.rawValue), inode: UInt64(st.inode.rawValue))
    }

    /// Makes `path` ready to bind.
    static func prepare(_ path: String) throws(SocketPathError) {
        if let problem = SocketPath.problem(path) { throw SocketPathError(description: problem) }
        try makeParentDirectory(of: FilePath(path))
        let st: Stat
        do {
            st = try Stat(FilePath(path), followTargetSymlink: false)
        } catch .noSuchFileOrDirectory {
            return
        } catch {
            throw SocketPathError(description: "cannot inspect \(path): \(error)")
        }
        guard st.type == .socket else {
            throw SocketPathError(description: "\(path) exists and is not a socket; refusing to replace it")
        }
        if isAnswering(path) {
            throw SocketPathError(description: "another obsd is already serving \(path); stop it first, or choose another --socket")
        }
        try check(unlink(path), allowing: .noSuchFileOrDirectory) { "cannot remove the stale socket \(path)" }
    }

    /// Removes the socket file if it is still the one identified by `identity`.
    static func remove(_ path: String, ifStill identity: Identity?) {
        guard let identity, self.identity(of: path) == identity else { return }
        unlink(path)
    }

    /// Sets the socket file's permission bits and, when given, its owner and group.
    static func setOwnership(_ path: String, mode: UInt32, owner: UInt32?, group: UInt32?) throws(SocketPathError) {
        if owner != nil || group != nil {
            // -1 (uid_t.max) leaves that half unchanged.
            try check(chown(path, owner ?? uid_t.max, group ?? gid_t.max)) {
                "cannot set the owner of \(path) to \(owner.map(String.init) ?? "-"):\(group.map(String.init) ?? "-")"
            }
        }
        try check(chmod(path, mode_t(mode))) { "cannot set mode \(String(mode, radix: 8)) on \(path)" }
    }

    /// A name beside `path` to bind under before the socket has its mode and owner (nil if
    /// it would not fit a socket address: then `path` is bound and set up in place).
    static func stagingPath(for path: String) -> String? {
        var staging = FilePath(path)
        guard let name = staging.lastComponent else { return nil }
        staging.removeLastComponent()
        staging.append(".\(name).\(getpid()).binding")
        let text = staging.string
        return text.utf8.count <= 107 ? text : nil
    }

    /// Renames the set-up socket at `staging` to `path` (atomic: a client sees no socket, or
    /// this one with its final mode and owner).
    static func moveIntoPlace(_ staging: String, _ path: String) throws(SocketPathError) {
        do throws(SocketPathError) {
            try check(rename(staging, path)) { "cannot move the socket from \(staging) to \(path)" }
        } catch {
            unlink(staging)
            throw error
        }
    }

    /// Removes a staging socket that will not be moved into place.
    static func discard(_ staging: String) { unlink(staging) }

    /// Creates the directories above `path` that do not exist yet (mode 0755).
    private static func makeParentDirectory(of path: FilePath) throws(SocketPathError) {
        let parent = path.removingLastComponent()
        var current = FilePath(root: parent.root)
        for component in parent.components {
            current.append(component)
            let directory = current.string
            try check(mkdir(directory, 0o755), allowing: .fileExists) { "cannot create directory \(directory) for the socket" }
        }
    }

    /// Throws, with `errno` as a typed `Errno` after `what`, when a system call returned
    /// other than 0 — unless the error is `allowed`.
    private static func check(_ result: Int32, allowing allowed: Errno? = nil, _ what: () -> String) throws(SocketPathError) {
        guard result != 0 else { return }
        let error = Errno(rawValue: errno)
        if error == allowed { return }
        throw SocketPathError(description: "\(what()): \(error)")
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
}
