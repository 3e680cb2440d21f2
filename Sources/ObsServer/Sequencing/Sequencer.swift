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
import ObsStore
import ObsValues
import ObservableKit
import Synchronization

/// A write, as a session hands it over.
struct WriteRequest: Sendable {
    let ops: [WriteOp<CanonicalJSON>]
    let limits: WriteLimits
    let maxRepositories: Int
    let writer: Writer
    let origin: ConnectionID
    /// The wall clock, in seconds since 1970.
    let time: Int64
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
}

typealias WriteDecision = Result<WriteOutcome, WriteFailure>

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

/// Decides writes.
protocol Sequencer: Sendable {
    /// Decides `write` on `repository`: returns its result now, or nil — then `route` is
    /// answered with `token` exactly once, later.
    func submit(_ write: WriteRequest, to repository: Repository, route: AnswerRoute, token: UInt64) -> WriteDecision?
}

/// Decisions made here and now: the local store (memory, or the write-ahead log).
struct LocalSequencer: Sequencer {
    let storage: any Storage
    let stats: ServerStats

    func submit(_ write: WriteRequest, to repository: Repository, route: AnswerRoute, token: UInt64) -> WriteDecision? {
        let immediate = storage.isImmediate
        return repository.withState { s -> WriteDecision in
            let plan: WritePlan
            do throws(WriteRefusal) { plan = try s.core.plan(write.ops, limits: write.limits) } catch { return .failure(.refused(error)) }
            guard !plan.changes.isEmpty else {
                return .success(WriteOutcome(revision: s.core.revision, changed: false, previous: plan.previous, sequence: s.current))
            }
            // Only a `set` brings an empty repository into existence; the count is reserved
            // atomically, so concurrent creators cannot pass the limit together.
            if plan.creates, !stats.reserveRepository(limit: write.maxRepositories) {
                return .failure(.tooManyRepositories(limit: write.maxRepositories))
            }
            let info = s.core.commit(plan, time: write.time, writer: write.writer, origin: write.origin.value, durable: immediate)
            if !immediate {
                // Storage never calls back from inside `append` (this lock is held); a store
                // that no longer takes revisions says so, and the revision is taken back.
                let record = RevisionRecord(
                    repo: repository.name, changeSet: ChangeSet(revision: info.revision, changes: plan.changes), time: info.time,
                    writer: info.writer)
                guard storage.append(record, listener: repository) else {
                    s.core.undo(after: info.revision - 1)
                    if plan.creates { stats.repositories.subtract(1, ordering: .relaxed) }
                    return .failure(.storageClosed)
                }
            }
            if plan.creates { repository.makePermanent() }
            let sequence = Repository.applied(&s, revision: info.revision, durable: immediate, on: repository)
            if immediate {
                let loops = s.subscriberLoops
                if !loops.isEmpty { s.core.withLastRecord { Repository.publish($0, to: loops, of: repository) } }
            }
            return .success(WriteOutcome(revision: info.revision, changed: true, previous: plan.previous, sequence: sequence))
        }
    }
}
