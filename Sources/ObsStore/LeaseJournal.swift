// ObsStore — leases on disk: the journal `leases` in the data directory, beside the log and
// the snapshot. The contract makes leases part of the persistent state: TTL leases and their
// keys survive a restart; keys of connection-bound leases are deleted (`closed`) before the
// daemon serves again; ids are never reused. The journal holds what that takes — grants,
// ends, key → lease attachments (an equal-value `set` moves one without making a revision, so
// they cannot ride in the log's revisions), the deletions lease ends made, the next id — as
// checksummed frames appended in the order the lease table made them (LeaseRecords.swift).
//
// Durability: a grant is written — and under `sync = always` synced — before its reply. The
// other records are written at once and synced before the log's next sync (the committer
// calls `syncIfDirty` first), so a write whose revision is durable has its attachment durable
// too. Syncs run outside the journal's lock, on a duplicate of its descriptor: records go on
// being appended — by writes on other loops, under their repository's lock — while the disk
// works (a rewrite that replaces the file meanwhile makes everything durable itself). A lease
// end's deletion record carries the repository's revision before the deletion: a restart
// that finds the repository no further (a kill before the deletion was durable) deletes
// those keys again.
//
// Start-up reads the journal whole (a torn last frame is cut off and reported; a damaged one
// elsewhere, or a foreign file, refuses start-up naming it), and the daemon then rewrites it
// compact (`compact`); it is rewritten the same way whenever it grows past four times that
// size, from the lease table's own state. Deletion records are kept through one rewrite.

import Logging
import ObsValues
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

public final class LeaseJournal: Sendable {
    public static let fileName = "leases"

    public let path: String
    private let directory: String
    private let syncEveryGrant: Bool
    private let logger: Logger
    /// `fdatasync` (a test makes it slow, to see who waits for it).
    private let syncFile: @Sendable (Int32) -> Int32

    private struct State: ~Copyable {
        var fd: Int32
        var size: Int
        /// The size after the last rewrite (compaction is due past four times it).
        var compactedSize: Int
        /// Records appended, and how many of them are known durable.
        var appended: UInt64 = 0
        var synced: UInt64 = 0
        /// Written since the last sync.
        var dirty: Bool { appended > synced }
        /// Why the last write failed (the journal then wants a rewrite, and grants are refused).
        var failure: String? = nil
        var closed = false
        /// Deletion records written since the last rewrite (the next one keeps them).
        var recentDeletions: [PersistedLeases.Deletion] = []
        var buffer: [UInt8] = []
    }

    private let state: Mutex<State>
    private let found: Mutex<PersistedLeases?>
    /// What start-up should report (a torn tail cut off).
    public let notices: [String]

    /// Opens (or creates) `directory/leases` and reads it.
    public init(
        directory: String, sync: SyncPolicy, logger: Logger, syncFile: @escaping @Sendable (Int32) -> Int32 = { fdatasync($0) }
    ) throws(StorageError) {
        self.directory = directory
        self.path = directory + "/" + Self.fileName
        self.syncEveryGrant = sync == .always
        self.logger = logger
        self.syncFile = syncFile
        let fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
        let read: (leases: PersistedLeases, size: Int, notice: String?)
        do throws(StorageError) {
            read = try Self.read(fd: fd, path: path)
        } catch {
            Glibc.close(fd)
            throw error
        }
        notices = read.notice.map { [$0] } ?? []
        found = Mutex(read.leases)
        state = Mutex(State(fd: fd, size: read.size, compactedSize: read.size))
    }

    deinit {
        state.withLock { s in if s.fd >= 0 { Glibc.close(s.fd) } }
    }

    /// What the journal held at start-up (once; empty afterwards).
    public func takeLoaded() -> PersistedLeases {
        found.withLock { f in
            defer { f = PersistedLeases() }
            return f ?? PersistedLeases()
        }
    }

    // MARK: Appending

    /// Records a grant. Under `sync = always`, returns the point `sync(through:)` must make
    /// durable before the grant is answered (the caller syncs once it holds no lock).
    public func granted(_ lease: PersistedLeases.Lease) throws(StorageError) -> UInt64? {
        try state.withLock { s throws(StorageError) in
            if let failure = s.failure { throw StorageError(.io, "the lease journal \(path) cannot be written (\(failure))") }
            s.buffer.removeAll(keepingCapacity: true)
            LeaseRecord.grant(lease, into: &s.buffer)
            try append(&s)
            return syncEveryGrant ? s.appended : nil
        }
    }

