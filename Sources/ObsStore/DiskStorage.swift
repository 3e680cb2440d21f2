// ObsStore — repositories on disk: a write-ahead log where writes become durable, and a
// snapshot file as the compacted state, rewritten off the acknowledgement path (the way
// Redis pairs its append-only file with its snapshot).
//
// - The committer thread (Committer.swift) owns the log. It takes every revision queued
//   since its last group, writes them with one `pwrite` and, under `sync = always`, one
//   `fdatasync` — group commit — then reports them durable. Under `sync = relaxed` it
//   reports them after the write and syncs at most every interval.
// - The checkpointer thread (Checkpointer.swift) owns the snapshot. As the log grows it
//   writes a new one — the old one with the log since folded in — and deletes the log
//   segments it covers.
// - Start-up (Snapshot.swift, WriteAheadLog.swift): the snapshot, read in large blocks
//   straight into flat tables, then the log after it replayed on top (Recovery.swift) —
//   each repository's tombstones too. A torn tail, or what lies after the end of the last
//   segment, is cut off and reported; a damaged record in the middle, a snapshot torn,
//   damaged, foreign or missing, a log segment missing, cut short or emptied, each refuses
//   start-up with the file and the cause. A repository given a new epoch (a copied
//   snapshot, a repaired log) loses its tombstones: which keys were deleted before it is
//   no longer known. A data directory an earlier obsd wrote (SQLite, `obsd.db`:
//   SQLiteSchema.swift) is read once, written as a snapshot, removed.
//
// Whichever thread commits — an event loop at the end of its iteration (`flush`), or the
// committer thread for what no loop flushes — posts each group's outcome (`reports`) and calls
// nobody: a loop takes what it posted when its flush returns; what the committer thread
// posts wakes the server's deliverer (`DurabilityReports.whenPosted`).

import CSQLite
import Logging
import ObsValues
import ObservableKit
import Synchronization
import SystemPackage

#if canImport(Glibc)
import Glibc  // the thread-specific key of the store a thread flushes (pthread)
#endif

/// When a write counts as durable.
public enum SyncPolicy: Sendable, Equatable, CustomStringConvertible {
    /// fsync before the reply; concurrent and pipelined writes share one fsync.
    case always
    /// Reply after write(2); fsync at most every `interval`. A power loss can lose the
    /// writes of the last `interval` (plus one group); a crash of obsd alone loses nothing.
    case relaxed(interval: Duration)

    public var description: String {
        switch self {
        case .always: return "always"
        case .relaxed(let interval): return "relaxed (\(interval.components.seconds * 1000 + interval.components.attoseconds / 1_000_000_000_000_000) ms)"
        }
    }
}

/// Counters of the store, for `stats` and benchmarks.
public final class StorageCounters: Sendable {
    /// Groups written to the log.
    public let commits = Atomic<Int>(0)
    public let fsyncs = Atomic<Int>(0)
    public let records = Atomic<Int>(0)
    /// Groups that failed (their writes were undone).
    public let failures = Atomic<Int>(0)
    /// Batches applied to the compacted state, and those that failed (retried later).
    public let checkpoints = Atomic<Int>(0)
    public let checkpointFailures = Atomic<Int>(0)

    /// Counters at zero (for a storage of another module).
    public init() {}
}

public final class DiskStorage: Storage {
    public struct Options: Sendable {
        public var directory: String
        public var sync: SyncPolicy
        /// Revisions of history kept per repository (0: none).
        public var historyLimit: Int
        /// Bytes of history kept per repository (`RevisionRecord.byteSize`; the newest
        /// revision is kept whatever its size).
        public var historyMaxBytes: Int
        /// History older than this is dropped (nil: no age limit).
        public var historyMaxAge: Duration?
        /// Deletions remembered per repository (tombstones, for catch-ups: `Tombstones`):
        /// the most recent this many, in memory, in the snapshot and replayed from the log.
        public var tombstoneLimit: Int = Tombstones.defaultLimit
        /// How often the checkpointer looks at how far the log is ahead of the snapshot.
        public var checkpointInterval: Duration = .milliseconds(200)
        /// The snapshot is rewritten once the log after it holds this many bytes and half its
        /// size (so a restart after a crash replays at most that much).
        public var snapshotLogBytes: Int = 64 << 20
        /// The size log segments are preallocated to.
        public var segmentSize: Int = 64 << 20
        /// Cut the log at a damaged record (with everything after it) instead of refusing to
        /// start; every repository then starts a new epoch (`obsd --repair-log`).
        public var repairLog = false

