// ObsStore — the compacted state as obsd kept it before snapshots: SQLite, `obsd.db`. Read
// once, to move a data directory an earlier obsd wrote to a snapshot (DiskStorage): its schema
// (earlier versions migrated, foreign files refused), the provenance checks that decide
// whether the file still holds the history its epochs name, and loading every repository
// (it kept no tombstones: a catch-up from before the migrated state is a snapshot).

import CSQLite
import ObsValues
import ObservableKit
import SystemPackage

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

// MARK: - Schema and loading

enum Schema {
    /// Opens the database, creating its schema if the file is new, migrating an older one;
    /// refuses foreign files. Returns the connection and whether the schema was migrated
    /// from version 1 (which had no epochs).
    static func open(path: String, options: DiskStorage.Options) throws(StorageError) -> (SQLiteConnection, migrated: Bool) {
        let connection = try SQLiteConnection(path: path, create: true)
        do throws(StorageError) {
            try connection.execute("PRAGMA busy_timeout = 5000")
            let mode = try connection.prepare("PRAGMA journal_mode = WAL")
            guard try mode.step(), mode.text(0) == "wal" else {
                throw StorageError(.other, "\(path): cannot switch to WAL mode")
            }
        } catch {
            throw explain(error, path: path)
        }
        // The compacted state is written off the acknowledgement path and the log before it
        // is deleted once it is durable: every transaction is synced.
        try connection.execute("PRAGMA synchronous = FULL")
        // Only the checkpointer thread writes SQLite: its own commits checkpoint SQLite's WAL
        // (every 1000 pages), off the acknowledgement path.
        try connection.execute("PRAGMA wal_autocheckpoint = 1000; PRAGMA journal_size_limit = 67108864; PRAGMA cache_size = -8192; PRAGMA temp_store = MEMORY")
        let application = try connection.integer("PRAGMA application_id")
        let version = try connection.integer("PRAGMA user_version")
        let tables = try connection.integer("SELECT count(*) FROM sqlite_master")
        if application == 0 && version == 0 && tables == 0 {
            try connection.execute(
                """
                BEGIN;
                PRAGMA application_id = \(DiskStorage.applicationID);
                PRAGMA user_version = \(DiskStorage.schemaVersion);
                CREATE TABLE repos (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, rev INTEGER NOT NULL, epoch TEXT NOT NULL);
                CREATE TABLE entries (
                    repo INTEGER NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL, rev INTEGER NOT NULL,
                    PRIMARY KEY (repo, key)) WITHOUT ROWID;
                CREATE TABLE history (
                    repo INTEGER NOT NULL, rev INTEGER NOT NULL, time INTEGER NOT NULL, changes BLOB NOT NULL, writer BLOB,
                    PRIMARY KEY (repo, rev)) WITHOUT ROWID;
                CREATE INDEX history_time ON history (time);
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
                COMMIT;
                """)
            return (connection, false)
        }
        guard application == DiskStorage.applicationID else {
            throw StorageError(.corrupt, "\(path) is not an obsd database (SQLite application_id \(application)); refusing to use it")
        }
        if version == 1 {
            // Version 1 had no epochs and no provenance: every repository starts a new epoch.
            var statements = "BEGIN; ALTER TABLE repos ADD COLUMN epoch TEXT NOT NULL DEFAULT '';"
            statements += " CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;"
            statements += " ALTER TABLE history ADD COLUMN writer BLOB;"
            statements += " PRAGMA user_version = \(DiskStorage.schemaVersion); COMMIT;"
            try connection.execute(statements)
            return (connection, true)
        }
        if version == 2 {
            // Version 2 did not record who wrote a revision: its history has no writers.
            try connection.execute("BEGIN; ALTER TABLE history ADD COLUMN writer BLOB; PRAGMA user_version = \(DiskStorage.schemaVersion); COMMIT;")
            return (connection, false)
        }
        guard version == DiskStorage.schemaVersion else {
            throw StorageError(.corrupt, "\(path) has schema version \(version); this obsd reads versions 1 to \(DiskStorage.schemaVersion)")
        }
        return (connection, false)
    }

    static func explain(_ error: StorageError, path: String) -> StorageError {
        guard error.kind == .corrupt else { return error }
        return StorageError(.corrupt, "\(path) is not an obsd database or is damaged (\(error.description)); refusing to start")
    }
}

// MARK: - Provenance

