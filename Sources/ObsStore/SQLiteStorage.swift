// ObsStore — repositories persisted in SQLite (WAL mode), with group commit.
//
// One committer thread owns the write connection. It takes every revision queued since
// its last commit and writes them in one transaction: one commit, one WAL fsync for all
// the concurrent and pipelined writes of that moment (`sync = always`). With
// `sync = relaxed` a commit is acknowledged after write(2) and the WAL is fdatasync'ed by
// the maintenance thread at most every `interval`. History retention by count is applied
// inside each commit (each new revision pushes out at most one old one), by age in small
// batches while idle; WAL checkpoints run on the maintenance thread's own connection
// (PASSIVE: they never block the committer). A failed commit is rolled back; the
// committer then asks the database what it actually holds and reports each repository
// durable up to there and failed after — the daemon undoes the rest in memory.

import CSQLite
import ObsProtocol
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// When a write counts as durable.
public enum SyncPolicy: Sendable, Equatable, CustomStringConvertible {
    /// fsync before the reply; concurrent and pipelined writes share one fsync.
    case always
    /// Reply after write(2); fsync at most every `interval`. A power loss can lose the
    /// writes of the last `interval` (plus one commit); a crash of obsd alone loses nothing.
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
    public let commits = Atomic<Int>(0)
    public let fsyncs = Atomic<Int>(0)
    public let records = Atomic<Int>(0)
    public let failures = Atomic<Int>(0)
    /// Set by each commit, cleared by the relaxed-mode fdatasync.
    let dirty = Atomic<Bool>(false)
}

public final class SQLiteStorage: Storage {
    public struct Options: Sendable {
        public var directory: String
        public var sync: SyncPolicy
        /// Revisions of history kept per repository (0: none).
        public var historyLimit: Int
        /// History older than this is dropped (nil: no age limit).
        public var historyMaxAge: Duration?
        /// How often the WAL is checkpointed into the database file.
        public var checkpointInterval: Duration = .seconds(1)
        /// Test seam: a file whose content makes commits fail (see `FaultInjection`).
        /// nil in production.
        public var faultFile: String? = nil

        public init(directory: String, sync: SyncPolicy, historyLimit: Int, historyMaxAge: Duration?) {
            self.directory = directory
            self.sync = sync
            self.historyLimit = historyLimit
            self.historyMaxAge = historyMaxAge
        }
    }

    /// The file name inside the data directory.
    public static let fileName = "obsd.db"
    /// `PRAGMA application_id` of obsd databases: "obsd".
    static let applicationID: Int64 = 0x6F62_7364
    static let schemaVersion: Int64 = 2

    public let options: Options
    public let path: String
    public let counters: StorageCounters? = StorageCounters()
    private let queue = BlockingQueue<Queued>()
    private let lock: DirectoryLock
    private let loaded: Locked<[LoadedRepository]?>
    public let notices: [String]
    private let committer: DedicatedThread
    private let maintenance: DedicatedThread
    private let stopMaintenance = BlockingQueue<Bool>()

    struct Queued: Sendable {
        let record: RevisionRecord
        let listener: any DurabilityListener
    }

    /// Opens (or creates) the store and loads it; the store is ready to `append` on return.
    public init(options: Options) throws(StorageError) {
        self.options = options
        try DataDirectory.create(options.directory)
        lock = try DirectoryLock(directory: options.directory)
        path = options.directory + "/" + Self.fileName

        // The committer opens the connection and loads on its own thread, then keeps it.
        let handoff = BlockingQueue<Result<([LoadedRepository], renewed: String?), StorageError>>()
        let (queue, counters) = (self.queue, self.counters!)
        let (path, options) = (self.path, self.options)
        committer = DedicatedThread {
            Committer.run(path: path, options: options, queue: queue, counters: counters, handoff: handoff)
        }
        guard let result = handoff.takeAll(timeout: .seconds(3600))?.first else {
            committer.join()
            throw StorageError(.other, "\(path): the store did not open")
        }
        switch result {
        case .success(let (repositories, renewed)):
            loaded = Locked(repositories)
            notices = renewed.map { ["every repository starts a new epoch (clients resync instead of resuming): \($0)"] } ?? []
        case .failure(let error):
            committer.join()
            throw error
        }
        let stop = stopMaintenance
        maintenance = DedicatedThread {
            Maintenance.run(path: path, options: options, stop: stop, counters: counters)
        }
    }

