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

/// What a write carries besides its operations — who writes, when, under which limits — the
/// same whether the operations are read in place (`WriteInput`) or own their bytes
/// (`WriteRequest`).
struct WriteContext: Sendable {
    let limits: WriteLimits
    let maxRepositories: Int
    /// Who writes (for the leases it names).
    let peer: Peer
    let writer: Writer
    let origin: ConnectionID
    /// The wall clock, in seconds since 1970.
    let time: Int64
    /// Whether its reply carries the value it replaced (`set`, `delete`; not `batch`).
    let single: Bool
}

/// A write as a session hands it over: its operations, read in place (valid during
/// `submit`), and its context.
struct WriteInput {
    let ops: UnsafeBufferPointer<RawWriteOp>
    let context: WriteContext
}

/// A write that waits for a shared store: its operations owning their bytes.
struct WriteRequest: Sendable {
    let ops: WriteOps
    let context: WriteContext

    init(_ input: WriteInput) {
        ops = WriteOps(copying: input.ops)
        context = input.context
    }

    /// The leases its `set`s name.
    var leases: Set<UInt64> { ops.leases }
}

/// Space a session reuses for its writes: what the write rules decide per operation, and the
/// value a single-key write replaced, copied out for its reply. (A class its session keeps:
/// handed down by reference, nothing of it is copied per write.)
final class WriteScratch {
    var plans = OpPlanBuffer()
    var old: [UInt8] = []
}

@available(*, unavailable)
extension WriteScratch: Sendable {}

/// What a write did, for its reply.
struct WriteOutcome: Sendable {
    /// The repository revision after the write.
    let revision: UInt64
    let changed: Bool
    /// Whether the key a single-key write names existed (its reply then carries `old`: the
    /// value it replaced, in the session's `WriteScratch.old` — or, decided by a shared
    /// store later, given with the answer).
    let existed: Bool
    /// The state the reply reports: it is sent once that state is durable.
    let sequence: StateSequence
}

/// Why a write was not applied (or, for `.shared(.outcomeUnknown)`, may not have been).
enum WriteFailure: Error, Sendable {
    /// Refused by the write rules or limits, checked against the state `at` names (read under
    /// the same lock as the check): its reply waits until that state is durable, and becomes
    /// a storage failure if that state is undone.
    case refused(WriteRefusal, at: StateSequence)
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

/// Where a write decided later is answered: a connection's loop. Sendable; the session it
/// leads to is touched only on that loop.
final class AnswerRoute: Sendable {
    let loop: IOLoop
    private let deliver: @Sendable (UInt64, WriteDecision, CanonicalJSON?) -> Void

    /// `deliver` runs on `loop` with a write's token, result, and the value a single-key write
    /// replaced (or left in place).
    init(loop: IOLoop, deliver: @escaping @Sendable (UInt64, WriteDecision, CanonicalJSON?) -> Void) {
        self.loop = loop
        self.deliver = deliver
    }

    /// Answers write `token` (from any thread).
    func answer(_ token: UInt64, _ result: WriteDecision, previous: CanonicalJSON?) {
        loop.execute { [deliver] in deliver(token, result, previous) }
    }
}

/// Decides writes. (A class: the hub's sequencer is used on every write, and an existential
/// of a struct is copied — its references retained — at each use.)
protocol Sequencer: AnyObject, Sendable {
    /// Decides `write` on `repository`: returns its result now, or nil — then `route()` is
    /// answered with `token` exactly once, later. `scratch` is the session's: a write decided
    /// now that replaced a value leaves it in `scratch.old` for its reply.
    func submit(_ write: WriteInput, to repository: Repository, scratch: WriteScratch, route: () -> AnswerRoute, token: UInt64) -> WriteDecision?

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

    func submit(_ write: WriteInput, to repository: Repository, scratch: WriteScratch, route: () -> AnswerRoute, token: UInt64) -> WriteDecision? {
        let plans = scratch.plans.room(for: write.ops.count)
        return repository.withState { s -> WriteDecision in
            let plan: WritePlan
            do throws(WriteRefusal) { plan = try s.core.plan(write.ops, limits: write.context.limits, into: plans) } catch {
                return .failure(.refused(error, at: s.current))
            }
            // A lease named must exist and be the writer's — checked, and this repository
            // recorded in the lease, under this lock: a lease that ends meanwhile ends either
            // before (refused) or after, its end then finding the key this write attaches.
            for op in write.ops where op.lease != nil && op.value != nil {
                if let refusal = leases.admit(op.lease!, by: write.context.peer, into: repository.name) { return .failure(.lease(refusal)) }
            }
            // The value a single-key write replaced (or left in place), for its reply: copied
            // out before the install overwrites it.
            var existed = false
            if write.context.single {
                if scratch.old.capacity > 1 << 16 { scratch.old = [] }
                let old = plans[0].old
                scratch.old.replaceSubrange(scratch.old.indices, with: old ?? UnsafeRawBufferPointer(start: nil, count: 0))
                existed = old != nil
            }
            guard plan.changed > 0 else {
                // No revision; the attachments it moves are stored all the same, and its reply
                // waits until they are durable.
                let moves = s.core.attach(write.ops)
                guard !moves.isEmpty else {
                    return .success(WriteOutcome(revision: s.core.revision, changed: false, existed: existed, sequence: s.current))
                }
                guard let sequence = attach(moves, &s, repository) else { return .failure(.storageClosed) }
                return .success(WriteOutcome(revision: s.core.revision, changed: false, existed: existed, sequence: sequence))
            }
            // Only a `set` brings an empty repository into existence; the count is reserved
            // atomically, so concurrent creators cannot pass the limit together.
            if plan.creates, !stats.reserveRepository(limit: write.context.maxRepositories) {
                return .failure(.tooManyRepositories(limit: write.context.maxRepositories))
            }
            let moves = s.core.attach(write.ops)
            guard
                let revision = commit(
                    plan, write.ops, plans, &s, repository, time: write.context.time, writer: write.context.writer, origin: write.context.origin.value, moves: moves)
            else { return .failure(.storageClosed) }
            return .success(WriteOutcome(revision: revision.revision, changed: true, existed: existed, sequence: revision.sequence))
        }
    }

