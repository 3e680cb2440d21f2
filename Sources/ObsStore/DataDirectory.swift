// ObsStore — the data directory: where it is by default, and the lock that keeps two
// daemons from ever sharing one store.

import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// The data directory's location and exclusive lock.
public enum DataDirectory {
    /// The default data directory: `$STATE_DIRECTORY` under systemd (its first entry);
    /// else `/var/lib/obsd` for root; else `$XDG_STATE_HOME/obsd`, else `$HOME/.local/state/obsd`.
    public static func defaultPath(environment: [String: String], uid: UInt32 = getuid()) -> String? {
        if let state = environment["STATE_DIRECTORY"], let first = state.split(separator: ":").first {
            return String(first)
        }
        if uid == 0 { return "/var/lib/obsd" }
        if let xdg = environment["XDG_STATE_HOME"], xdg.hasPrefix("/") { return xdg + "/obsd" }
        if let home = environment["HOME"], home.hasPrefix("/") { return home + "/.local/state/obsd" }
        return nil
    }

    /// Creates `path` (and its parents) if needed, mode 0700 for the last component.
    static func create(_ path: String) throws(StorageError) {
        var current = path.hasPrefix("/") ? "" : "."
        let parts = path.split(separator: "/")
        for (i, part) in parts.enumerated() {
            current += "/" + part
            let mode: mode_t = i == parts.count - 1 ? 0o700 : 0o755
            if mkdir(current, mode) != 0 && errno != EEXIST {
                throw StorageError(.readOnly, "cannot create data directory \(current): \(String(cString: strerror(errno)))")
            }
        }
    }
}

/// An exclusive `flock` on `<dir>/obsd.lock`, holding the owner's pid; held until
/// `release` (or deinit).
final class DirectoryLock: Sendable {
    private let fd: Locked<Int32>

    init(directory: String) throws(StorageError) {
        let path = directory + "/obsd.lock"
        let fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        guard fd >= 0 else {
            throw StorageError(.readOnly, "cannot open \(path): \(String(cString: strerror(errno)))")
        }
        guard flock(fd, LOCK_EX | LOCK_NB) == 0 else {
            var buffer = [UInt8](repeating: 0, count: 32)
            let n = read(fd, &buffer, buffer.count)
            let owner = n > 0 ? String(decoding: buffer[..<n], as: UTF8.self).trimmingWhitespace : "?"
            close(fd)
            throw StorageError(.locked, "data directory \(directory) is in use by another obsd (pid \(owner))")
        }
        let pid = "\(getpid())\n"
        _ = ftruncate(fd, 0)
        _ = pid.withCString { pwrite(fd, $0, strlen($0), 0) }
        self.fd = Locked(fd)
    }

    /// Lets another store open the directory. Idempotent.
    func release() {
        fd.withLock { fd in
            if fd >= 0 { close(fd) }
            fd = -1
        }
    }

    deinit { release() }
}

extension String {
    var trimmingWhitespace: String {
        String(self.drop { $0.isWhitespace }.reversed().drop { $0.isWhitespace }.reversed())
    }
}
