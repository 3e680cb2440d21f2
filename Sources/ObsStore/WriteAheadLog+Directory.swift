// ObsStore — the write-ahead log's directory: the segment files' names
// (`<base position, 16 hex digits>.wal`), listing and removing them, making their entries
// durable.

import SystemPackage

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
            let names = try attempt("cannot read \(path)") { () throws(Errno) in try FilePath(path).entries() }
            var bases: [UInt64] = []
            for name in names {
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
                try? FilePath(file(segment)).remove()
            }
        }

        /// Makes the directory's entries durable (a segment created or removed).
        func sync() throws(StorageError) { try DataDirectory.sync(path) }
    }
}