    public var isImmediate: Bool { false }

    public var summary: String { "sqlite \(path), sync \(options.sync)" }

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
        queue.removeAll { $0.listener === listener && $0.record.revision > revision }
    }

    public func close() {
        queue.close()
        committer.join()
        stopMaintenance.close()
        maintenance.join()
    }
}

// MARK: - Committer

/// The committer thread's state: the write connection and its statements. Confined to that thread.
private final class Committer {
    let connection: SQLiteConnection
    let options: SQLiteStorage.Options
    let counters: StorageCounters
    let setRepoRevision: SQLiteStatement
    let insertRepo: SQLiteStatement
    let upsertEntry: SQLiteStatement
    let deleteEntry: SQLiteStatement
    let insertHistory: SQLiteStatement
    let trimHistory: SQLiteStatement
    let expireOldHistory: SQLiteStatement
    let repoRevision: SQLiteStatement
    var repoIDs: [String: Int64] = [:]
    /// The last revision reported durable, per listener.
    var reported: [ObjectIdentifier: UInt64] = [:]

    static func run(
        path: String, options: SQLiteStorage.Options, queue: BlockingQueue<SQLiteStorage.Queued>, counters: StorageCounters,
        handoff: BlockingQueue<Result<([LoadedRepository], renewed: String?), StorageError>>
    ) {
        let committer: Committer
        do {
            let (connection, migrated) = try Schema.open(path: path, options: options)
            let renewed = try Provenance.claim(connection, sync: options.sync, migrated: migrated)
            let repositories = try Loader.load(connection, options: options)
            committer = try Committer(connection: connection, options: options, counters: counters)
            for repo in repositories { committer.seed(repo) }
            handoff.append(.success((repositories, renewed)))
        } catch {
            handoff.append(.failure(error))
            return
        }
        while let batch = queue.takeAll(timeout: .seconds(1)) {
            if batch.isEmpty {
                committer.expireHistory()
            } else {
                committer.commit(batch)
            }
        }
        Provenance.release(committer.connection)
        try? committer.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        committer.connection.close()
    }

    init(connection: SQLiteConnection, options: SQLiteStorage.Options, counters: StorageCounters) throws(StorageError) {
        self.connection = connection
        self.options = options
        self.counters = counters
        setRepoRevision = try connection.prepare("UPDATE repos SET rev = ?2 WHERE id = ?1")
        insertRepo = try connection.prepare("INSERT INTO repos (name, rev, epoch) VALUES (?1, 0, ?2)")
        upsertEntry = try connection.prepare(
            "INSERT INTO entries (repo, key, value, rev) VALUES (?1, ?2, ?3, ?4) ON CONFLICT (repo, key) DO UPDATE SET value = excluded.value, rev = excluded.rev")
        deleteEntry = try connection.prepare("DELETE FROM entries WHERE repo = ?1 AND key = ?2")
        insertHistory = try connection.prepare("INSERT INTO history (repo, rev, time, changes) VALUES (?1, ?2, ?3, ?4)")
        trimHistory = try connection.prepare("DELETE FROM history WHERE repo = ?1 AND rev <= ?2")
        expireOldHistory = try connection.prepare(
            "DELETE FROM history WHERE (repo, rev) IN (SELECT repo, rev FROM history WHERE time < ?1 LIMIT 1000)")
        repoRevision = try connection.prepare("SELECT rev FROM repos WHERE name = ?1")
    }

    func seed(_ repo: LoadedRepository) {
        if let id = try? repoID(repo.name, epoch: repo.epoch) { repoIDs[repo.name] = id }
    }