/// Whether the file still holds the history its epochs name. An epoch promises that every
/// revision a client saw under it is still here; the store keeps that promise only while it
/// can show that the file is the one it wrote, and that no acknowledged revision was lost:
///
/// - `meta.file` records the database file's identity (inode and birth time). A different
///   identity means a copy — a restored backup, a directory copied in — whose history may
///   have been continued elsewhere or may end before revisions clients already saw.
/// - `meta.run` is `running <boot id> <sync policy>` while a daemon uses the file and
///   `clean` once it stopped. Found `running`, the last daemon stopped uncleanly; under
///   `sync = relaxed` with another boot id the machine went down with it, and the writes of
///   its last sync interval — acknowledged, perhaps seen — may be gone.
///
/// Either way every repository gets a new epoch, so clients resync instead of resuming.
enum Provenance {
    /// Checks the file, renews the epochs if it cannot vouch for them, and marks it in use
    /// (durably, before any write). Returns why the epochs were renewed, if they were.
    static func claim(_ connection: SQLiteConnection, sync: SyncPolicy, migrated: Bool) throws(StorageError) -> String? {
        let path = connection.path
        let identity = try fileIdentity(path)
        let recordedIdentity = try meta(connection, "file")
        let run = try meta(connection, "run")
        var reason: String? = nil
        if migrated {
            reason = "\(path) was written by an obsd that did not keep epochs"
        } else if let recordedIdentity, recordedIdentity != identity {
            reason = "\(path) is not the file this store last wrote (a copy, or a restored backup)"
        } else if let run, run.hasPrefix("running "), run.hasSuffix(" relaxed"), bootID == "unknown" || !run.contains(" \(bootID) ") {
            reason = "the last obsd on \(path) stopped uncleanly under sync = relaxed and the machine restarted since: writes it acknowledged in its last sync interval may be lost"
        }
        let policy = sync == .always ? "always" : "relaxed"
        var statements = "BEGIN;"
        if reason != nil || migrated {
            let ids = try connection.prepare("SELECT id FROM repos")
            var all: [Int64] = []
            while try ids.step() { all.append(ids.int64(0)) }
            for id in all { statements += " UPDATE repos SET epoch = '\(Epoch.random())' WHERE id = \(id);" }
        }
        statements += " INSERT OR REPLACE INTO meta (key, value) VALUES ('file', '\(identity)'), ('run', 'running \(bootID) \(policy)');"
        statements += " COMMIT;"
        try connection.execute(statements)
        return reason
    }

    /// Marks the file as left cleanly (the caller checkpoints it afterwards).
    static func release(_ connection: SQLiteConnection) {
        try? connection.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('run', 'clean')")
    }

    private static func meta(_ connection: SQLiteConnection, _ key: String) throws(StorageError) -> String? {
        let statement = try connection.prepare("SELECT value FROM meta WHERE key = ?1")
        try statement.bind(1, key)
        return try statement.step() ? statement.text(0) : nil
    }

    /// The database file's identity (`FileDescriptor.identity`).
    static func fileIdentity(_ path: String) throws(StorageError) -> String {
        let fd = try attempt("cannot open \(path)", kind: .readOnly) { () throws(Errno) in try FilePath(path).open(.readOnly) }
        defer { try? fd.close() }
        return try attempt("cannot stat \(path)", kind: .io) { () throws(Errno) in try fd.identity() }
    }

    /// This boot of the machine (`/proc/sys/kernel/random/boot_id`), or "unknown".
    static let bootID: String = {
        guard let bytes = try? FilePath("/proc/sys/kernel/random/boot_id").readPrefix(64), !bytes.isEmpty else { return "unknown" }
        return String(decoding: bytes, as: UTF8.self).trimmingWhitespace
    }()
}

/// What the compacted state holds at start-up.
struct StoredState {
    let repositories: [LoadedRepository]
    /// How far the write-ahead log is applied to it (`meta.wal_applied`; 0: none of it).
    let checkpoint: UInt64
}

enum Loader {
    /// Reads every repository — entries and retained history — and the log checkpoint.
    static func load(_ connection: SQLiteConnection, options: DiskStorage.Options) throws(StorageError) -> StoredState {
        do throws(StorageError) {
            return StoredState(repositories: try read(connection, options: options), checkpoint: try checkpoint(connection))
        } catch {
            throw Schema.explain(error, path: connection.path)
        }
    }

    /// How far the write-ahead log is applied to the compacted state.
    static func checkpoint(_ connection: SQLiteConnection) throws(StorageError) -> UInt64 {
        let statement = try connection.prepare("SELECT value FROM meta WHERE key = 'wal_applied'")
        guard try statement.step() else { return 0 }
        guard let position = UInt64(statement.text(0)) else {
            throw StorageError(.corrupt, "\(connection.path): meta.wal_applied is not a log position")
        }
        return position
    }

