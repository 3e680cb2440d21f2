// ObsStore — the checkpointer thread: brings the compacted state (SQLite) up to date with
// the write-ahead log, off the acknowledgement path.
//
// Every `checkpointInterval` it takes the revisions the committer made durable since its
// last batch and applies them in one SQLite transaction: per record a history row, per
// repository its last revision and the final value of each key the batch touched, history
// trimmed to its count and byte limits, and `meta.wal_applied` — how far the log is now
// applied. Once that transaction is durable, the log segments it covers are deleted.
// History older than the age limit goes as a prefix by revision, once a second.
//
// A batch that fails (a full disk) is rolled back, logged and retried with the next one:
// the log still holds every revision, so nothing is lost — the log just grows until the
// compacted state can take it again.

import CSQLite
import Logging
import ObsValues
import ObservableKit

/// A durable revision on its way to the compacted state: the record, its repository's
/// epoch (stored if the repository is new), and the log position it ends at.
struct Checkpointed: Sendable {
    let record: RevisionRecord
    let epoch: String
    let position: UInt64
}

/// Revisions for the checkpointer, handed over by the committer.
final class CheckpointQueue: Sendable {
    private let items: Locked<[Checkpointed]>
    /// Never filled, only closed: lets the checkpointer sleep until the next batch and wake
    /// at once when the store closes.
    private let bell = BlockingQueue<Bool>()

    /// A queue holding `backlog` (revisions replayed from the log at start-up).
    init(backlog: [Checkpointed]) { items = Locked(backlog) }

    func append(_ new: [Checkpointed]) { items.withLock { $0.append(contentsOf: new) } }

    /// Sleeps for `duration` (less if the queue is closed meanwhile), then takes
    /// everything queued; `closed` once no more will come.
    func take(after duration: Duration) -> (items: [Checkpointed], closed: Bool) {
        let closed = bell.takeAll(timeout: duration) == nil
        let taken = items.withLock { items -> [Checkpointed] in
            defer { items = [] }
            return items
        }
        return (taken, closed)
    }

    func close() { bell.close() }
}

final class Checkpointer {
    private let connection: SQLiteConnection
    private let options: DiskStorage.Options
    private let log: WriteAheadLog.Directory
    private let counters: StorageCounters
    private let logger: Logger
    private var retention: HistoryRetention
    private var repoIDs: [String: Int64] = [:]
    /// While batches fail: since when, and when that was last logged (once a minute).
    private var failing: (since: ContinuousClock.Instant, logged: ContinuousClock.Instant)? = nil

    private let setRepoRevision: SQLiteStatement
    private let insertRepo: SQLiteStatement
    private let findRepo: SQLiteStatement
    private let upsertEntry: SQLiteStatement
    private let deleteEntry: SQLiteStatement
    private let insertHistory: SQLiteStatement
    private let trimHistory: SQLiteStatement
    private let expiredHistory: SQLiteStatement
    private let setApplied: SQLiteStatement

    /// Prepares the checkpointer of `connection`, whose history windows start as `seed`
    /// (the repositories as the compacted state holds them).
    init(
        connection: SQLiteConnection, options: DiskStorage.Options, log: WriteAheadLog.Directory, seed: [LoadedRepository],
        counters: StorageCounters, logger: Logger
    ) throws(StorageError) {
        self.connection = connection
        self.options = options
        self.log = log
        self.retention = HistoryRetention(limit: options.historyLimit, maxBytes: options.historyMaxBytes)
        self.counters = counters
        self.logger = logger
        setRepoRevision = try connection.prepare("UPDATE repos SET rev = ?2 WHERE id = ?1")
        insertRepo = try connection.prepare("INSERT INTO repos (name, rev, epoch) VALUES (?1, 0, ?2)")
        findRepo = try connection.prepare("SELECT id FROM repos WHERE name = ?1")
        upsertEntry = try connection.prepare(
            "INSERT INTO entries (repo, key, value, rev) VALUES (?1, ?2, ?3, ?4) ON CONFLICT (repo, key) DO UPDATE SET value = excluded.value, rev = excluded.rev")
        deleteEntry = try connection.prepare("DELETE FROM entries WHERE repo = ?1 AND key = ?2")
        insertHistory = try connection.prepare("INSERT OR REPLACE INTO history (repo, rev, time, changes, writer) VALUES (?1, ?2, ?3, ?4, ?5)")
        trimHistory = try connection.prepare("DELETE FROM history WHERE repo = ?1 AND rev <= ?2")
        expiredHistory = try connection.prepare("SELECT repo, max(rev) FROM history WHERE time < ?1 GROUP BY repo")
        setApplied = try connection.prepare("INSERT OR REPLACE INTO meta (key, value) VALUES ('wal_applied', ?1)")
        for repository in seed where !repository.history.isEmpty {
            retention.seed(try repoID(repository.name, epoch: repository.epoch), repository.history)
        }
        // The compacted state is already durable: the log before it can go.
        log.removeSegments(through: try Loader.checkpoint(connection))
    }