    /// Writes a batch in one transaction, then reports durability (or failure) per repository.
    ///
    /// A record the database refuses while it is written (a value it will not hold, a
    /// constraint) fails alone, never the writes of others that share its group commit: the
    /// batch is retried one repository at a time, and a failing repository's records one at
    /// a time up to the refused one — its later revisions, built on it, fail with it. A
    /// failure of the commit itself (I/O, a full disk) fails the batch and is recovered from
    /// what the file holds.
    func commit(_ batch: [SQLiteStorage.Queued]) {
        switch attempt(batch) {
        case .committed:
            confirm(batch)
        case .failedCommitting(let error):
            recover(from: error, batch: batch)
        case .failedWriting(let error):
            if batch.count == 1 { return recover(from: error, batch: batch) }
            for group in Self.byRepository(batch) { isolate(group) }
        }
    }

    /// Commits one repository's records, alone; on a refused record, one at a time.
    private func isolate(_ group: [SQLiteStorage.Queued]) {
        switch attempt(group) {
        case .committed: return confirm(group)
        case .failedCommitting(let error): return recover(from: error, batch: group)
        case .failedWriting(let error) where group.count == 1: return recover(from: error, batch: group)
        case .failedWriting: break
        }
        for (i, item) in group.enumerated() {
            switch attempt([item]) {
            case .committed:
                confirm([item])
            case .failedCommitting(let error), .failedWriting(let error):
                return recover(from: error, batch: Array(group[i...]))
            }
        }
    }

    private enum Attempt {
        case committed
        /// A record was refused while being written; the transaction was rolled back.
        case failedWriting(StorageError)
        /// The transaction could not begin or commit.
        case failedCommitting(StorageError)
    }

    /// One transaction for `records`.
    private func attempt(_ records: [SQLiteStorage.Queued]) -> Attempt {
        do throws(StorageError) {
            try connection.execute("BEGIN IMMEDIATE")
        } catch {
            return .failedCommitting(error)
        }
        do throws(StorageError) {
            try write(records)
        } catch {
            try? connection.execute("ROLLBACK")
            repoIDs.removeAll()  // rows inserted by the rolled-back transaction are gone
            return .failedWriting(error)
        }
        do throws(StorageError) {
            let fault = FaultInjection.current(options.faultFile)
            if case .beforeCommit(let kind) = fault { throw StorageError(kind, "\(connection.path): injected fault (\(kind))") }
            try connection.execute("COMMIT")
            if case .afterCommit = fault { throw StorageError(.io, "\(connection.path): injected fault after the commit reached the file") }
        } catch {
            return .failedCommitting(error)
        }
        return .committed
    }

    /// Reports committed records durable.
    private func confirm(_ records: [SQLiteStorage.Queued]) {
        counters.commits.add(1, ordering: .relaxed)
        counters.records.add(records.count, ordering: .relaxed)
        if options.sync == .always { counters.fsyncs.add(1, ordering: .relaxed) }
        counters.dirty.store(true, ordering: .releasing)
        for (listener, revision) in Self.lastRevisions(records) {
            reported[ObjectIdentifier(listener)] = revision
            listener.durable(through: revision)
        }
    }

