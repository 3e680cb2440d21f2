// ObsStore — where the daemon keeps repositories, and what it persists.
//
// This module owns the persistent shape of a repository and of the leases: `RevisionRecord`
// (one committed revision), the frames the log holds (`LogFrame`: revisions with the lease
// attachments they move, attachments moved without a revision, leases granted and ended —
// one durable sequence), and the `Storage` boundary. The daemon applies a change in memory,
// hands its frame to storage in order, and shows it to nobody — no reply, no event — until
// storage says it is durable. `InMemoryStorage` is durable at once (and forgets everything
// at exit); `DiskStorage` persists to a write-ahead log with group commit and keeps a
// compacted state in a snapshot.

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
    /// The lease each attached key is attached to (the contract's leases: not part of the
    /// state revisions count, but stored with it — in the same log records as the writes that
    /// move them, and in the snapshot).
    public let attachments: [Key: UInt64]
    /// The revision of the last deletion of each absent key it remembers, and from which
    /// revision on it remembers them all (stored with the state like `attachments`).
    public let tombstones: Tombstones

    public init(name: String, epoch: String, state: FlatTable, history: LoadedHistory, attachments: [Key: UInt64] = [:], tombstones: Tombstones? = nil) {
        self.name = name
        self.epoch = epoch
        self.state = state
        self.history = history
        self.attachments = attachments
        // None stored: deletions before this state are not known.
        self.tombstones = tombstones ?? Tombstones(limit: .max, floor: state.revision)
    }

    public init(name: String, epoch: String, state: FlatTable, history: [RevisionRecord], attachments: [Key: UInt64] = [:], tombstones: Tombstones? = nil) {
        self.init(name: name, epoch: epoch, state: state, history: LoadedHistory(history), attachments: attachments, tombstones: tombstones)
    }

    /// The same repository in another history (its epoch renewed: its deletions, of the old
    /// history, mean nothing in the new one).
    public func renewed(epoch: String) -> LoadedRepository {
        LoadedRepository(name: name, epoch: epoch, state: state, history: history, attachments: attachments)
    }
}

/// Told when what it handed to storage is durable — or that it never will be. Each listener
/// numbers what it hands over (`sequence`, increasing: a repository's states, the lease
/// table's grants and ends) and hears about it in that order. Storage never calls it: it
/// posts what it learns (`DurabilityReports`), and the server delivers that — on an event
/// loop, never with a listener's lock held.
public protocol DurabilityListener: AnyObject, Sendable {
    /// Everything it handed over numbered up to `sequence` is durable.
    func durable(through sequence: UInt64)
    /// What it handed over numbered above `sequence` was not stored and never will be;
    /// `error` says why — unless its kind is `.outcomeUnknown`: then storage could not undo
    /// it, a restart may find it (any prefix of it), and storage takes nothing more until
    /// then. Either way it is not stored now, and the listener undoes it in memory.
    func failed(after sequence: UInt64, error: StorageError)
}

/// Where the daemon keeps repositories.
public protocol Storage: AnyObject, Sendable {
    /// Whether `append` makes what it is given durable at once, with no callback.
    var isImmediate: Bool { get }
    /// What the storage is, for logs (e.g. "memory", "write-ahead log + sqlite /var/lib/obsd/obsd.db, sync always").
    var summary: String { get }
    /// Commit and fsync counts, when the storage keeps them.
    var counters: StorageCounters? { get }
    /// Everything stored, read once at start-up.
    func load() throws(StorageError) -> [LoadedRepository]
    /// The leases stored, read once at start-up (after `load`).
    func loadLeases() -> PersistedLeases
    /// What the daemon should say at start-up about the store (e.g. why epochs were renewed).
    var notices: [String] { get }
    /// Where this storage posts what becomes of the frames handed to it; nil for one that
    /// posts nothing (it is immediate, or decides in a shared store).
    var reports: DurabilityReports? { get }
    /// Queues `frame` — a revision, attachments moved without one, a lease granted or ended
    /// — numbered `sequence` by `listener` (in increasing order), while the listener's lock is
    /// held. The frame's bytes are read during the call only. Returns `false`, queuing
    /// nothing, once the storage is closed.
    func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool
    /// Forgets what `listener` queued numbered above `sequence`, after a failure undid it.
    func discard(_ listener: any DurabilityListener, after sequence: UInt64)
    /// Makes what was queued so far durable now, on the calling thread, if the store
    /// does that (an event loop calls it at the end of each iteration, and then takes the
    /// reports it posted).
    func flush()
    /// Whether `flush` is cheap enough to call in the middle of an iteration too — it waits for
    /// no sync (a connection that sends the replies of a long pipelined read early flushes
    /// first, so that they are durable).
    var flushesCheaply: Bool { get }
    /// Makes everything queued durable, then releases the storage.
    func close()
}

extension Storage {
    public var reports: DurabilityReports? { nil }
    public func flush() {}
    public var flushesCheaply: Bool { false }
    public func loadLeases() -> PersistedLeases { PersistedLeases() }
}

/// Keeps nothing: repositories live only as long as the process.
public final class InMemoryStorage: Storage {
    public init() {}
    public var isImmediate: Bool { true }
    public var summary: String { "memory (nothing persists)" }
    public var counters: StorageCounters? { nil }
    public func load() -> [LoadedRepository] { [] }
    public var notices: [String] { [] }
    public func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool { true }
    public func discard(_ listener: any DurabilityListener, after sequence: UInt64) {}
    public func close() {}
}