        public init(directory: String, sync: SyncPolicy, historyLimit: Int, historyMaxBytes: Int, historyMaxAge: Duration?) {
            self.directory = directory
            self.sync = sync
            self.historyLimit = historyLimit
            self.historyMaxBytes = historyMaxBytes
            self.historyMaxAge = historyMaxAge
        }
    }

    /// The compacted state's file name inside the data directory (an earlier obsd's SQLite
    /// database, read once to migrate it).
    static let legacyFileName = "obsd.db"
    /// The log's directory inside the data directory.
    public static let logDirectory = "wal"
    /// How many lease ids a repair of the log skips (see `init`).
    static let leaseIDsSkippedByARepair: UInt64 = 1 << 32
    /// `PRAGMA application_id` of obsd databases: "obsd".
    static let applicationID: Int64 = 0x6F62_7364
    static let schemaVersion: Int64 = 3

    public let options: Options
    public let path: String
    public let counters: StorageCounters? = StorageCounters()
    /// Each group's outcome, for the server to deliver.
    private let posted = DurabilityReports()
    public var reports: DurabilityReports? { posted }
    public let notices: [String]
    private let queue: CommitQueue
    private let lock: DirectoryLock
    private let loaded: Locked<[LoadedRepository]?>
    private let loadedLeases: Locked<PersistedLeases?>
    private let committer: Committer
    private let committerThread: DedicatedThread
    private let checkpointer: DedicatedThread

    /// A frame on its way to the log, encoded into the queue's buffer
    /// (`CommitQueue.append(_:sequence:listener:wake:)`).
    struct Queued: Sendable {
        let frame: Range<Int>
        let sequence: UInt64
        let listener: any DurabilityListener
    }

    /// Opens (or creates) the store, loads it and replays its log; ready to `append` on
    /// return. Failed writes and checkpoints are logged to `logger`.
    public convenience init(options: Options, logger: Logger) throws(StorageError) {
        // Test-only failpoints (Failpoints.swift): nil unless OBSD_FAILPOINTS is set.
        guard let failpoints = Failpoints.shared else {
            try self.init(options: options, logger: logger, files: SystemFileOperations())
            return
        }
        logger.warning("test failpoints armed by OBSD_FAILPOINTS (never in production): \(failpoints.description)")
        var tuned = options
        if let n = failpoints.value("store.segment-size"), n >= 4096 { tuned.segmentSize = n }
        if let n = failpoints.value("store.snapshot-log-bytes"), n >= 0 { tuned.snapshotLogBytes = n }
        if let n = failpoints.value("store.checkpoint-interval-ms"), n > 0 { tuned.checkpointInterval = .milliseconds(n) }
        try self.init(options: tuned, logger: logger, files: FailpointFileOperations(failpoints))
    }

