// ObsStore — why storage failed: the one error every store (the log and snapshot, SQLite,
// a shared store's adapter) throws, its kind what a caller decides on, its message naming
// the file; and what a failed file system call's `Errno` means (FileSystem.swift).

import SystemPackage

/// Why storage failed. The message names the file and says what went wrong.
public struct StorageError: Error, Sendable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        /// The disk or file system is full.
        case full
        /// The file or file system is read-only, or permission is denied.
        case readOnly
        /// Reading or writing failed (including fsync).
        case io
        /// The file is not an obsd database, or its content is damaged.
        case corrupt
        /// Another process holds the data directory.
        case locked
        /// A write failed and could not be undone in the store: whether it is stored is not
        /// known, and a restart may apply it (as an ordinary revision). The store takes no
        /// more writes until then.
        case outcomeUnknown
        case other
    }

    public let kind: Kind
    public let description: String

    public init(_ kind: Kind, _ description: String) {
        self.kind = kind
        self.description = description
    }
}

extension StorageError {
    /// An error for a file system call that failed with `code`: `what` (the call and the
    /// file: "cannot open <path>"), then the system's text for the code (strerror), and for a
    /// full file system a hint; of the kind the code means, unless `kind` says.
    init(_ code: Errno, _ what: String, kind: Kind? = nil) {
        let kind = kind ?? Self.kind(of: code)
        let hint = kind == .full ? " (the file system is full)" : ""
        self.init(kind, "\(what): \(code.description)\(hint)")
    }

    /// The kind of failure `code` means.
    static func kind(of code: Errno) -> Kind {
        switch code {
        case .noSpace, .diskQuotaExceeded: .full
        case .readOnlyFileSystem, .permissionDenied, .notPermitted: .readOnly
        case .ioError: .io
        default: .other
        }
    }
}

/// What `body` returns; when it fails, the error its `Errno` means, said as `what` (see
/// `StorageError.init(_:_:kind:)`).
@inline(__always)
func attempt<T>(_ what: @autoclosure () -> String, kind: StorageError.Kind? = nil, _ body: () throws(Errno) -> T) throws(StorageError) -> T {
    do throws(Errno) {
        return try body()
    } catch {
        throw StorageError(error, what(), kind: kind)
    }
}
