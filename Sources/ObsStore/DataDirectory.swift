// ObsStore — the data directory: where it is by default, and the lock that keeps two
// daemons from ever sharing one store.

import Logging
import ObservableKit
import SystemPackage

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
            do throws(Errno) {
                try FilePath(current).createDirectory(permissions: FilePermissions(rawValue: i == parts.count - 1 ? 0o700 : 0o755))
            } catch where error != .fileExists {
                throw StorageError(error, "cannot create data directory \(current)", kind: .readOnly)
            } catch {}
        }
    }
}

extension DataDirectory {
    /// Makes the entries of `directory` (files created, renamed or removed) durable.
    static func sync(_ directory: String) throws(StorageError) {
        let fd = try attempt("cannot open \(directory)") { () throws(Errno) in try FilePath(directory).open(.readOnly, options: .directory) }
        defer { try? fd.close() }
        try attempt("cannot sync \(directory)") { () throws(Errno) in try fd.sync() }
    }
}

/// An exclusive `flock` on `<dir>/obsd.lock`, holding the owner's pid; held until
/// `release` (or deinit).
final class DirectoryLock: Sendable {
    /// The lock file, open while the lock is held.
    private let fd: Locked<FileDescriptor?>

    init(directory: String) throws(StorageError) {
        let path = directory + "/obsd.lock"
        let fd = try attempt("cannot open \(path)", kind: .readOnly) { () throws(Errno) in
            try FilePath(path).open(.readWrite, options: .create, permissions: .ownerReadWrite)
        }
        do throws(Errno) {
            try fd.lockExclusively()
        } catch {
            var buffer = [UInt8](repeating: 0, count: 32)
            let n = (try? buffer.withMutableBytes { (raw) throws(Errno) in try fd.read(into: raw, at: 0) }) ?? 0
            let owner = n > 0 ? String(decoding: buffer[..<n], as: UTF8.self).trimmingWhitespace : "?"
            try? fd.close()
            throw StorageError(.locked, "data directory \(directory) is in use by another obsd (pid \(owner))")
        }
        let pid = Array("\(getpid())\n".utf8)
        try? fd.truncate(to: 0)
        _ = pid.withUnsafeBytes { fd.writeAll($0, at: 0) }
        self.fd = Locked(fd)
    }

    /// Lets another store open the directory. Idempotent.
    func release() {
        fd.withLock { fd in
            try? fd?.close()
            fd = nil
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
        guard let bytes = try? FilePath(directory + "/" + fileName).readPrefix(256) else { return nil }
        return String(decoding: bytes, as: UTF8.self).trimmingWhitespace
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
        let fd = try attempt("cannot create \(path)") { () throws(Errno) in
            try FilePath(path).open(.writeOnly, options: [.create, .truncate], permissions: .ownerReadWrite)
        }
        defer { try? fd.close() }
        let text = Array("running \(Provenance.bootID) \(sync == .always ? "always" : "relaxed")\n".utf8)
        if let failure = text.withUnsafeBytes({ fd.writeAll($0, at: 0) }) { throw StorageError(failure.errno, "cannot write \(path)") }
        try attempt("cannot write \(path)") { () throws(Errno) in try fd.dataSync() }
        try DataDirectory.sync(directory)
    }

    /// Marks the directory left cleanly.
    static func release(_ directory: String, logger: Logger) {
        let path = directory + "/" + fileName
        do throws(StorageError) {
            do throws(Errno) {
                try FilePath(path).remove()
            } catch where error != .noSuchFileOrDirectory {
                throw StorageError(error, "cannot remove \(path)")
            } catch {}
            try DataDirectory.sync(directory)
        } catch {
            logger.warning("cannot mark the data directory left cleanly; the next start treats this stop as unclean", metadata: ["error": "\(error.description)"])
        }
    }
}
