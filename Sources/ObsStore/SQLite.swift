// ObsStore — a minimal SQLite wrapper: one connection, prepared statements, errors that
// name the database file. A connection is used by one thread at a time.

import CSQLite

final class SQLiteConnection {
    let path: String
    private(set) var handle: OpaquePointer?

    init(path: String, create: Bool) throws(StorageError) {
        self.path = path
        var db: OpaquePointer?
        let flags = SQLITE_OPEN_READWRITE | (create ? SQLITE_OPEN_CREATE : 0) | SQLITE_OPEN_NOMUTEX
        let rc = sqlite3_open_v2(path, &db, flags, nil)
        handle = db
        guard rc == SQLITE_OK else {
            let error = Self.error(rc, db, path: path, doing: "open")
            sqlite3_close_v2(db)
            handle = nil
            throw error
        }
        sqlite3_extended_result_codes(db, 1)
    }

    deinit { close() }

    func close() {
        if let handle { sqlite3_close_v2(handle) }
        handle = nil
    }

    /// Runs SQL that returns no rows (several statements allowed).
    func execute(_ sql: String) throws(StorageError) {
        var message: UnsafeMutablePointer<CChar>?
        let rc = sqlite3_exec(handle, sql, nil, nil, &message)
        if let message { sqlite3_free(message) }
        guard rc == SQLITE_OK else { throw error(rc, doing: "run \(sql.prefix(60))") }
    }

    func prepare(_ sql: String) throws(StorageError) -> SQLiteStatement {
        var statement: OpaquePointer?
        let rc = sqlite3_prepare_v3(handle, sql, -1, UInt32(SQLITE_PREPARE_PERSISTENT), &statement, nil)
        guard rc == SQLITE_OK, let statement else { throw error(rc, doing: "prepare \(sql.prefix(60))") }
        return SQLiteStatement(statement, connection: self)
    }

    /// The single integer a query returns.
    func integer(_ sql: String) throws(StorageError) -> Int64 {
        let statement = try prepare(sql)
        guard try statement.step() else { throw StorageError(.corrupt, "\(path): \(sql) returned no row") }
        return statement.int64(0)
    }

    var inTransaction: Bool { sqlite3_get_autocommit(handle) == 0 }

    func error(_ rc: Int32, doing action: String) -> StorageError {
        Self.error(rc, handle, path: path, doing: action)
    }

    static func error(_ rc: Int32, _ db: OpaquePointer?, path: String, doing action: String) -> StorageError {
        let text = db.map { String(cString: sqlite3_errmsg($0)) } ?? String(cString: sqlite3_errstr(rc))
        let kind: StorageError.Kind
        switch rc & 0xFF {
        case SQLITE_FULL: kind = .full
        case SQLITE_READONLY, SQLITE_PERM, SQLITE_CANTOPEN, SQLITE_AUTH: kind = .readOnly
        case SQLITE_IOERR: kind = .io
        case SQLITE_CORRUPT, SQLITE_NOTADB, SQLITE_FORMAT: kind = .corrupt
        case SQLITE_BUSY, SQLITE_LOCKED: kind = .locked
        default: kind = .other
        }
        return StorageError(kind, "\(path): cannot \(action): \(text)")
    }
}

@available(*, unavailable)
extension SQLiteConnection: Sendable {}

final class SQLiteStatement {
    private let statement: OpaquePointer
    private unowned let connection: SQLiteConnection

    init(_ statement: OpaquePointer, connection: SQLiteConnection) {
        self.statement = statement
        self.connection = connection
    }

    deinit { sqlite3_finalize(statement) }

    // Binding fails for a value SQLite will not hold (SQLITE_TOOBIG past its length limit,
    // SQLITE_NOMEM): that is an error of this statement, reported as one — never a NULL
    // silently left in its place.

    func bind(_ index: Int32, _ value: Int64) throws(StorageError) {
        try check(sqlite3_bind_int64(statement, index, value), index)
    }

    func bind(_ index: Int32, _ text: String) throws(StorageError) {
        try check(sqlite3_bind_text64(statement, index, text, UInt64(text.utf8.count), obs_sqlite_transient(), UInt8(SQLITE_UTF8)), index)
    }

    func bind(_ index: Int32, bytes: [UInt8]) throws(StorageError) {
        try bytes.withUnsafeBufferPointer { (b) throws(StorageError) in try bind(index, bytes: b) }
    }

    func bind(_ index: Int32, bytes: UnsafeBufferPointer<UInt8>) throws(StorageError) {
        try check(Self.bindBlob(statement, index, bytes), index)
    }

    func bindNull(_ index: Int32) throws(StorageError) {
        try check(sqlite3_bind_null(statement, index), index)
    }

    /// Binds the bytes `body` is given, for callers whose bytes are only lent to a closure.
    func bind(_ index: Int32, lending: ((UnsafeBufferPointer<UInt8>) -> Int32) -> Int32) throws(StorageError) {
        let statement = self.statement
        try check(lending { Self.bindBlob(statement, index, $0) }, index)
    }

    private static func bindBlob(_ statement: OpaquePointer, _ index: Int32, _ bytes: UnsafeBufferPointer<UInt8>) -> Int32 {
        // A zero-length blob must not be bound as NULL: give SQLite a non-null pointer.
        let pointer = bytes.baseAddress.map { UnsafeRawPointer($0) } ?? UnsafeRawPointer(bitPattern: 1)
        return sqlite3_bind_blob64(statement, index, pointer, UInt64(bytes.count), obs_sqlite_transient())
    }

    func check(_ rc: Int32, _ index: Int32) throws(StorageError) {
        guard rc == SQLITE_OK else {
            throw connection.error(rc, doing: "bind parameter \(index) of \(String(cString: sqlite3_sql(statement)).prefix(60))")
        }
    }

    /// Steps once: `true` when a row is available, `false` when done.
    func step() throws(StorageError) -> Bool {
        let rc = sqlite3_step(statement)
        switch rc {
        case SQLITE_ROW: return true
        case SQLITE_DONE: return false
        default:
            sqlite3_reset(statement)
            throw connection.error(rc, doing: "step \(String(cString: sqlite3_sql(statement)).prefix(60))")
        }
    }

    /// Steps to completion and resets, ready for the next use.
    func run() throws(StorageError) {
        while try step() {}
        reset()
    }

    func reset() {
        sqlite3_reset(statement)
        sqlite3_clear_bindings(statement)
    }

    func int64(_ column: Int32) -> Int64 { sqlite3_column_int64(statement, column) }

    func text(_ column: Int32) -> String {
        guard let p = sqlite3_column_text(statement, column) else { return "" }
        return String(cString: p)
    }

    /// The column's bytes, valid until the next step or reset.
    func blob(_ column: Int32) -> UnsafeRawBufferPointer {
        let count = Int(sqlite3_column_bytes(statement, column))
        guard let p = sqlite3_column_blob(statement, column), count > 0 else { return UnsafeRawBufferPointer(start: nil, count: 0) }
        return UnsafeRawBufferPointer(start: p, count: count)
    }
}

@available(*, unavailable)
extension SQLiteStatement: Sendable {}