    func end(_ lease: EndedLease, in repository: Repository, time: Int64, done: @escaping @Sendable (WriteOutcome?) -> Void) {
        let outcome = repository.withState { s -> WriteOutcome? in
            let attached = s.core.keys(attachedTo: lease.id)
            guard !attached.isEmpty else { return nil }
            let end = LeaseEnd(lease: lease.id, reason: lease.end)
            return WriteOps(deleting: attached).withRawOps { ops -> WriteOutcome? in
                withUnsafeTemporaryAllocation(of: OpPlan.self, capacity: ops.count) { plans -> WriteOutcome? in
                    guard let plan = try? s.core.plan(ops, limits: WriteLimits(maxKeys: .max, maxRevisionBytes: .max), into: plans), plan.changed > 0
                    else { return nil }
                    // The keys' detachment goes with the revision: if storage fails it and it is
                    // undone, they are attached to the lease again, and the deletion is made again.
                    let moves = s.core.attach(ops)
                    guard let revision = commit(plan, ops, plans, &s, repository, time: time, writer: lease.owner, origin: 0, leaseEnd: end, moves: moves)
                    else { return nil }
                    return WriteOutcome(revision: revision.revision, changed: true, existed: false, sequence: revision.sequence)
                }
            }
        }
        done(outcome)
    }

    /// Stores attachments a write moved without making a revision, as the repository's next
    /// state; nil: storage is closed (they are moved back).
    private func attach(_ moves: [RepositoryCore.AttachmentMove], _ s: inout Repository.State, _ repository: Repository) -> StateSequence? {
        let immediate = storage.isImmediate
        let stored =
            immediate
            || storage.append(.attachments(repo: repository.name, revision: s.core.revision, moves: moves), sequence: s.nextSequence, listener: repository)
        guard stored else {
            for move in moves.reversed() { s.core.setAttachment(move.key, to: move.from) }
            return nil
        }
        s.core.recordAttachments(moves, durable: immediate)
        return repository.appliedAttachments(&s, durable: immediate)
    }

    /// Commits `ops`, planned (a write that changes something), as the repository's next
    /// revision: hands its frame to storage — encoded from the request's bytes and the table's,
    /// before they change — then records and installs it, and shows it at once if storage is
    /// immediate (memory), else once storage says it is durable. Nil: storage is closed, and
    /// nothing was applied (the attachment `moves` are taken back).
    private func commit(
        _ plan: WritePlan, _ ops: UnsafeBufferPointer<RawWriteOp>, _ plans: UnsafeMutableBufferPointer<OpPlan>, _ s: inout Repository.State, _ repository: Repository,
        time: Int64, writer: Writer?, origin: UInt64, leaseEnd: LeaseEnd? = nil, moves: [RepositoryCore.AttachmentMove]
    ) -> (revision: UInt64, sequence: StateSequence)? {
        let immediate = storage.isImmediate
        let info = s.core.nextRevision(plan, time: time, writer: writer, origin: origin)
        if !immediate {
            // Storage never calls back from inside `append` (this lock is held).
            let sequence = s.nextSequence
            let stored = RepositoryCore.withChanges(ops, plans, changed: plan.changed) { changes in
                storage.append(
                    .revision(
                        RevisionFrame(
                            repo: repository.name, epoch: repository.epoch, revision: info.revision, time: info.time, writer: info.writer,
                            leaseEnd: leaseEnd, moves: moves, changes: .raw(changes))),
                    sequence: sequence, listener: repository)
            }
            guard stored else {
                for move in moves.reversed() { s.core.setAttachment(move.key, to: move.from) }
                if plan.creates { stats.repositories.subtract(1, ordering: .relaxed) }
                return nil
            }
        }
        s.core.commit(plan, ops, plans, as: info, durable: immediate, tail: leaseEnd.map(RepositoryCore.tail) ?? [], moves: moves)
        if plan.creates { repository.makePermanent() }
        return (info.revision, repository.appliedRevision(&s, durable: immediate))
    }
}
