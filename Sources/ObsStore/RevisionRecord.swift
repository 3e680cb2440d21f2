// ObsStore — one committed revision, as the daemon stores it: what changed, in domain terms.

import ObsValues
import ObservableKit

/// One committed revision of a repository: its changes with their old and new values, and
/// when it was committed. How it is shown to clients is the server's business.
public final class RevisionRecord: Sendable {
    public let repo: String
    public let revision: UInt64
    public let changes: [Change<CanonicalJSON>]
    /// When it was committed, in seconds since 1970 (for age-based history retention).
    public let time: Int64
    /// Who wrote it (nil: written before obsd recorded writers).
    public let writer: Writer?
    /// For the deletion a lease's end made: which lease, and why (its event says so, replayed too).
    public let leaseEnd: LeaseEnd?
    /// What it weighs against history and revision limits: keys, old and new values, and 32
    /// bytes per change for what goes with them.
    public let byteSize: Int

    public init(repo: String, changeSet: ChangeSet<CanonicalJSON>, time: Int64, writer: Writer?, leaseEnd: LeaseEnd? = nil) {
        self.leaseEnd = leaseEnd
        self.repo = repo
        self.revision = changeSet.revision
        self.changes = changeSet.changes
        self.time = time
        self.writer = writer
        self.byteSize = changeSet.changes.reduce(0) { $0 + Self.byteSize(of: $1) }
    }

    /// What one change weighs (see `byteSize`).
    public static func byteSize(of change: Change<CanonicalJSON>) -> Int {
        change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 32
    }

    /// The keys changed, in application order.
    public var keys: [Key] { changes.map(\.key) }
}
