// ObsServer — where a write is decided: the one boundary between the daemon's write path and
// its two storage modes. A session hands every write to the hub's `Sequencer` and never asks
// which mode it is in.
//
// - `LocalSequencer` (memory, or the write-ahead log): the decision is immediate — planned on
//   the repository's state, committed as its next revision — and storage makes it durable
//   later (or fails it, and it is undone). The reply waits for durability (`sequence`).
// - `SharedSequencer` (etcd): writes queue per repository and are committed in groups by the
//   store's compare-and-set; the answer comes later, on the session's loop.

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Synchronization

/// A write, as a session hands it over.
struct WriteRequest: Sendable {
    let ops: [WriteOp<CanonicalJSON>]
    let limits: WriteLimits
    let maxRepositories: Int
    /// Who writes (for the leases it names).
    let peer: Peer
    let writer: Writer
    let origin: ConnectionID
    /// The wall clock, in seconds since 1970.
    let time: Int64
    /// The lease each `set` names (by position in `ops`; empty: none names one).
    var leases: [UInt64?] = []
}

/// What a write did, for its reply.
struct WriteOutcome: Sendable {
    /// The repository revision after the write.
    let revision: UInt64
    let changed: Bool
    /// The key's previous value (single-key writes only).
    let previous: CanonicalJSON?
    /// The state the reply reports: it is sent once that state is durable.
    let sequence: StateSequence
}

/// Why a write was not applied (or, for `.shared(.outcomeUnknown)`, may not have been).
enum WriteFailure: Error, Sendable {
    case refused(WriteRefusal)
    /// The write would create this repository, and no more may be created.
    case tooManyRepositories(limit: Int)
    /// Storage no longer takes revisions (the daemon is stopping).
    case storageClosed
    /// The shared store could not commit it, or could not say whether it did.
    case shared(SharedFailure)
    /// It names a lease that does not exist (or ended), or one of another uid.
    case lease(LeaseRefusal)
}

typealias WriteDecision = Result<WriteOutcome, WriteFailure>

/// What a single-key write decided at once did, for its reply (its `old`, if the key existed,
/// was copied out for it).
struct SingleOutcome {
    /// The repository revision after the write.
    let revision: UInt64
    let changed: Bool
    /// Whether the key existed before the write (its reply carries `old`).
    let existed: Bool
    /// The state the reply reports: it is sent once that state is durable.
    let sequence: StateSequence
}

/// Where a write decided later is answered: a connection's loop. Sendable; the session it
/// leads to is touched only on that loop.
final class AnswerRoute: Sendable {
    let loop: IOLoop
    private let deliver: @Sendable (UInt64, WriteDecision) -> Void

    /// `deliver` runs on `loop` with a write's token and result.
    init(loop: IOLoop, deliver: @escaping @Sendable (UInt64, WriteDecision) -> Void) {
        self.loop = loop
        self.deliver = deliver
    }

    /// Answers write `token` (from any thread).
    func answer(_ token: UInt64, _ result: WriteDecision) {
        loop.execute { [deliver] in deliver(token, result) }
    }
}

/// Decides writes. (A class: the hub's sequencer is used on every write, and an existential
/// of a struct is copied — its references retained — at each use.)
protocol Sequencer: AnyObject, Sendable {
    /// Decides `write` on `repository`: returns its result now, or nil — then `route` is
    /// answered with `token` exactly once, later.
    func submit(_ write: WriteRequest, to repository: Repository, route: AnswerRoute, token: UInt64) -> WriteDecision?

    /// Decides a single-key write given as bytes (`RepositoryCore.planSingle`) here and now, if
    /// it can, copying the key's value before it into `old` (emptied first); nil, with nothing
    /// applied: `submit` takes the write (a refusal, leases, the shared store).
    func submitSingle(
        _ write: SingleWrite, to repository: Repository, limits: WriteLimits, writer: Writer, origin: ConnectionID, time: Int64,
        old: inout [UInt8]
    ) -> SingleOutcome?

    /// A lease ended: deletes the keys of `repository` still attached to it, in one revision
    /// whose event says which lease and why — a write like any other, written by no
    /// connection, by the lease's owner. `done` is called once with the outcome (nil: nothing
    /// was attached any more), from any thread.
    func end(_ lease: EndedLease, in repository: Repository, time: Int64, done: @escaping @Sendable (WriteOutcome?) -> Void)
}