    /// Applies batches until the queue closes, then marks the file left cleanly.
    func run(_ queue: CheckpointQueue) {
        var pending: [Checkpointed] = []
        var lastExpiry = ContinuousClock.now
        while true {
            let (items, closed) = queue.take(after: options.checkpointInterval)
            pending.append(contentsOf: items)
            if !pending.isEmpty, apply(pending) { pending = [] }
            if options.historyMaxAge != nil, ContinuousClock.now - lastExpiry >= .seconds(1) {
                expireHistory()
                lastExpiry = .now
            }
            if closed { break }
        }
        if pending.isEmpty {
            // Only a file whose state holds the whole log counts as left cleanly (the
            // provenance check reads it); otherwise the next start replays the rest.
            Provenance.release(connection)
        }
        try? connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connection.close()
    }

    /// Applies a batch in one transaction; whether it was applied.
    private func apply(_ batch: [Checkpointed]) -> Bool {
        do throws(StorageError) {
            retention.begin()
            try connection.execute("BEGIN IMMEDIATE")
            try write(batch)
            try connection.execute("COMMIT")
            retention.commit()
        } catch {
            if connection.inTransaction { try? connection.execute("ROLLBACK") }
            repoIDs.removeAll()  // rows inserted by the rolled-back transaction are gone
            retention.rollback()
            counters.checkpointFailures.add(1, ordering: .relaxed)
            let now = ContinuousClock.now
            if failing == nil || now - failing!.logged >= .seconds(60) {
                logger.error(
                    "cannot bring the compacted state up to date; the write-ahead log keeps every write and grows until it can",
                    metadata: [
                        "error": "\(error.description)", "pending": "\(batch.count)",
                        "failingSeconds": "\(failing.map { (now - $0.since).components.seconds } ?? 0)",
                    ])
                failing = (failing?.since ?? now, now)
            }
            return false
        }
        if let failing {
            logger.notice("the compacted state is up to date again", metadata: ["failedSeconds": "\((ContinuousClock.now - failing.since).components.seconds)"])
            self.failing = nil
        }
        counters.checkpoints.add(1, ordering: .relaxed)
        log.removeSegments(through: batch[batch.count - 1].position)
        return true
    }