    /// The store whose log makes its system calls with `files` (a test's, to fail on cue).
    init(options: Options, logger: Logger, files: any FileOperations) throws(StorageError) {
        self.options = options
        let directory = options.directory
        try DataDirectory.create(directory)
        lock = try DirectoryLock(directory: directory)
        path = directory + "/" + SnapshotFormat.fileName

        var notices: [String] = []
        let partial = directory + "/" + SnapshotFormat.partialName
        if (try? FilePath(partial).remove()) != nil {
            notices.append("removed \(partial): a snapshot whose writing a crash interrupted (the one before it stands)")
        }
        let log = WriteAheadLog(directory: directory + "/" + Self.logDirectory, segmentSize: options.segmentSize, files: files)
        var stored = try Self.loadCompactedState(options: options, log: log.directory)
        if let renewed = stored.renewed {
            notices.append("every repository starts a new epoch (clients resync instead of resuming): \(renewed)")
            stored.repositories = stored.repositories.map { $0.renewed(epoch: Epoch.random()) }
        }
        var recovery = Recovery(repositories: stored.repositories, leases: stored.leases, renewEpochs: stored.renewed != nil, options: options)
        stored.repositories = []
        let report = try log.open(after: stored.covered, repair: options.repairLog, expectingLog: stored.source == .snapshot) { (payload, position) throws(StorageError) in
            try recovery.apply(payload, at: position, log: log.directory.path)
        }
        if let at = report.tornAt {
            notices.append("cut \(report.tornBytes) bytes of a torn write off the end of the write-ahead log (\(at)): a write a crash interrupted, never acknowledged")
        }
        if let at = report.leftoverAt {
            notices.append(
                "cut \(report.leftoverBytes) bytes after the end of the write-ahead log (\(at)): a failed write voided there, or a write whose start a crash lost; never acknowledged")
        }
        if report.records > 0 { notices.append("replayed \(report.records) revisions from the write-ahead log") }
        var repositories = recovery.repositories
        var leases = recovery.leases
        let journal = directory + "/" + LeaseJournalRecord.fileName
        let legacy = try LegacyLeases.read(journal)
        if let legacy {
            (repositories, leases) = Self.migrate(legacy, into: repositories)
        }
        if let at = report.repairedAt {
            let segments = report.removedSegments == 0 ? "" : ", and \(report.removedSegments) later log segment(s)"
            notices.append(
                "repaired the write-ahead log: cut \(report.repairedBytes) bytes at \(at) — a damaged record and everything after it\(segments); the revisions they held are lost, and every repository starts a new epoch (clients resync instead of resuming)"
            )
            // Revisions after the cut may be numbered again: no client may resume across it.
            repositories = repositories.map { $0.renewed(epoch: Epoch.random()) }
        }
        if let lost = report.lost {
            notices.append(
                "repaired the write-ahead log: \(lost); the revisions they held are lost, and every repository starts a new epoch (clients resync instead of resuming)")
            if report.repairedAt == nil { repositories = repositories.map { $0.renewed(epoch: Epoch.random()) } }
        }
        if report.repairedAt != nil || report.lost != nil {
            // Grants may have been lost with the log: ids are never handed out twice while the
            // data persists (the contract), so ids after a repair start past any a lost grant
            // can have had. A grant frame takes more than 16 bytes, and 2^32 of them would be
            // 64 GiB of log past the snapshot — the checkpointer snapshots long before.
            let (skipped, overflow) = leases.nextID.addingReportingOverflow(Self.leaseIDsSkippedByARepair)
            leases.nextID = overflow ? .max : skipped
            notices.append("lease ids go on from \(leases.nextID): grants the repair cut away may have had any id below")
        }
        var covered = stored.covered
        var snapshotSize = stored.size
        if stored.renewed != nil || stored.source != .snapshot || report.repairedAt != nil || report.lost != nil || legacy != nil {
            // The new epochs (renewed, or after a repair), the migrated state, or a new
            // directory's first (empty) snapshot: durable before any write, and the file's
            // identity recorded from the start.
            snapshotSize = try SnapshotLoader.write(repositories, leases: leases, covering: log.position, directory: directory)
            covered = log.position
            if legacy != nil {
                try? FilePath(journal).remove()
                try DataDirectory.sync(directory)
                notices.append("moved the leases from \(journal) (a journal an earlier obsd kept beside its log) into \(path), and removed the former")
            }
            if stored.source == .sqlite {
                for suffix in ["", "-wal", "-shm"] { try? FilePath(directory + "/" + Self.legacyFileName + suffix).remove() }
                try DataDirectory.sync(directory)
                notices.append("moved the compacted state from \(directory)/\(Self.legacyFileName) (SQLite, written by an earlier obsd) to \(path), and removed the former")
            }
        }
        log.directory.removeSegments(through: covered)
        try RunMarker.claim(directory, sync: options.sync)
        self.notices = notices
        loaded = Locked(repositories)
        loadedLeases = Locked(leases)

        let counters = self.counters!
        let progress = LogProgress(position: log.position)
        let checkpointer = Checkpointer(
            directory: directory, options: options, log: log.directory, covered: covered, snapshotSize: snapshotSize, counters: counters,
            logger: logger)
        let queue = CommitQueue()
        self.queue = queue
        // The checkpointer moves to its thread and is used there only.
        let handedCheckpointer = Handover(checkpointer)
        self.checkpointer = DedicatedThread { handedCheckpointer.take().run(progress) }
        let committer = Committer(log: log, sync: options.sync, queue: queue, progress: progress, reports: posted, counters: counters, logger: logger)
        self.committer = committer
        committerThread = DedicatedThread { committer.run() }
    }

    /// Where the compacted state came from.
    enum Source { case snapshot, sqlite, none }