    /// Records that lease `id` ended.
    public func ended(_ id: UInt64, _ reason: SharedLeaseReason) {
        record { LeaseRecord.end(id, reason, into: &$0) }
    }

    /// Records that `key` of `repo` is attached to `lease` (nil: to none).
    public func attached(_ key: Key, of repo: String, to lease: UInt64?) {
        record { LeaseRecord.attach(repo: repo, key: key, lease: lease, into: &$0) }
    }

    /// Records the keys a lease's end deletes from `repo` in the revision after `before`.
    public func deleting(_ deletion: PersistedLeases.Deletion) {
        state.withLock { s in s.recentDeletions.append(deletion) }
        record { LeaseRecord.deletion(deletion, into: &$0) }
    }

    /// Whether the journal should be rewritten from the lease table's state (`compact`):
    /// grown past four times its last compact size, or a write failed.
    public var wantsCompaction: Bool {
        state.withLock { s in !s.closed && (s.failure != nil || s.size > max(1 << 20, 4 * s.compactedSize)) }
    }

    private func record(_ encode: (inout [UInt8]) -> Void) {
        state.withLock { s in
            guard !s.closed, s.failure == nil else { return }
            s.buffer.removeAll(keepingCapacity: true)
            encode(&s.buffer)
            do throws(StorageError) { try append(&s) } catch { logger.error("\(error.description); the lease journal is rewritten at the next lease operation") }
        }
    }

    /// Writes `s.buffer` at the end; on failure cuts the file back (no torn frame stays in
    /// front of later ones) and marks the journal for a rewrite.
    private func append(_ s: inout State) throws(StorageError) {
        guard !s.closed else { return }
        let n = s.buffer.withUnsafeBytes { pwrite(s.fd, $0.baseAddress, $0.count, off_t(s.size)) }
        guard n == s.buffer.count else {
            let error = n < 0 ? StorageError.from(errno, "cannot write \(path)") : StorageError(.full, "cannot write \(path): short write")
            _ = ftruncate(s.fd, off_t(s.size))
            s.failure = error.description
            throw error
        }
        s.size += n
        s.appended += 1
    }

    // MARK: Syncing

    /// Syncs what was written since the last sync (the committer, before the log's sync).
    public func syncIfDirty() throws(StorageError) {
        try sync(through: state.withLock { $0.appended })
    }

    /// Makes the records appended up to `point` (a count `granted` returned) durable. The
    /// sync runs without the lock, on a duplicate of the descriptor; if a rewrite replaced the
    /// file meanwhile, the rewrite — synced before its rename — already holds every record.
    public func sync(through point: UInt64) throws(StorageError) {
        let target: (fd: Int32, point: UInt64)? = try state.withLock { (s) throws(StorageError) -> (fd: Int32, point: UInt64)? in
            guard !s.closed, s.synced < point else { return nil }
            let fd = dup(s.fd)
            guard fd >= 0 else { throw StorageError.from(errno, "cannot sync \(path)") }
            return (fd, s.appended)
        }
        guard let target else { return }
        defer { Glibc.close(target.fd) }
        guard syncFile(target.fd) == 0 else { throw StorageError.from(errno, "cannot sync \(path)") }
        state.withLock { s in s.synced = max(s.synced, target.point) }
    }

    // MARK: Rewriting

