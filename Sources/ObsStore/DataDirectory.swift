// ObsStore — the data directory: where it is by default, and the lock that keeps two
// daemons from ever sharing one store.

import Logging
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

extension DataDirectory {
    /// Makes the entries of `directory` (files created, renamed or removed) durable.
    static func sync(_ directory: String) throws(StorageError) {
        let fd = open(directory, O_RDONLY | O_CLOEXEC | O_DIRECTORY)
        guard fd >= 0 else { throw StorageError.from(errno, "cannot open \(directory)") }
        defer { close(fd) }
        if fsync(fd) != 0 { throw StorageError.from(errno, "cannot sync \(directory)") }
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

/// `obsd.run`: `running <boot id> <sync policy>` while a daemon uses the directory, removed
/// once it stopped cleanly (its snapshot then holds the whole log). With the snapshot's record
/// of its own identity, it is how a store decides whether it can vouch for its epochs: every
/// repository gets a new epoch when the snapshot is not the file this store wrote (a copy, a
/// restored backup), or when the last daemon stopped uncleanly under `sync = relaxed` and the
/// machine restarted since — the writes of its last sync interval may be gone.
enum RunMarker {
    static let fileName = "obsd.run"

    /// What the marker says (nil: absent, the last stop was clean or there was none).
    static func read(_ directory: String) -> String? {
        let fd = open(directory + "/" + fileName, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buffer = [UInt8](repeating: 0, count: 256)
        let n = Glibc.read(fd, &buffer, buffer.count)
        return n > 0 ? String(decoding: buffer[..<n], as: UTF8.self).trimmingWhitespace : ""
    }

    /// Why the epochs must be renewed, if they must (see the type's comment).
    static func renewal(snapshot path: String, identity: String, recorded: String, marker: String?) -> String? {
        if identity != recorded { return "\(path) is not the file this store last wrote (a copy, or a restored backup)" }
        if let marker, marker.hasPrefix("running "), marker.hasSuffix(" relaxed"), Provenance.bootID == "unknown" || !marker.contains(" \(Provenance.bootID) ") {
            return "the last obsd on \(path) stopped uncleanly under sync = relaxed and the machine restarted since: writes it acknowledged in its last sync interval may be lost"
        }
        return nil
    }

    /// Marks the directory in use, durably, before any write is taken.
    static func claim(_ directory: String, sync: SyncPolicy) throws(StorageError) {
        let path = directory + "/" + fileName
        let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw StorageError.from(errno, "cannot create \(path)") }
        defer { close(fd) }
        let text = "running \(Provenance.bootID) \(sync == .always ? "always" : "relaxed")\n"
        let written = text.withCString { write(fd, $0, strlen($0)) }
        guard written == text.utf8.count, fdatasync(fd) == 0 else { throw StorageError.from(errno, "cannot write \(path)") }
        try DataDirectory.sync(directory)
    }

    /// Marks the directory left cleanly.
    static func release(_ directory: String, logger: Logger) {
        let path = directory + "/" + fileName
        do throws(StorageError) {
            guard unlink(path) == 0 || errno == ENOENT else { throw StorageError.from(errno, "cannot remove \(path)") }
            try DataDirectory.sync(directory)
        } catch {
            logger.warning("cannot mark the data directory left cleanly; the next start treats this stop as unclean", metadata: ["error": "\(error.description)"])
        }
    }
}