    /// Writes a batch: per record its history row; per repository its final revision, the
    /// final state of each key the batch touched, and one history trim.
    private func write(_ batch: [SQLiteStorage.Queued]) throws(StorageError) {
        // Per repository: its id, last revision in the batch, and each touched key's final
        // value (nil: deleted) with the revision that set it.
        var repos: [String: (id: Int64, last: UInt64, keys: [Key: (value: CanonicalJSON?, rev: UInt64)])] = [:]
        var order: [String] = []
        for item in batch {
            let record = item.record
            if repos[record.repo] == nil {
                repos[record.repo] = (try repoID(record.repo, epoch: item.listener.epoch), 0, [:])
                order.append(record.repo)
            }
            let id = repos[record.repo]!.id
            repos[record.repo]!.last = record.revision
            for change in record.changes { repos[record.repo]!.keys[change.key] = (change.new, record.revision) }
            guard options.historyLimit > 0 else { continue }
            try insertHistory.bind(1, id)
            try insertHistory.bind(2, Int64(bitPattern: record.revision))
            try insertHistory.bind(3, record.time)
            try insertHistory.bind(4, bytes: HistoryCodec.encode(record.changes))
            try insertHistory.run()
        }
        for name in order {
            let (id, last, keys) = repos[name]!
            let rev = Int64(bitPattern: last)
            try setRepoRevision.bind(1, id)
            try setRepoRevision.bind(2, rev)
            try setRepoRevision.run()
            for (key, final) in keys {
                if let value = final.value {
                    try upsertEntry.bind(1, id)
                    try upsertEntry.bind(2, lending: { key.withUTF8($0) })
                    try upsertEntry.bind(3, bytes: value.bytes)
                    try upsertEntry.bind(4, Int64(bitPattern: final.rev))
                    try upsertEntry.run()
                } else {
                    try deleteEntry.bind(1, id)
                    try deleteEntry.bind(2, lending: { key.withUTF8($0) })
                    try deleteEntry.run()
                }
            }
            if options.historyLimit > 0, last > UInt64(options.historyLimit) {
                try trimHistory.bind(1, id)
                try trimHistory.bind(2, rev - Int64(options.historyLimit))
                try trimHistory.run()
            }
        }
    }

    private func repoID(_ name: String, epoch: String) throws(StorageError) -> Int64 {
        if let id = repoIDs[name] { return id }
        let lookup = try connection.prepare("SELECT id FROM repos WHERE name = ?1")
        try lookup.bind(1, name)
        if try lookup.step() {
            let id = lookup.int64(0)
            repoIDs[name] = id
            return id
        }
        try insertRepo.bind(1, name)
        try insertRepo.bind(2, epoch)
        try insertRepo.run()
        let id = sqlite3_last_insert_rowid(connection.handle)
        repoIDs[name] = id
        return id
    }

    /// After a failed commit: roll back, learn what the file holds, report it.
    private func recover(from error: StorageError, batch: [SQLiteStorage.Queued]) {
        counters.failures.add(1, ordering: .relaxed)
        if connection.inTransaction { try? connection.execute("ROLLBACK") }
        repoIDs.removeAll()  // rows inserted by the failed transaction are gone
        for (listener, _) in Self.lastRevisions(batch) {
            let id = ObjectIdentifier(listener)
            var onDisk = reported[id] ?? 0
            let name = batch.first { $0.listener === listener }!.record.repo
            if (try? repoRevision.bind(1, name)) != nil, let stepped = try? repoRevision.step() {
                onDisk = stepped ? UInt64(bitPattern: repoRevision.int64(0)) : 0
            }
            repoRevision.reset()
            if onDisk > (reported[id] ?? 0) {
                // The commit reported an error yet reached the file (e.g. a failed fsync
                // after the write): what the file holds is what a restart would see.
                listener.durable(through: onDisk)
            }
            reported[id] = max(reported[id] ?? 0, onDisk)
            listener.failed(after: onDisk, error: error)
        }
    }

    /// Deletes history older than the age limit, a little at a time.
    func expireHistory() {
        guard let maxAge = options.historyMaxAge else { return }
        let cutoff = WallClock.unixSeconds() - maxAge.components.seconds
        do throws(StorageError) {
            while true {
                try expireOldHistory.bind(1, cutoff)
                while try expireOldHistory.step() {}
                let deleted = sqlite3_changes(connection.handle)
                expireOldHistory.reset()
                if deleted < 1000 { break }
            }
        } catch {
            counters.failures.add(1, ordering: .relaxed)
        }
    }

    /// The batch's records grouped by repository, in order of first appearance.
    static func byRepository(_ batch: [SQLiteStorage.Queued]) -> [[SQLiteStorage.Queued]] {
        var order: [ObjectIdentifier] = []
        var groups: [ObjectIdentifier: [SQLiteStorage.Queued]] = [:]
        for item in batch {
            let id = ObjectIdentifier(item.listener)
            if groups[id] == nil { order.append(id) }
            groups[id, default: []].append(item)
        }
        return order.map { groups[$0]! }
    }