    /// Writes a batch: per record its history row; per repository its final revision, the
    /// final state of each key the batch touched, and the history trim; the log position.
    private func write(_ batch: [Checkpointed]) throws(StorageError) {
        var repos: [String: (id: Int64, last: UInt64, keys: [Key: (value: CanonicalJSON?, rev: UInt64)])] = [:]
        var order: [String] = []
        for item in batch {
            let record = item.record
            if repos[record.repo] == nil {
                repos[record.repo] = (try repoID(record.repo, epoch: item.epoch), 0, [:])
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
            if let writer = record.writer {
                try insertHistory.bind(5, bytes: HistoryCodec.encode(writer))
            } else {
                try insertHistory.bindNull(5)
            }
            try insertHistory.run()
            retention.append(id, revision: record.revision, bytes: record.byteSize)
        }
        for name in order {
            let (id, last, keys) = repos[name]!
            try setRepoRevision.bind(1, id)
            try setRepoRevision.bind(2, Int64(bitPattern: last))
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
            if let through = retention.trim(id) {
                try trimHistory.bind(1, id)
                try trimHistory.bind(2, Int64(bitPattern: through))
                try trimHistory.run()
            }
        }
        try setApplied.bind(1, String(batch[batch.count - 1].position))
        try setApplied.run()
    }

    private func repoID(_ name: String, epoch: String) throws(StorageError) -> Int64 {
        if let id = repoIDs[name] { return id }
        try findRepo.bind(1, name)
        defer { findRepo.reset() }
        if try findRepo.step() {
            let id = findRepo.int64(0)
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

    /// Deletes, per repository, the history up to its newest revision older than the age
    /// limit: always a prefix, so the history stays contiguous whatever the clock did.
    private func expireHistory() {
        guard let maxAge = options.historyMaxAge else { return }
        let cutoff = WallClock.unixSeconds() - maxAge.components.seconds
        do throws(StorageError) {
            try expiredHistory.bind(1, cutoff)
            var expired: [(Int64, Int64)] = []
            while try expiredHistory.step() { expired.append((expiredHistory.int64(0), expiredHistory.int64(1))) }
            expiredHistory.reset()
            guard !expired.isEmpty else { return }
            retention.begin()
            try connection.execute("BEGIN IMMEDIATE")
            for (repo, through) in expired {
                try trimHistory.bind(1, repo)
                try trimHistory.bind(2, through)
                try trimHistory.run()
                retention.drop(repo, through: UInt64(bitPattern: through))
            }
            try connection.execute("COMMIT")
            retention.commit()
        } catch {
            expiredHistory.reset()
            if connection.inTransaction { try? connection.execute("ROLLBACK") }
            retention.rollback()
            logger.warning("cannot expire old history (retried in a second)", metadata: ["error": "\(error.description)"])
        }
    }
}

/// Which history rows each repository keeps: the newest `limit` revisions, within
/// `maxBytes` (the newest revision is kept whatever its size) — the server's in-memory
/// history keeps the same window, so a restart serves the same `since` range. Changed in
/// transactions like the database it mirrors: `begin`, then `commit` or `rollback`.
struct HistoryRetention {
    let limit: Int
    let maxBytes: Int

    private struct Window {
        /// Retained revisions with their sizes, oldest first, from `head` on.
        var revisions: [(revision: UInt64, bytes: Int)] = []
        var head = 0
        var bytes = 0
        var count: Int { revisions.count - head }
    }

    private var windows: [Int64: Window] = [:]
    /// Each window as it was before the transaction first touched it.
    private var journal: [Int64: (count: Int, head: Int, bytes: Int)] = [:]

    init(limit: Int, maxBytes: Int) {
        self.limit = limit
        self.maxBytes = maxBytes
    }

    /// Seeds a repository's window from its loaded history (outside any transaction).
    mutating func seed(_ id: Int64, _ history: [RevisionRecord]) {
        for record in history { append(id, revision: record.revision, bytes: record.byteSize) }
        journal = [:]
    }

    mutating func begin() { journal = [:] }

    mutating func append(_ id: Int64, revision: UInt64, bytes: Int) {
        touch(id)
        windows[id, default: Window()].revisions.append((revision, bytes))
        windows[id]!.bytes += bytes
    }

    /// Drops the oldest revisions beyond the limits; the newest revision dropped, if any.
    mutating func trim(_ id: Int64) -> UInt64? {
        guard var window = windows[id] else { return nil }
        touch(id)
        var dropped: UInt64? = nil
        while window.count > limit || (window.bytes > maxBytes && window.count > 1) {
            let oldest = window.revisions[window.head]
            window.bytes -= oldest.bytes
            window.head += 1
            dropped = oldest.revision
        }
        windows[id] = window
        return dropped
    }

    /// Forgets revisions up to `revision` (expired by age).
    mutating func drop(_ id: Int64, through revision: UInt64) {
        guard var window = windows[id] else { return }
        touch(id)
        while window.head < window.revisions.count, window.revisions[window.head].revision <= revision {
            window.bytes -= window.revisions[window.head].bytes
            window.head += 1
        }
        windows[id] = window
    }

    /// The transaction reached the file: what it dropped is gone for good.
    mutating func commit() {
        for id in journal.keys {
            guard var window = windows[id], window.head > 0 else { continue }
            if window.head >= 1024 || window.head * 2 >= window.revisions.count {
                window.revisions.removeFirst(window.head)
                window.head = 0
                windows[id] = window
            }
        }
        journal = [:]
    }

    /// The transaction was rolled back: every window is as it was at `begin`.
    mutating func rollback() {
        for (id, before) in journal {
            guard var window = windows[id] else { continue }
            window.revisions.removeLast(window.revisions.count - before.count)
            window.head = before.head
            window.bytes = before.bytes
            windows[id] = window
        }
        journal = [:]
    }

    private mutating func touch(_ id: Int64) {
        guard journal[id] == nil else { return }
        let window = windows[id] ?? Window()
        journal[id] = (window.revisions.count, window.head, window.bytes)
    }
}