    /// The compacted state as found: the snapshot, or an earlier obsd's SQLite database, or
    /// nothing (a new directory — unless the log says its snapshot is missing).
    static func loadCompactedState(options: Options, log: WriteAheadLog.Directory) throws(StorageError) -> (
        repositories: [LoadedRepository], leases: PersistedLeases, covered: UInt64, size: Int, renewed: String?, source: Source
    ) {
        let directory = options.directory
        let snapshot = directory + "/" + SnapshotFormat.fileName
        let legacy = directory + "/" + legacyFileName
        if FilePath(snapshot).exists {
            let loaded = try SnapshotLoader.load(snapshot, options: options)
            let renewed = RunMarker.renewal(
                snapshot: snapshot, identity: loaded.identity, recorded: loaded.recordedIdentity, marker: RunMarker.read(directory))
            return (loaded.repositories, loaded.leases, loaded.covered, loaded.size, renewed, .snapshot)
        }
        if FilePath(legacy).exists {
            let (connection, migrated) = try Schema.open(path: legacy, options: options)
            defer { connection.close() }
            let renewed = try Provenance.claim(connection, sync: options.sync, migrated: migrated)
            let stored = try Loader.load(connection, options: options)
            return (stored.repositories, PersistedLeases(), stored.checkpoint, 0, renewed, .sqlite)
        }
        if let segments = try? log.segments(), !segments.isEmpty {
            throw StorageError(
                .corrupt,
                "\(snapshot) is missing, but the write-ahead log in \(log.path) is not: the state before the log's first record is gone (a data directory needs both); refusing to start"
            )
        }
        return ([], PersistedLeases(), 0, 0, nil, .none)
    }

    public var isImmediate: Bool { false }

    public var summary: String { "write-ahead log + snapshot \(path), sync \(options.sync)" }

    public func load() throws(StorageError) -> [LoadedRepository] {
        loaded.withLock { all in
            defer { all = nil }
            return all ?? []
        }
    }

    public func loadLeases() -> PersistedLeases {
        loadedLeases.withLock { leases in
            defer { leases = nil }
            return leases ?? PersistedLeases()
        }
    }

    /// Encodes the frame as it is queued: no record, nor any value copied, for it.
    public func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool {
        queue.append(frame, sequence: sequence, listener: listener, wake: wakesCommitter)
    }

    /// Whether a revision queued now wakes the committer thread: a thread that flushes commits
    /// it itself, soon.
    private var wakesCommitter: Bool { pthread_getspecific(Self.flusher) != Unmanaged.passUnretained(self).toOpaque() }

    /// Under `sync = relaxed` a flush writes and does not sync.
    public var flushesCheaply: Bool { options.sync != .always }

    /// Commits the revisions queued — this thread's, and any others' — on this thread,
    /// unless another thread is committing (which then takes them). From then on, revisions
    /// this thread appends wait for its next `flush` instead of waking the committer thread.
    public func flush() {
        let me = Unmanaged.passUnretained(self).toOpaque()
        if pthread_getspecific(Self.flusher) != me { pthread_setspecific(Self.flusher, me) }
        committer.drain(wakes: false)
    }

    /// The store each thread flushes (see `flush`).
    private static let flusher: pthread_key_t = {
        var key = pthread_key_t()
        pthread_key_create(&key, nil)
        return key
    }()

    public func discard(_ listener: any DurabilityListener, after sequence: UInt64) {
        queue.discard(listener, after: sequence)
    }

    public func close() {
        queue.close()
        committerThread.join()  // it closes the log's progress once the log is synced
        checkpointer.join()
        lock.release()
    }
}

extension DiskStorage {
    /// Folds the lease journal an earlier obsd kept (`legacy`) into what start-up loaded:
    /// its leases, each repository's attachments, and the deletions a lease's end owed and
    /// a kill interrupted (a repository no further than the revision before the deletion:
    /// the keys are attached to the ended lease again, so start-up deletes them).
    static func migrate(_ legacy: LegacyLeases, into repositories: [LoadedRepository]) -> ([LoadedRepository], PersistedLeases) {
        var leases = legacy.leases
        var attachments = legacy.attachments
        let revisions = Dictionary(repositories.map { ($0.name, $0.state.revision) }, uniquingKeysWith: max)
        for d in legacy.deletions where (revisions[d.repo] ?? 0) <= d.before {
            for key in d.keys { attachments[d.repo, default: [:]][key] = d.lease }
            if leases.ended[d.lease] == nil, leases.live[d.lease] == nil { leases.ended(d.lease, d.reason, owner: d.owner) }
        }
        let migrated = repositories.map { repository in
            // Keys that no longer exist are attached to nothing.
            let attached = (attachments[repository.name] ?? [:]).filter { repository.state[$0.key] != nil }
            return LoadedRepository(
                name: repository.name, epoch: repository.epoch, state: repository.state, history: repository.history, attachments: attached,
                tombstones: repository.tombstones)
        }
        return (migrated, leases)
    }
}

/// Hands a value to the thread that will own it (SQLite connections and the log are used
/// by one thread at a time).
final class Handover<Value>: @unchecked Sendable {
    // @unchecked Sendable: `value` is written once by the creating thread before the
    // receiving thread starts (pthread_create orders the two), and read once by that thread.
    private var value: Value?
    init(_ value: Value) { self.value = value }
    func take() -> Value {
        defer { value = nil }
        return value!
    }
}
