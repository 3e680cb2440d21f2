// ObsStore — repositories on disk: a write-ahead log where writes become durable, and
// SQLite as the compacted state, brought up to date off the acknowledgement path (the
// way etcd pairs its WAL with bbolt).
//
// - The committer thread (Committer.swift) owns the log. It takes every revision queued
//   since its last group, writes them with one `pwrite` and, under `sync = always`, one
//   `fdatasync` — group commit — then reports them durable. Under `sync = relaxed` it
//   reports them after the write and syncs at most every interval.
// - The checkpointer thread (Checkpointer.swift) owns SQLite. It applies durable revisions
//   in batches, records how far the log is applied, trims and expires history, and deletes
//   the log segments the compacted state now holds.
// - Start-up (SQLiteSchema.swift, WriteAheadLog.swift): SQLite's state and history, then
//   the log after its checkpoint replayed on top. A torn tail, or what lies after the end
//   of the last segment, is cut off and reported; a damaged record in the middle refuses
//   start-up with the file and offset.
//
// Durability callbacks come from the committer thread and must not block (the daemon
// hands them to its event loop); `append` never calls back.

import CSQLite
import Logging
import ObsValues
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
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
        /// How often durable revisions are applied to the compacted state.
        public var checkpointInterval: Duration = .milliseconds(200)
        /// The size log segments are preallocated to.
        public var segmentSize: Int = 64 << 20

        public init(directory: String, sync: SyncPolicy, historyLimit: Int, historyMaxBytes: Int, historyMaxAge: Duration?) {
            self.directory = directory
            self.sync = sync
            self.historyLimit = historyLimit
            self.historyMaxBytes = historyMaxBytes
            self.historyMaxAge = historyMaxAge
        }
    }

    /// The compacted state's file name inside the data directory.
    public static let fileName = "obsd.db"
    /// The log's directory inside the data directory.
    public static let logDirectory = "wal"
    /// `PRAGMA application_id` of obsd databases: "obsd".
    static let applicationID: Int64 = 0x6F62_7364
    static let schemaVersion: Int64 = 3

    public let options: Options
    public let path: String
    public let counters: StorageCounters? = StorageCounters()
    public let notices: [String]
    private let queue: CommitQueue
    private let lock: DirectoryLock
    private let loaded: Locked<[LoadedRepository]?>
    private let committer: DedicatedThread
    private let checkpointer: DedicatedThread

    /// A revision on its way to the log.
    struct Queued: Sendable {
        let record: RevisionRecord
        let listener: any DurabilityListener
    }

    /// Opens (or creates) the store, loads it and replays its log; ready to `append` on
    /// return. Failed writes and checkpoints are logged to `logger`.
    public convenience init(options: Options, logger: Logger) throws(StorageError) {
        try self.init(options: options, logger: logger, files: SystemFileOperations())
    }

    /// The store whose log makes its system calls with `files` (a test's, to fail on cue).
    init(options: Options, logger: Logger, files: any FileOperations) throws(StorageError) {
        self.options = options
        try DataDirectory.create(options.directory)
        lock = try DirectoryLock(directory: options.directory)
        path = options.directory + "/" + Self.fileName

        let (connection, migrated) = try Schema.open(path: path, options: options)
        let renewed = try Provenance.claim(connection, sync: options.sync, migrated: migrated)
        let stored = try Loader.load(connection, options: options)
        let log = WriteAheadLog(directory: options.directory + "/" + Self.logDirectory, segmentSize: options.segmentSize, files: files)
        var recovery = Recovery(repositories: stored.repositories, renewEpochs: renewed != nil, options: options)
        let report = try log.open(after: stored.checkpoint) { (payload, position) throws(StorageError) in
            try recovery.apply(payload, at: position, log: log.directory.path)
        }
        var notices: [String] = []
        if let renewed { notices.append("every repository starts a new epoch (clients resync instead of resuming): \(renewed)") }
        if let at = report.tornAt {
            notices.append("cut \(report.tornBytes) bytes of a torn write off the end of the write-ahead log (\(at)): a write a crash interrupted, never acknowledged")
        }
        if let at = report.leftoverAt {
            notices.append(
                "cut \(report.leftoverBytes) bytes after the end of the write-ahead log (\(at)): a failed write voided there, or a write whose start a crash lost; never acknowledged")
        }
        if report.records > 0 { notices.append("replayed \(report.records) revisions from the write-ahead log") }
        self.notices = notices
        loaded = Locked(recovery.repositories)

        let counters = self.counters!
        let checkpointer = try Checkpointer(
            connection: connection, options: options, log: log.directory, seed: stored.repositories,
            counters: counters, logger: logger)
        let checkpoints = CheckpointQueue(backlog: recovery.applied)
        let queue = CommitQueue()
        self.queue = queue
        // The connection and the log each move to their thread and are used there only.
        let handedCheckpointer = Handover(checkpointer)
        self.checkpointer = DedicatedThread { handedCheckpointer.take().run(checkpoints) }
        let handedLog = Handover(log)
        let sync = options.sync
        committer = DedicatedThread {
            var committer = Committer(log: handedLog.take(), sync: sync, counters: counters, logger: logger)
            committer.run(queue, checkpoints: checkpoints)
        }
    }

    public var isImmediate: Bool { false }

    public var summary: String { "write-ahead log + sqlite \(path), sync \(options.sync)" }

    public func load() throws(StorageError) -> [LoadedRepository] {
        loaded.withLock { all in
            defer { all = nil }
            return all ?? []
        }
    }

    public func append(_ record: RevisionRecord, listener: any DurabilityListener) -> Bool {
        queue.append(Queued(record: record, listener: listener))
    }

    public func discard(_ listener: any DurabilityListener, after revision: UInt64) {
        queue.discard(listener, after: revision)
    }

    public func close() {
        queue.close()
        committer.join()  // it closes the checkpoint queue once the log is synced
        checkpointer.join()
        lock.release()
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


/// Revisions read back from the log at start-up, applied on top of the compacted state.
struct Recovery {
    private struct Builder {
        let name: String
        let epoch: String
        var state: KeyedState<CanonicalJSON>
        var history: [RevisionRecord]
    }

    private var builders: [Builder]
    /// Everything replayed, for the checkpointer: record, final epoch, log position.
    private(set) var applied: [Checkpointed] = []
    private var byName: [String: Int] = [:]
    private let renewEpochs: Bool
    private let options: DiskStorage.Options

    init(repositories: [LoadedRepository], renewEpochs: Bool, options: DiskStorage.Options) {
        self.builders = repositories.map { Builder(name: $0.name, epoch: $0.epoch, state: $0.state, history: $0.history) }
        self.renewEpochs = renewEpochs
        self.options = options
        for (i, repo) in repositories.enumerated() { byName[repo.name] = i }
    }

    /// The repositories with every replayed revision applied, their history within the limits.
    var repositories: [LoadedRepository] {
        builders.map { b in
            LoadedRepository(
                name: b.name, epoch: b.epoch, state: b.state,
                history: Loader.retained(b.history, limit: options.historyLimit, maxBytes: options.historyMaxBytes))
        }
    }

    mutating func apply(_ payload: UnsafeRawBufferPointer, at position: UInt64, log: String) throws(StorageError) {
        let record: RevisionRecord
        let logged: String
        do throws(LogRecord.Malformed) {
            (record, logged) = try LogRecord.decode(payload)
        } catch {
            throw StorageError(.corrupt, "\(log): a record before position \(position) has a valid checksum but no meaning to this obsd; refusing to start")
        }
        let index: Int
        if let i = byName[record.repo] {
            index = i
        } else {
            builders.append(Builder(name: record.repo, epoch: renewEpochs ? Epoch.random() : logged, state: KeyedState(), history: []))
            index = builders.count - 1
            byName[record.repo] = index
        }
        let revision = builders[index].state.revision
        guard record.revision == revision + 1 else {
            if record.revision <= revision { return }  // already in the compacted state
            throw StorageError(
                .corrupt,
                "\(log): repository \(record.repo) jumps from revision \(revision) to \(record.revision) (position \(position)); refusing to start")
        }
        builders[index].state.install(ChangeSet(revision: record.revision, changes: record.changes))
        if options.historyLimit > 0 {
            builders[index].history.append(record)
            if builders[index].history.count >= 2 * options.historyLimit {
                builders[index].history.removeFirst(builders[index].history.count - options.historyLimit)
            }
        }
        applied.append(Checkpointed(record: record, epoch: builders[index].epoch, position: position))
    }
}