/// Decisions made here and now: the local store (memory, or the write-ahead log).
final class LocalSequencer: Sequencer {
    let storage: any Storage
    let stats: ServerStats
    let leases: LeaseTable

    init(storage: any Storage, stats: ServerStats, leases: LeaseTable) {
        self.storage = storage
        self.stats = stats
        self.leases = leases
    }

    func submit(_ write: WriteRequest, to repository: Repository, route: AnswerRoute, token: UInt64) -> WriteDecision? {
        repository.withState { s -> WriteDecision in
            let plan: WritePlan
            do throws(WriteRefusal) { plan = try s.core.plan(write.ops, limits: write.limits) } catch { return .failure(.refused(error)) }
            // A lease named must exist and be the writer's — checked, and this repository
            // recorded in the lease, under this lock: a lease that ends meanwhile ends either
            // before (refused) or after, its end then finding the key this write attaches.
            for case let lease? in write.leases {
                if let refusal = leases.admit(lease, by: write.peer, into: repository.name) { return .failure(.lease(refusal)) }
            }
            guard !plan.changes.isEmpty else {
                // No revision; the attachments it moves are stored all the same, and its reply
                // waits until they are durable.
                let moves = s.core.attach(write.ops, leases: write.leases)
                guard !moves.isEmpty else {
                    return .success(WriteOutcome(revision: s.core.revision, changed: false, previous: plan.previous, sequence: s.ledger.current))
                }
                guard let sequence = attach(moves, &s, repository) else { return .failure(.storageClosed) }
                return .success(WriteOutcome(revision: s.core.revision, changed: false, previous: plan.previous, sequence: sequence))
            }
            // Only a `set` brings an empty repository into existence; the count is reserved
            // atomically, so concurrent creators cannot pass the limit together.
            if plan.creates, !stats.reserveRepository(limit: write.maxRepositories) {
                return .failure(.tooManyRepositories(limit: write.maxRepositories))
            }
            let moves = s.core.attach(write.ops, leases: write.leases)
            return commit(plan, &s, repository, time: write.time, writer: write.writer, origin: write.origin.value, moves: moves)
        }
    }

    func submitSingle(
        _ write: SingleWrite, to repository: Repository, limits: WriteLimits, writer: Writer, origin: ConnectionID, time: Int64,
        old: inout [UInt8]
    ) -> SingleOutcome? {
        repository.withState { s -> SingleOutcome? in
            guard let plan = s.core.planSingle(write, limits: limits) else { return nil }
            if old.capacity > 1 << 16 { old = [] }
            old.replaceSubrange(old.indices, with: plan.old ?? UnsafeRawBufferPointer(start: nil, count: 0))
            guard plan.changes else {
                return SingleOutcome(revision: s.core.revision, changed: false, existed: plan.old != nil, sequence: s.ledger.current)
            }
            let immediate = storage.isImmediate
            let sequence = Repository.nextSequence(s)
            let info = s.core.commitSingle(write, plan, time: time, writer: writer, origin: origin.value, durable: immediate)
            // Not immediate: storage encodes the revision as it queues it, from the request's
            // bytes and the old value's copy (the table may have overwritten it in place).
            let stored = old.withUnsafeBytes { old in
                immediate
                    || storage.append(
                        .revision(
                            RevisionFrame(
                                repo: repository.name, epoch: repository.epoch, revision: info.revision, time: info.time, writer: info.writer,
                                changes: .one(
                                    key: write.key, old: plan.old == nil ? nil : old, oldIsPlain: plan.oldIsPlain, new: write.value, newIsPlain: write.isPlain))),
                        sequence: sequence, listener: repository)
            }
            guard let sequence = finish(&s, repository, info, stored: stored, immediate: immediate, creates: false) else { return nil }
            return SingleOutcome(revision: info.revision, changed: true, existed: plan.old != nil, sequence: sequence)
        }
    }

