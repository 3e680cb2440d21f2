// ObsStore — what the daemon hands storage to make durable, one frame of the write-ahead log
// each, in the order it decided them: a revision (with the lease attachments its write moved),
// attachments a write moved without making a revision (a `set` of an equal value naming a
// lease), a lease granted, a lease ended. Leases and attachments ride in the same durable
// sequence as the revisions that depend on them, so the log can never hold a write whose
// attachment it lost, or an attachment whose write it lost (LogRecord.swift has the bytes).

import ObsValues
import ObservableKit

/// A key's move between leases: the lease it was attached to before, and after (nil: none).
public typealias AttachmentMove = (key: Key, from: UInt64?, to: UInt64?)

/// One frame for the log. Its bytes (`FrameChanges.one`) are read during `Storage.append` only.
public enum LogFrame {
    case revision(RevisionFrame)
    /// Attachments a write moved while changing no value (no revision).
    case attachments(repo: String, revision: UInt64, moves: [AttachmentMove])
    /// A lease was granted.
    case leaseGranted(PersistedLeases.Lease)
    /// A lease ended: a write naming it is refused from here on; the keys still attached to it
    /// are deleted by revisions that follow (a restart that finds them makes those deletions).
    case leaseEnded(id: UInt64, reason: LeaseEnd.Reason, owner: Writer)
}

/// A revision as the log keeps it.
public struct RevisionFrame {
    public let repo: String
    /// The history it belongs to (a repository new since the last checkpoint is recreated with it).
    public let epoch: String
    public let revision: UInt64
    /// When it was committed, in seconds since 1970.
    public let time: Int64
    public let writer: Writer?
    /// For the deletion a lease's end made: which lease, and why.
    public let leaseEnd: LeaseEnd?
    /// The attachments its write moved (for keys it changed or not).
    public let moves: [AttachmentMove]
    public let changes: FrameChanges

    public init(
        repo: String, epoch: String, revision: UInt64, time: Int64, writer: Writer?, leaseEnd: LeaseEnd? = nil, moves: [AttachmentMove] = [],
        changes: FrameChanges
    ) {
        self.repo = repo
        self.epoch = epoch
        self.revision = revision
        self.time = time
        self.writer = writer
        self.leaseEnd = leaseEnd
        self.moves = moves
        self.changes = changes
    }

    /// The frame of `record`, in history `epoch`.
    public init(_ record: RevisionRecord, epoch: String, moves: [AttachmentMove] = []) {
        self.init(
            repo: record.repo, epoch: epoch, revision: record.revision, time: record.time, writer: record.writer, leaseEnd: record.leaseEnd,
            moves: moves, changes: .list(record.changes))
    }
}

/// One change given as the bytes where they lie: the key's UTF-8, and the canonical encodings
/// of the value before (nil: the key did not exist) and after (nil: deleted), with whether
/// each is plain (see `CanonicalJSON`). Valid while the memory they point into is — what the
/// daemon's writes are made of, from the request's bytes and the table's, with nothing copied.
public struct RawChange {
    public var key: UnsafeRawBufferPointer
    public var old: UnsafeRawBufferPointer?
    public var oldIsPlain: Bool
    public var new: UnsafeRawBufferPointer?
    public var newIsPlain: Bool

    @inlinable
    public init(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, oldIsPlain: Bool, new: UnsafeRawBufferPointer?, newIsPlain: Bool) {
        self.key = key
        self.old = old
        self.oldIsPlain = oldIsPlain
        self.new = new
        self.newIsPlain = newIsPlain
    }

    /// The change as values (copied out).
    public var materialized: Change<CanonicalJSON> {
        Change(
            key: Key(String(decoding: key, as: UTF8.self)), old: old.map { CanonicalJSON(canonical: Array($0), isPlain: oldIsPlain) },
            new: new.map { CanonicalJSON(canonical: Array($0), isPlain: newIsPlain) })
    }
}

/// A revision's changes, in application order: values (a revision decided elsewhere, or
/// loaded), or given as the bytes where they lie (valid during the call they are passed to).
public enum FrameChanges {
    case list([Change<CanonicalJSON>])
    case raw(UnsafeBufferPointer<RawChange>)

    var count: Int {
        switch self {
        case .list(let changes): changes.count
        case .raw(let changes): changes.count
        }
    }

    /// Calls `body` with each change's key, and old and new value with whether each is plain
    /// (nil: absent), in order.
    func forEach(_ body: (UnsafeRawBufferPointer, (bytes: UnsafeRawBufferPointer, plain: Bool)?, (bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void) {
        switch self {
        case .raw(let changes):
            for c in changes { body(c.key, c.old.map { ($0, c.oldIsPlain) }, c.new.map { ($0, c.newIsPlain) }) }
        case .list(let changes):
            func withBytes(_ value: CanonicalJSON?, _ body: ((bytes: UnsafeRawBufferPointer, plain: Bool)?) -> Void) {
                guard let value else { return body(nil) }
                value.bytes.withUnsafeBytes { body(($0, value.isPlain)) }
            }
            for change in changes {
                change.key.withUTF8 { key in
                    withBytes(change.old) { old in withBytes(change.new) { new in body(UnsafeRawBufferPointer(key), old, new) } }
                }
            }
        }
    }
}