    /// Replaces the journal with `live` leases, their `attachments`, `nextID` and the
    /// deletion records written since the last rewrite (and `deletions`), durably.
    public func compact(live: [PersistedLeases.Lease], attachments: [(repo: String, key: Key, lease: UInt64)], nextID: UInt64, deletions: [PersistedLeases.Deletion] = [])
        throws(StorageError)
    {
        try state.withLock { s throws(StorageError) in
            guard !s.closed else { return }
            var bytes = LeaseRecord.magic
            LeaseRecord.next(nextID, into: &bytes)
            for lease in live.sorted(by: { $0.id < $1.id }) { LeaseRecord.grant(lease, into: &bytes) }
            for a in attachments { LeaseRecord.attach(repo: a.repo, key: a.key, lease: a.lease, into: &bytes) }
            for d in deletions + s.recentDeletions { LeaseRecord.deletion(d, into: &bytes) }
            let temporary = path + ".new"
            let fd = open(temporary, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
            guard fd >= 0 else { throw StorageError.from(errno, "cannot create \(temporary)") }
            let n = bytes.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
            guard n == bytes.count, fdatasync(fd) == 0, rename(temporary, path) == 0 else {
                let error = StorageError.from(n < 0 || n == bytes.count ? errno : ENOSPC, "cannot write \(temporary)")
                Glibc.close(fd)
                unlink(temporary)
                if s.failure == nil { logger.error("\(error.description); lease grants are refused until the lease journal can be rewritten") }
                s.failure = error.description
                throw error
            }
            // The new file is the journal from the rename on: appends go to it even if the
            // directory's sync fails (the old descriptor names a file no longer linked).
            Glibc.close(s.fd)
            s.fd = fd
            s.size = bytes.count
            s.compactedSize = bytes.count
            s.synced = s.appended
            s.failure = nil
            s.recentDeletions = []
            try DataDirectory.sync(directory)
        }
    }

    /// Takes no more records (storage closed: what the daemon does while it stops — its
    /// connections' leases ending — is for the next start to decide).
    public func close() {
        state.withLock { s in
            if s.dirty { _ = syncFile(s.fd) }
            s.closed = true
        }
    }

    // MARK: Reading

    private static func read(fd: Int32, path: String) throws(StorageError) -> (leases: PersistedLeases, size: Int, notice: String?) {
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw StorageError.from(errno, "cannot stat \(path)") }
        var bytes = [UInt8](repeating: 0, count: Int(st.st_size))
        var got = 0
        while got < bytes.count {
            let n = bytes.withUnsafeMutableBytes { pread(fd, $0.baseAddress! + got, $0.count - got, off_t(got)) }
            if n < 0, errno == EINTR { continue }
            guard n > 0 else { throw StorageError.from(n < 0 ? errno : EIO, "cannot read \(path)") }
            got += n
        }
        if bytes.isEmpty {
            let n = LeaseRecord.magic.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
            guard n == LeaseRecord.magic.count else { throw StorageError.from(errno, "cannot write \(path)") }
            return (PersistedLeases(), n, nil)
        }
        if bytes.count < LeaseRecord.magic.count, LeaseRecord.magic.starts(with: bytes) {
            // A header a crash cut short, right after the file was created: nothing else was in it.
            let n = LeaseRecord.magic.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
            guard n == LeaseRecord.magic.count else { throw StorageError.from(errno, "cannot write \(path)") }
            return (PersistedLeases(), n, "rewrote the header of \(path), which a crash had cut short (it held nothing yet)")
        }
        guard bytes.count >= LeaseRecord.magic.count, Array(bytes[..<LeaseRecord.magic.count]) == LeaseRecord.magic else {
            throw StorageError(.corrupt, "\(path) is not an obsd lease journal (bad header); refusing to start")
        }
        let (leases, torn) = try bytes.withUnsafeBytes { raw in Result { () throws(StorageError) in try parse(raw, path: path) } }.get()
        guard let torn else { return (leases, bytes.count, nil) }
        guard ftruncate(fd, off_t(torn)) == 0 else { throw StorageError.from(errno, "cannot cut the torn end off \(path)") }
        return (leases, torn, "cut \(bytes.count - torn) bytes of a torn write off the end of \(path): a lease record a crash interrupted, never acknowledged")
    }

    /// The leases `raw` (the whole file) records, and where a torn last frame begins.
    private static func parse(_ raw: UnsafeRawBufferPointer, path: String) throws(StorageError) -> (PersistedLeases, torn: Int?) {
        var leases = PersistedLeases()
        var offset = LeaseRecord.magic.count
        while offset < raw.count {
            var header = PayloadReader(UnsafeRawBufferPointer(rebasing: raw[offset...]))
            guard let length = header.u32(), let crc = header.u32(), Int(length) <= raw.count - offset - LeaseRecord.frameHeader else {
                return (leases, offset)  // a frame cut short: the last write a crash interrupted
            }
            let start = offset + LeaseRecord.frameHeader
            let payload = UnsafeRawBufferPointer(rebasing: raw[start..<(start + Int(length))])
            guard CRC32C.checksum(payload) == crc else {
                if start + Int(length) == raw.count { return (leases, offset) }
                throw StorageError(.corrupt, "\(path) is damaged at byte \(offset) (a record whose checksum does not match, with more after it); refusing to start")
            }
            guard LeaseRecord.apply(payload, to: &leases) else {
                throw StorageError(.corrupt, "\(path) holds a record obsd cannot read at byte \(offset); refusing to start")
            }
            offset = start + Int(length)
        }
        return (leases, nil)
    }
}
