// ObsStore — storage that several daemons share (several hosts, issue 14).
//
// A `SharedStorage` keeps repositories in a store other daemons write too (etcd, in
// ObsCluster). Unlike `Storage`, it decides revisions itself: a daemon plans a write
// against the state it holds (a *basis* revision), the store commits it only if that basis
// is still current everywhere, and every committed revision — this daemon's and every
// other's, in one order — reaches the daemon through `SharedStorageSink.deliver`, which is
// the only way the daemon's state moves. So a local write is applied exactly once, in the
// same order as on every other daemon, and only once it is in the store.
//
// This file is the boundary only: what the daemon asks (`commit`, `linearize`; leases in
// SharedLeases.swift) and what it is told (`SharedStorageSink`). It names no cluster
// technology.

import ObsValues
import ObservableKit

/// Where a committed revision came from: its record, and the write id the committing
/// daemon gave its group (nil when unknown); for a revision that deleted a lease's keys, which
/// lease and why.
public struct SharedRevision: Sendable {
    public let record: RevisionRecord
    public let writeID: String?
    public let lease: LeaseEnd?

    public init(record: RevisionRecord, writeID: String?, lease: LeaseEnd? = nil) {
        self.record = record
        self.writeID = writeID
        self.lease = lease
    }
}

/// Revisions planned by this daemon on `basisRevision` of `repo`, to commit together (group
/// commit): each keeps its own revision, `basisRevision + 1`… in order; and the lease
/// attachments its writes move. With nothing to write, a check that the basis is current (for
/// answers that change nothing: a no-op, a conflict) and that the leases named are live.
public struct SharedCommit: Sendable {
    public let repo: String
    public let basisRevision: UInt64
    public let records: [RevisionRecord]
    /// Unique among every daemon's groups; stored with each record (it settles a commit
    /// whose outcome the store could not report).
    public let writeID: String
    /// When the daemon must have an answer (the store may take a little longer to settle an
    /// unknown outcome; see `SharedCommitOutcome.failed`).
    public let deadline: ContinuousClock.Instant
    /// Leases the group's writes name: it commits only while each is live (else
    /// `SharedCommitOutcome.leaseEnded`).
    public var leases: [SharedLease] = []
    /// The lease each key changed by `records` is attached to after the group (absent: none).
    public var attachments: [Key: UInt64] = [:]
    /// Keys whose attachment the group moves without changing their value.
    public var reattached: [SharedReattachment] = []
    /// The revisions (by number) that delete a lease's keys, and which lease and why.
    public var leaseEnds: [UInt64: LeaseEnd] = [:]
    /// The tombstones (`Tombstones`: the revision of the last deletion of each absent key) the
    /// group takes away — each key it re-creates that had one on the basis, with its revision.
    /// The ones it adds are its records' deletions.
    public var tombstonesRemoved: [Key: UInt64] = [:]
    /// The tombstones' floor once every daemon installed the group: the basis's, or higher
    /// where its deletions take the repository past its bound (the oldest forgotten).
    public var tombstoneFloor: UInt64 = 0
    /// Where the store's delivery stood when the group was planned (`deliveredPosition`): it
    /// commits only if nothing was committed to the repository since — a move of attachments
    /// included, which changes no revision (without it, a lease's end planned before such a
    /// move deleted the key the move had taken to another lease: the robustness suite's
    /// `etcd-end-moved-key`).
    public var basisPosition: Int64?

    /// Whether committing the group changes anything in the store.
    public var writes: Bool { !records.isEmpty || !reattached.isEmpty }

    public init(repo: String, basisRevision: UInt64, records: [RevisionRecord], writeID: String, deadline: ContinuousClock.Instant) {
        self.repo = repo
        self.basisRevision = basisRevision
        self.records = records
        self.writeID = writeID
        self.deadline = deadline
    }
}

/// How a `SharedCommit` ended.
public enum SharedCommitOutcome: Sendable {
    /// The records are committed, and already delivered to the sink.
    case committed
    /// (No records.) The basis was the current state at a moment after the call.
    case current
    /// The basis was not current; the sink has since been given the newer revisions.
    /// Nothing was committed: plan again on the new state.
    case stale
    /// Not committed, or not known to be (`SharedFailure.Kind`).
    case failed(SharedFailure)
    /// Nothing was committed: these leases the group names have ended (the daemon no longer
    /// finds them live, and the sink is told of their end as usual). Plan again.
    case leaseEnded(Set<UInt64>)
}

