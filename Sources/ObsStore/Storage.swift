// ObsStore — where the daemon keeps repositories, and what it persists.
//
// This module owns the persistent shape of a repository: `CanonicalJSON` (a JSON value
// with its encoding), `RevisionRecord` (one committed revision), and the `Storage`
// boundary. The daemon commits a revision in memory, hands it to storage in revision
// order, and shows it to nobody — no reply, no event — until storage says it is durable.
// `InMemoryStorage` is durable at once (and forgets everything at exit); `DiskStorage`
// persists to a write-ahead log with group commit and keeps a compacted state in a snapshot.

import ObsValues
import ObservableKit

/// A repository as found in storage at start-up.
public struct LoadedRepository: Sendable {
    public let name: String
    /// The history `state` and `history` belong to (see `Epoch`).
    public let epoch: String
    /// Its entries and revision, flat (as a snapshot loads them).
    public let state: FlatTable
    /// The retained history, oldest first, ending at `state.revision` (or empty).
    public let history: LoadedHistory

    public init(name: String, epoch: String, state: FlatTable, history: LoadedHistory) {
        self.name = name
        self.epoch = epoch
        self.state = state
        self.history = history
    }

    public init(name: String, epoch: String, state: FlatTable, history: [RevisionRecord]) {
        self.init(name: name, epoch: epoch, state: state, history: LoadedHistory(history))
    }
}

/// Told, in revision order, when the revisions it handed to storage are durable — or that
/// they never will be. Called from the store's own thread, which must not wait: an
/// implementation hands the news over (the daemon to an event loop) and returns.
public protocol DurabilityListener: AnyObject, Sendable {
    /// The repository's epoch, stored with it when storage first sees it.
    var epoch: String { get }
    /// Every revision up to `revision` is durable.
    func durable(through revision: UInt64)
    /// Revisions above `revision` were not stored and never will be; `error` says why —
    /// unless its kind is `.outcomeUnknown`: then storage could not undo them, a restart may
    /// find them (any prefix of them), and storage takes no more revisions until then.
    /// Either way they are not stored now, and the repository undoes them in memory.
    func failed(after revision: UInt64, error: StorageError)
}

/// Where the daemon keeps repositories.
public protocol Storage: AnyObject, Sendable {
    /// Whether `append` makes a revision durable at once, with no callback.
    var isImmediate: Bool { get }
    /// What the storage is, for logs (e.g. "memory", "write-ahead log + sqlite /var/lib/obsd/obsd.db, sync always").
    var summary: String { get }
    /// Commit and fsync counts, when the storage keeps them.
    var counters: StorageCounters? { get }
    /// Everything stored, read once at start-up.
    func load() throws(StorageError) -> [LoadedRepository]
    /// What the daemon should say at start-up about the store (e.g. why epochs were renewed).
    var notices: [String] { get }
    /// Queues a committed revision. Called in revision order for each listener (the
    /// repository), while the repository's lock is held: it must never call the listener.
    /// Returns `false`, queuing nothing, once the storage is closed.
    func append(_ record: RevisionRecord, listener: any DurabilityListener) -> Bool
    /// Queues a committed revision of one change given as bytes, as `append(_:listener:)`
    /// does a record (the bytes are read during the call only).
    func append(_ revision: SingleRevision, listener: any DurabilityListener) -> Bool
    /// Forgets queued revisions of `listener` above `revision`, after a failure undid them.
    func discard(_ listener: any DurabilityListener, after revision: UInt64)
    /// Makes the revisions queued so far durable now, on the calling thread, if the store
    /// does that (an event loop calls it at the end of each iteration; the listeners may be
    /// called from inside). Must not be called with a repository's lock held.
    func flush()
    /// Whether `flush` is cheap enough to call in the middle of an iteration too — it waits for
    /// no sync (a connection that sends the replies of a long pipelined read early flushes
    /// first, so that they are durable).
    var flushesCheaply: Bool { get }
    /// Makes everything queued durable, then releases the storage.
    func close()
    /// Where leases persist (nil: they live only as long as the process).
    var leaseJournal: LeaseJournal? { get }
}

extension Storage {
    /// As a record.
    public func append(_ revision: SingleRevision, listener: any DurabilityListener) -> Bool { append(revision.record, listener: listener) }
    public func flush() {}
    public var flushesCheaply: Bool { false }
    /// Where leases persist (nil: they live only as long as the process).
    public var leaseJournal: LeaseJournal? { nil }
}

/// Keeps nothing: repositories live only as long as the process.
public final class InMemoryStorage: Storage {
    public init() {}
    public var isImmediate: Bool { true }
    public var summary: String { "memory (nothing persists)" }
    public var counters: StorageCounters? { nil }
    public func load() -> [LoadedRepository] { [] }
    public var notices: [String] { [] }
    public func append(_ record: RevisionRecord, listener: any DurabilityListener) -> Bool { true }
    public func discard(_ listener: any DurabilityListener, after revision: UInt64) {}
    public func close() {}
}

/// A committed revision of one change, given as the bytes where they lie (the daemon's
/// single-key writes): valid during the call it is passed to.
public struct SingleRevision {
    public let repo: String
    public let revision: UInt64
    /// When it was committed, in seconds since 1970.
    public let time: Int64
    public let writer: Writer?
    /// The key's UTF-8, and the canonical values before (nil: absent) and after (nil: deleted).
    public let key: UnsafeRawBufferPointer
    public let old: UnsafeRawBufferPointer?
    public let oldIsPlain: Bool
    public let new: UnsafeRawBufferPointer?
    public let newIsPlain: Bool

    public init(
        repo: String, revision: UInt64, time: Int64, writer: Writer?, key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, oldIsPlain: Bool,
        new: UnsafeRawBufferPointer?, newIsPlain: Bool
    ) {
        self.repo = repo
        self.revision = revision
        self.time = time
        self.writer = writer
        self.key = key
        self.old = old
        self.oldIsPlain = oldIsPlain
        self.new = new
        self.newIsPlain = newIsPlain
    }

    /// The revision as a record, its values copied out.
    public var record: RevisionRecord {
        let change = Change(
            key: Key(String(decoding: key, as: UTF8.self)), old: old.map { CanonicalJSON(canonical: Array($0), isPlain: oldIsPlain) },
            new: new.map { CanonicalJSON(canonical: Array($0), isPlain: newIsPlain) })
        return RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: [change]), time: time, writer: writer)
    }
}
