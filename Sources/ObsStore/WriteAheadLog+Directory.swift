// ObsStore — the write-ahead log's directory: the segment files' names
// (`<base position, 16 hex digits>.wal`), listing and removing them, making their entries
// durable; and the storage error an errno means.

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

extension WriteAheadLog {
    /// The log's directory: its segment files, listed and deleted from any thread.
    struct Directory: Sendable {
        let path: String

        /// The file of the segment that starts at `base`.
        func file(_ base: UInt64) -> String {
            let hex = String(base, radix: 16)
            return path + "/" + String(repeating: "0", count: max(0, 16 - hex.count)) + hex + ".wal"
        }

        /// The segments' base positions, ascending.
        func segments() throws(StorageError) -> [UInt64] {
            guard let dir = opendir(path) else { throw StorageError.from(errno, "cannot read \(path)") }
            defer { closedir(dir) }
            var bases: [UInt64] = []
            while let entry = readdir(dir) {
                let name = withUnsafeBytes(of: entry.pointee.d_name) { raw in
                    String(decoding: raw.prefix(while: { $0 != 0 }), as: UTF8.self)
                }
                guard name.hasSuffix(".wal"), name.utf8.count == 20, let base = UInt64(name.prefix(16), radix: 16) else { continue }
                bases.append(base)
            }
            return bases.sorted()
        }

        /// Deletes the segments that lie wholly at or before `checkpoint` (applied to the
        /// compacted state, which is durable): those followed by a segment that starts at
        /// or before it. Never the last one, which the committer appends to.
        func removeSegments(through checkpoint: UInt64) {
            guard let segments = try? segments() else { return }
            for (i, segment) in segments.enumerated() where i + 1 < segments.count && segments[i + 1] <= checkpoint {
                unlink(file(segment))
            }
        }

        /// Makes the directory's entries durable (a segment created or removed).
        func sync() throws(StorageError) {
            let dir = Glibc.open(path, O_RDONLY | O_CLOEXEC | O_DIRECTORY)
            guard dir >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
            defer { close(dir) }
            if fsync(dir) != 0 { throw StorageError.from(errno, "cannot sync \(path)") }
        }
    }
}

extension StorageError {
    /// An error for `errno`, of the kind it means.
    static func from(_ code: Int32, _ what: String) -> StorageError {
        let kind: Kind
        switch code {
        case ENOSPC, EDQUOT: kind = .full
        case EROFS, EACCES, EPERM: kind = .readOnly
        case EIO: kind = .io
        default: kind = .other
        }
        let hint = kind == .full ? " (the file system is full)" : ""
        return StorageError(kind, "\(what): \(String(cString: strerror(code)))\(hint)")
    }
}