/// Why a shared store could not commit.
public struct SharedFailure: Error, Sendable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        /// The store cannot take writes now (no quorum, unreachable); nothing was applied.
        case unavailable
        /// The store could not say whether the write was applied; it may be, even later.
        /// If it is, every daemon delivers it as usual.
        case outcomeUnknown
        /// The store refuses writes this large; nothing was applied.
        case tooLarge
        /// Anything else; nothing was applied.
        case refused
    }

    public let kind: Kind
    /// Names the cause, for the writer's error reply.
    public let message: String

    public init(_ kind: Kind, _ message: String) {
        self.kind = kind
        self.message = message
    }

    public var description: String { message }
}

/// Which repositories a read must be up to date with.
public enum SharedScope: Sendable, Hashable {
    case repository(String)
    /// Every repository (the `repos` op).
    case all
}

/// Told about every committed revision of a shared store, in order. Called from the store's
/// own task; it must not wait for the store.
public protocol SharedStorageSink: AnyObject, Sendable {
    /// The next revisions of `repo`, contiguous and in order, committed by any daemon; then the
    /// lease attachments of keys they, or a commit that only moved attachments, wrote —
    /// `replacing`: every attachment of `repo` (a key not listed is attached to none).
    func deliver(repo: String, revisions: [SharedRevision], attachments: [SharedAttachment], replacing: Bool)
    /// Lease `lease` ended, after every revision and attachment committed before its end was
    /// delivered. Every daemon is told; each deletes the keys still attached to it (the store
    /// lets exactly one deletion through).
    func leaseEnded(_ lease: SharedLease, reason: LeaseEnd.Reason)
    /// This daemon can no longer vouch for these leases it granted bound to its connections:
    /// it lost the store for longer than their bound, and the store ends them (or has) without
    /// it. It treats them as ended at once.
    func leasesLost(_ ids: [UInt64])
    /// The store's history no longer matches what this daemon showed its clients (the
    /// store's data was wiped or replaced): the daemon cannot go on with the same epoch.
    func historyLost(_ reason: String)
}

/// A storage shared with other daemons. `append` is never used: writes go through
/// `commit`, and the daemon's state moves only by `SharedStorageSink.deliver`.
public protocol SharedStorage: Storage {
    /// The epoch of every repository in the store: the same on every daemon that shares it,
    /// new when the store's data is new.
    var epoch: String { get }
    /// Reaches the store and reads every repository, waiting (and logging why) while it
    /// cannot; `load()` returns what was read. Throws `CancellationError`, or a
    /// `StorageError` when what the store holds is not the daemon's.
    func connect() async throws
    /// Starts delivering every revision committed after what `load()` returned.
    func start(delivering sink: any SharedStorageSink)
    /// Why `records` cannot be committed together, if they cannot (the daemon then commits
    /// fewer at a time, or refuses a single revision that is too large with this reason).
    func limitExceeded(by records: [RevisionRecord]) -> String?
    /// The same, for a group that also needs `extraOperations` (keys whose lease attachment
    /// it moves, leases it names).
    func limitExceeded(by records: [RevisionRecord], extraOperations: Int) -> String?
    /// Commits `group` if its basis is current.
    func commit(_ group: SharedCommit) async -> SharedCommitOutcome
    /// Where the store's delivery of `repo` stands (opaque; nil: a store without positions).
    /// The store moves it only after the sink installed what it delivered, so, read while the
    /// repository's state is locked, it is at or before that state: a group planned on the
    /// state carries it (`SharedCommit.basisPosition`).
    func deliveredPosition(of repo: String) -> Int64?
    /// Returns once every revision of `scope` committed before the call has been delivered
    /// (true), or false when the store could not say so quickly (it is unreachable or has
    /// no quorum): the caller then answers from the state it holds.
    func linearize(_ scope: SharedScope) async -> Bool

    // Leases (SharedLeases.swift says what each does; a store that keeps none leaves the
    // defaults there).
    var keepsLeases: Bool { get }
    func grantLease(owner: Writer, ttl: Int64?, limit: Int?) async -> Result<SharedLease, SharedGrantFailure>
    func liveLease(_ id: UInt64) -> SharedLease?
    func lease(_ id: UInt64) async -> Result<SharedLease?, SharedFailure>
    func keepAlive(_ lease: SharedLease) async -> Result<Bool, SharedFailure>
    func endLease(_ lease: SharedLease, reason: LeaseEnd.Reason) async -> Result<Bool, SharedFailure>
    func leaseFinished(_ id: UInt64)
    var liveLeaseCount: Int { get }
    func leave() async
}

extension SharedStorage {
    /// A store without positions: a group is committed on its basis revision alone.
    public func deliveredPosition(of repo: String) -> Int64? { nil }
}

extension SharedStorageSink {
    /// The next revisions of `repo`, with no attachment moved.
    public func deliver(repo: String, revisions: [SharedRevision]) {
        deliver(repo: repo, revisions: revisions, attachments: [], replacing: false)
    }
}