    func end(_ lease: EndedLease, in repository: Repository, time: Int64, done: @escaping @Sendable (WriteOutcome?) -> Void) {
        let outcome = repository.withState { s -> WriteOutcome? in
            let attached = s.core.keys(attachedTo: lease.id)
            guard !attached.isEmpty else { return nil }
            let ops = attached.map { WriteOp<CanonicalJSON>.delete($0) }
            guard let plan = try? s.core.plan(ops, limits: WriteLimits(maxKeys: .max, maxRevisionBytes: .max)), !plan.changes.isEmpty else { return nil }
            let end = SharedLeaseEnd(lease: lease.id, reason: SharedLeaseReason(lease.end))
            // The keys' detachment goes with the revision: if storage fails it and it is undone,
            // they are attached to the lease again, and the deletion is made again later.
            let moves = s.core.attach(ops, leases: [])
            guard
                case .success(let outcome) = commit(plan, &s, repository, time: time, writer: lease.owner, origin: 0, leaseEnd: end, moves: moves)
            else { return nil }
            return outcome
        }
        done(outcome)
    }

    /// Stores attachments a write moved without making a revision, as the repository's next
    /// state; nil: storage is closed (they are moved back).
    private func attach(_ moves: [RepositoryCore.AttachmentMove], _ s: inout Repository.State, _ repository: Repository) -> StateSequence? {
        let immediate = storage.isImmediate
        let stored =
            immediate
            || storage.append(.attachments(repo: repository.name, revision: s.core.revision, moves: moves), sequence: Repository.nextSequence(s), listener: repository)
        guard stored else {
            for move in moves.reversed() { s.core.setAttachment(move.key, to: move.from) }
            return nil
        }
        s.core.recordAttachments(moves, durable: immediate)
        return Repository.applied(&s, durable: immediate, on: repository)
    }

    /// Commits a planned revision and hands it to storage; shows it at once if storage is
    /// immediate (memory), else once storage says it is durable.
    private func commit(
        _ plan: WritePlan, _ s: inout Repository.State, _ repository: Repository, time: Int64, writer: Writer?, origin: UInt64,
        leaseEnd: SharedLeaseEnd? = nil, moves: [RepositoryCore.AttachmentMove] = []
    ) -> WriteDecision {
        let immediate = storage.isImmediate
        let sequence = Repository.nextSequence(s)
        let info = s.core.commit(
            plan, time: time, writer: writer, origin: origin, durable: immediate, tail: leaseEnd.map(RepositoryCore.tail) ?? [], moves: moves)
        // Storage never calls back from inside `append` (this lock is held); a store that no
        // longer takes revisions says so, and the revision is taken back (`finish`).
        let stored =
            immediate
            || storage.append(
                .revision(
                    RevisionFrame(
                        repo: repository.name, epoch: repository.epoch, revision: info.revision, time: info.time, writer: info.writer,
                        leaseEnd: leaseEnd, moves: moves, changes: .list(plan.changes))),
                sequence: sequence, listener: repository)
        guard let sequence = finish(&s, repository, info, stored: stored, immediate: immediate, creates: plan.creates) else {
            return .failure(.storageClosed)
        }
        return .success(WriteOutcome(revision: info.revision, changed: true, previous: plan.previous, sequence: sequence))
    }

    /// After the core committed revision `info` and handed it to storage (`stored`; always, if
    /// storage is `immediate`, memory): takes the revision back if storage no longer takes
    /// any, else names its state and shows it at once if storage is immediate (else once
    /// storage says it is durable). Returns the state's sequence; nil: storage is closed and
    /// the revision was undone.
    private func finish(_ s: inout Repository.State, _ repository: Repository, _ info: RevisionInfo, stored: Bool, immediate: Bool, creates: Bool)
        -> StateSequence?
    {
        guard stored else {
            // Never durable (it was pending): the newest pending change, undone.
            s.core.undo(last: 1)
            if creates { stats.repositories.subtract(1, ordering: .relaxed) }
            return nil
        }
        if creates { repository.makePermanent() }
        let sequence = Repository.applied(&s, durable: immediate, on: repository)
        if immediate {
            let loops = s.subscriberLoops
            if !loops.isEmpty { s.core.withLastRecord { Repository.publish($0, to: loops, of: repository) } }
        }
        return sequence
    }
}
