// ObsStore — why storage failed: the one error every store (the log and snapshot, SQLite,
// a shared store's adapter) throws, its kind what a caller decides on, its message naming
// the file.

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