    /// The history a repository keeps: the contiguous run of revisions ending at its newest,
    /// minus its oldest beyond `limit` revisions or `maxBytes` (the newest always stays).
    /// Contiguity is by revision, never by time: a clock step cannot break it.
    static func retained(_ history: [RevisionRecord], limit: Int, maxBytes: Int) -> [RevisionRecord] {
        guard limit > 0, var start = history.indices.last else { return [] }
        var bytes = history[start].byteSize
        while start > 0, history.count - start < limit, history[start - 1].revision + 1 == history[start].revision,
            bytes + history[start - 1].byteSize <= maxBytes
        {
            start -= 1
            bytes += history[start].byteSize
        }
        return Array(history[start...])
    }

    private static func read(_ connection: SQLiteConnection, options: DiskStorage.Options) throws(StorageError) -> [LoadedRepository] {
        let path = connection.path
        var names: [Int64: String] = [:]
        var revisions: [Int64: UInt64] = [:]
        var epochs: [Int64: String] = [:]
        let repos = try connection.prepare("SELECT id, name, rev, epoch FROM repos")
        while try repos.step() {
            names[repos.int64(0)] = repos.text(1)
            revisions[repos.int64(0)] = UInt64(bitPattern: repos.int64(2))
            epochs[repos.int64(0)] = repos.text(3)
        }

        var entries: [Int64: [Key: Entry<CanonicalJSON>]] = [:]
        let counts = try connection.prepare("SELECT repo, count(*) FROM entries GROUP BY repo")
        while try counts.step() { entries[counts.int64(0)] = Dictionary(minimumCapacity: Int(counts.int64(1))) }
        let rows = try connection.prepare("SELECT repo, key, value, rev FROM entries")
        while try rows.step() {
            let repo = rows.int64(0)
            guard let key = String(validating: rows.blob(1), as: UTF8.self) else {
                throw StorageError(.corrupt, "\(path): a key of repository \(names[repo] ?? "?") is not UTF-8")
            }
            let value = try storedValue(rows.blob(2), path: path, key: key)
            entries[repo, default: [:]][Key(key)] = Entry(value: value, revision: UInt64(bitPattern: rows.int64(3)))
        }

        var histories: [Int64: [RevisionRecord]] = [:]
        if options.historyLimit > 0 {
            // Newest first, so each repository reads only what it keeps; age expiry drops a
            // prefix by revision (up to the newest revision older than the limit).
            let cutoff = options.historyMaxAge.map { WallClock.unixSeconds() - $0.components.seconds } ?? Int64.min
            let history = try connection.prepare("SELECT repo, rev, time, changes, writer FROM history ORDER BY repo, rev DESC")
            var expiredFrom: Set<Int64> = []
            while try history.step() {
                let repo = history.int64(0)
                guard let name = names[repo], !expiredFrom.contains(repo), histories[repo, default: []].count < options.historyLimit else { continue }
                if history.int64(2) < cutoff {
                    expiredFrom.insert(repo)
                    continue
                }
                let rev = UInt64(bitPattern: history.int64(1))
                let changes = try self.changes(history.blob(3), path: path, repo: name, rev: rev)
                histories[repo, default: []].append(
                    RevisionRecord(
                        repo: name, changeSet: ChangeSet(revision: rev, changes: changes), time: history.int64(2),
                        writer: HistoryCodec.writer(history.blob(4))))
            }
        }

        return try names.keys.sorted().map { (id) throws(StorageError) -> LoadedRepository in
            let name = names[id]!
            let revision = revisions[id] ?? 0
            var history = retained(histories[id]?.reversed() ?? [], limit: options.historyLimit, maxBytes: options.historyMaxBytes)
            if history.last?.revision != revision { history = [] }  // a history that does not reach the state serves no `since`
            guard let epoch = epochs[id], Epoch.isValid(epoch) else {
                throw StorageError(.corrupt, "\(path): repository \(name) has no valid epoch")
            }
            // It kept no tombstones: the deletions before its state are not known.
            return LoadedRepository(
                name: name, epoch: epoch, state: FlatTable(revision: revision, entries: entries[id] ?? [:]), history: history, tombstones: nil)
        }
    }

    private static func storedValue(_ bytes: UnsafeRawBufferPointer, path: String, key: String) throws(StorageError) -> CanonicalJSON {
        do {
            return try CanonicalJSON(validating: bytes, maxDepth: 100_000)
        } catch {
            throw StorageError(.corrupt, "\(path): the value of key \(key.debugDescription) is not valid JSON (\(error))")
        }
    }

    private static func changes(_ bytes: UnsafeRawBufferPointer, path: String, repo: String, rev: UInt64) throws(StorageError) -> [Change<CanonicalJSON>] {
        guard let changes = HistoryCodec.decode(bytes) else {
            throw StorageError(.corrupt, "\(path): history revision \(rev) of repository \(repo) is damaged")
        }
        return changes
    }
}

/// Wall-clock time for history timestamps.
public enum WallClock {
    /// Seconds since 1970.
    public static func unixSeconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return Int64(now.tv_sec)
    }
}