    /// The highest revision per listener in a batch, in order of first appearance.
    static func lastRevisions(_ batch: [SQLiteStorage.Queued]) -> [(any DurabilityListener, UInt64)] {
        var order: [ObjectIdentifier] = []
        var latest: [ObjectIdentifier: (any DurabilityListener, UInt64)] = [:]
        for item in batch {
            let id = ObjectIdentifier(item.listener)
            if latest[id] == nil { order.append(id) }
            latest[id] = (item.listener, max(latest[id]?.1 ?? 0, item.record.revision))
        }
        return order.map { latest[$0]! }
    }
}

// MARK: - Fault injection

/// Test seam for failures that cannot be produced on demand. When the daemon was started
/// with `$OBSD_FAULT_FILE` and that file exists, its content injects a fault until the file
/// is removed: `commit full`, `commit readonly` or `commit io` fail each commit before
/// COMMIT (the transaction is rolled back, as with a real ENOSPC, EROFS or EIO);
/// `after-commit` lets COMMIT succeed but reports an error (as when a write reached the file
/// and a later fsync failed); `wedge-event-loop` blocks the server's heartbeat task, as a
/// wedged event loop would be. Never set in production.
public enum FaultInjection: Equatable {
    case none
    case beforeCommit(StorageError.Kind)
    case afterCommit

    /// The fault file's content, trimmed; nil when there is no file.
    public static func content(_ path: String) -> String? {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buffer = [UInt8](repeating: 0, count: 64)
        let n = read(fd, &buffer, buffer.count)
        guard n >= 0 else { return nil }
        return String(decoding: buffer[..<n], as: UTF8.self).trimmingWhitespace
    }

    static func current(_ path: String?) -> FaultInjection {
        guard let path, let content = content(path) else { return .none }
        switch content {
        case "commit full": return .beforeCommit(.full)
        case "commit readonly": return .beforeCommit(.readOnly)
        case "commit io": return .beforeCommit(.io)
        case "after-commit": return .afterCommit
        default: return .none
        }
    }
}

// MARK: - Maintenance

/// The maintenance thread: WAL checkpoints, and the relaxed-mode fdatasync.
private enum Maintenance {
    static func run(path: String, options: SQLiteStorage.Options, stop: BlockingQueue<Bool>, counters: StorageCounters) {
        guard let connection = try? SQLiteConnection(path: path, create: false) else { return }
        try? connection.execute("PRAGMA busy_timeout = 100")
        var syncInterval: Duration? = nil
        if case .relaxed(let interval) = options.sync { syncInterval = interval }
        let tick = min(syncInterval ?? options.checkpointInterval, options.checkpointInterval)
        // Open everything this thread will hold now, not at the first tick: a daemon's
        // descriptor count is then the same idle, under load and after it (soak checks it).
        try? connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
        var wal: Int32 = syncInterval == nil ? -1 : open(path + "-wal", O_RDONLY | O_CLOEXEC)
        var sinceCheckpoint = Duration.zero
        while stop.takeAll(timeout: tick) != nil {
            if syncInterval != nil, counters.dirty.exchange(false, ordering: .acquiringAndReleasing) {
                if wal < 0 { wal = open(path + "-wal", O_RDONLY | O_CLOEXEC) }
                if wal >= 0, fdatasync(wal) == 0 { counters.fsyncs.add(1, ordering: .relaxed) }
            }
            sinceCheckpoint += tick
            if sinceCheckpoint >= options.checkpointInterval {
                sinceCheckpoint = .zero
                try? connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
            }
        }
        if wal >= 0 {
            if syncInterval != nil, counters.dirty.exchange(false, ordering: .acquiringAndReleasing) { _ = fdatasync(wal) }
            close(wal)
        }
        connection.close()
    }
}
