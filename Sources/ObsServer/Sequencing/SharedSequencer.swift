// ObsServer — writes decided by a shared store (etcd mode: ObsStore's `SharedStorage`,
// implemented by ObsCluster).
//
// Here the state never moves on a local write. Writes queue per repository; one group at a
// time is planned on the current state — each write on top of the ones before it in the
// group, by the same rules as ever, installed tentatively then taken back, so readers never
// see a plan (SharedSequencer+Plan.swift) — and handed to the store, which commits it only if
// that state is still current everywhere. Every committed revision, this daemon's and every
// other's, arrives through the hub (`SharedStorageSink`) in the store's order and is installed
// and published like a local one. A group's writers are answered once the store says:
// committed (their revisions are installed by then), current (writes that change nothing were
// checked against the cluster), stale (another daemon's revisions came first: the same writes
// are planned again on the new state), a lease they name ended (planned again: those writes
// are then `not_found`), or failed (the cause, for the reply).
//
// A lease's end is queued the same way: it deletes the keys still attached to the lease when
// its group is planned. Every daemon queues it when the store tells of the end; the first
// group to commit deletes them, and every other daemon's plan — on a state that then includes
// that revision — finds nothing left to delete: one deletion per repository, whoever wins.

import ObsCore
import ObsStore
import ObsValues
import ObservableKit
import Synchronization

/// Names commit groups: this daemon's random id and a counter.
final class WriteIDs: Sendable {
    private let daemon = Epoch.random().prefix(16)
    private let counter = Atomic<UInt64>(0)

    func next() -> String { "\(daemon)-\(counter.add(1, ordering: .relaxed).newValue)" }
}

final class SharedSequencer: Sequencer, Sendable {
    let store: any SharedStorage
    let stats: ServerStats
    let writeIDs = WriteIDs()
    /// Where lease ends are committed from (the first loop).
    private let leaseLoop: IOLoop
    /// How long a write may wait for the cluster before it is answered with the cause (the
    /// store may take a little longer to settle an unknown outcome).
    static let writeTimeout: Duration = .seconds(4)
    /// The most keys one revision of a lease's end deletes (etcd's `--max-txn-ops`, 128 by
    /// default, bounds a revision at 61 deleted keys: each takes its value and its tombstone);
    /// a lease holding more in one repository ends in several.
    static let leaseEndKeys = 60

    /// A write, or a lease's end, waiting for the store.
    struct Item: Sendable {
        enum Work: Sendable {
            case write(WriteRequest)
            /// Deletes the keys still attached to the lease (at most `limit`).
            case leaseEnd(EndedLease, limit: Int)
        }

        let work: Work
        /// Where the commit runs: the first writer's loop.
        let loop: IOLoop
        /// Past it, the item is answered with an error instead of being planned again.
        let deadline: ContinuousClock.Instant
        /// Called once with the result (and the value a single-key write replaced, if any).
        let answer: @Sendable (WriteDecision, CanonicalJSON?) -> Void
    }

    /// A group's connections per revision, kept until its revisions arrive (or for a while
    /// after an unknown outcome, since the store may still apply it).
    private typealias Origins = (writeID: String, origins: [UInt64: ConnectionID])

    /// One repository's queue.
    private struct Queue: Sendable {
        var waiting: [Item] = []
        /// A group is being planned or committed.
        var busy = false
        var inflight: Origins? = nil
        /// Groups whose outcome the store could not report, newest last.
        var unsettled: [Origins] = []
    }

    /// How many unsettled groups are remembered per repository (the store settles one within seconds).
    static let unsettledLimit = 64

    private let queues = Locked<[UInt64: Queue]>([:])

    /// The revisions that deleted recent leases' keys, by repository and lease (at most
    /// `endsKept`): a daemon whose own deletion found the keys gone reports the winner's.
    private let ends = Locked<(revisions: [EndKey: (revision: UInt64, name: String)], order: [EndKey])>(([:], []))
    private struct EndKey: Hashable { let repository: UInt64, lease: UInt64 }
    static let endsKept = 4096

    init(store: any SharedStorage, stats: ServerStats, leaseLoop: IOLoop) {
        self.store = store
        self.stats = stats
        self.leaseLoop = leaseLoop
    }

    /// Every write is the cluster's to decide: none is decided here and now. The write, copied
    /// out of the request's bytes, waits in its repository's queue.
    func submit(_ input: WriteInput, to repository: Repository, scratch: WriteScratch, route: () -> AnswerRoute, token: UInt64) -> WriteDecision? {
        let write = WriteRequest(input)
        let route = route()
        let item = Item(work: .write(write), loop: route.loop, deadline: .now + Self.writeTimeout) { route.answer(token, $0, previous: $1) }
        // A lease granted on another daemon a moment ago may not have reached this one yet.
        let unknown = write.leases.filter { store.liveLease($0) == nil }.sorted()
        guard !unknown.isEmpty else {
            enqueue(item, to: repository)
            return nil
        }
        Task(executorPreference: route.loop) {
            for id in unknown {
                switch await self.store.lease(id) {
                case .success(nil): return item.answer(.failure(.lease(.notFound(id))), nil)
                case .failure(let failure): return item.answer(.failure(.shared(failure)), nil)
                case .success: continue
                }
            }
            self.enqueue(item, to: repository)
        }
        return nil
    }

    /// Deletes the keys still attached to `lease` in `repository`, in revisions of at most
    /// `leaseEndKeys` keys, retrying while the cluster cannot commit; `done` gets the first
    /// revision that deleted them — this daemon's, or another's that came first — or nil.
    func end(_ lease: EndedLease, in repository: Repository, time: Int64, done: @escaping @Sendable (WriteOutcome?) -> Void) {
        end(lease, in: repository, limit: Self.leaseEndKeys, first: nil, done: done)
    }

    private func end(
        _ lease: EndedLease, in repository: Repository, limit: Int, first: WriteOutcome?, done: @escaping @Sendable (WriteOutcome?) -> Void
    ) {
        let item = Item(work: .leaseEnd(lease, limit: limit), loop: leaseLoop, deadline: .now + Self.writeTimeout) { [self] decision, _ in
            switch decision {
            case .success(let outcome) where outcome.changed:
                // Deleted up to `limit` keys: plan again for any left.
                end(lease, in: repository, limit: limit, first: first ?? outcome, done: done)
            case .success(let outcome):
                // Nothing left; `revision` names another daemon's deletion if one is known.
                let known = outcome.revision > 0 ? WriteOutcome(revision: outcome.revision, changed: true, existed: false, sequence: outcome.sequence) : nil
                done(first ?? known)
            case .failure(let failure):
                // The keys must go: try again (with fewer per revision if the store found too many).
                var fewer = limit
                if case .shared(let shared) = failure, shared.kind == .tooLarge { fewer = max(1, limit / 2) }
                Task {
                    try? await Task.sleep(for: .milliseconds(500))
                    self.end(lease, in: repository, limit: fewer, first: first, done: done)
                }
            }
        }
        enqueue(item, to: repository)
    }

    /// A revision of `repository` that deleted lease `lease`'s keys arrived.
    func noteEnd(of lease: UInt64, in repository: Repository, revision: UInt64) {
        ends.withLock { e in
            let key = EndKey(repository: repository.id, lease: lease)
            if e.revisions.updateValue((revision, repository.name), forKey: key) == nil { e.order.append(key) }
            if e.order.count > Self.endsKept { e.revisions[e.order.removeFirst()] = nil }
        }
    }

    /// The revision that deleted lease `lease`'s keys in `repository`, if one arrived lately.
    func endRevision(of lease: UInt64, in repository: Repository) -> UInt64? {
        ends.withLock { $0.revisions[EndKey(repository: repository.id, lease: lease)]?.revision }
    }

    /// The repositories where a revision that deleted lease `lease`'s keys arrived lately.
    func repositoriesEnding(_ lease: UInt64) -> Set<String> {
        ends.withLock { e in Set(e.revisions.lazy.filter { $0.key.lease == lease }.map(\.value.name)) }
    }

    /// The connection of this daemon that wrote `revision` of group `writeID` (0: none).
    func origin(of writeID: String?, revision: UInt64, in repository: Repository) -> UInt64 {
        guard let writeID else { return 0 }
        return queues.withLock { q -> UInt64 in
            guard let queue = q[repository.id] else { return 0 }
            if let inflight = queue.inflight, inflight.writeID == writeID { return inflight.origins[revision]?.value ?? 0 }
            return queue.unsettled.last { $0.writeID == writeID }?.origins[revision]?.value ?? 0
        }
    }

    private func enqueue(_ item: Item, to repository: Repository) {
        let start = queues.withLock { q -> Bool in
            q[repository.id, default: Queue()].waiting.append(item)
            if q[repository.id]!.busy { return false }
            q[repository.id]!.busy = true
            return true
        }
        if start { commitNextGroup(of: repository) }
    }

    /// Plans the next group and commits it; the queue is idle once nothing waits.
    private func commitNextGroup(of repository: Repository) {
        while true {
            let items = queues.withLock { q -> [Item] in
                guard var queue = q[repository.id] else { return [] }
                if queue.waiting.isEmpty {
                    queue.busy = false
                    q[repository.id] = queue.unsettled.isEmpty && queue.inflight == nil ? nil : queue
                    return []
                }
                let items = queue.waiting
                queue.waiting = []
                q[repository.id] = queue
                return items
            }
            guard let loop = items.first?.loop else { return }
            let (group, decided, rest) = plan(items, in: repository)
            for (item, result) in decided { item.answer(result, nil) }
            if !rest.isEmpty { queues.withLock { q in q[repository.id, default: Queue()].waiting.insert(contentsOf: rest, at: 0) } }
            guard let group else { continue }  // every item decided without the store: on to the next ones
            if !group.records.isEmpty {
                queues.withLock { q in q[repository.id, default: Queue()].inflight = (group.commit.writeID, group.origins) }
            }
            let store = self.store
            // On the first writer's loop (not the global pool): the loops run the daemon's work.
            Task(executorPreference: loop) { self.finish(group, in: repository, await store.commit(group.commit)) }
            return
        }
    }

    struct Group: Sendable {
        let commit: SharedCommit
        let records: [RevisionRecord]
        let origins: [UInt64: ConnectionID]
        let answers: [(item: Item, answer: WriteDecision, previous: CanonicalJSON?)]
    }

    /// Answers a group's items by the store's outcome, then goes on with the next group.
    private func finish(_ group: Group, in repository: Repository, _ outcome: SharedCommitOutcome) {
        var answers: [(Item, WriteDecision, CanonicalJSON?)] = []
        queues.withLock { q in
            var queue = q[repository.id] ?? Queue()
            if case .failed(let failure) = outcome, failure.kind == .outcomeUnknown, let inflight = queue.inflight {
                queue.unsettled.append(inflight)
                if queue.unsettled.count > Self.unsettledLimit { queue.unsettled.removeFirst() }
            }
            queue.inflight = nil
            switch outcome {
            case .committed, .current:
                answers = group.answers.map { ($0.item, $0.answer, $0.previous) }
            case .stale, .leaseEnded:
                // Planned again on the newer state (where the ended leases are no longer live).
                queue.waiting.insert(contentsOf: group.answers.map(\.item), at: 0)
            case .failed(let failure):
                answers = group.answers.map { ($0.item, .failure(.shared(failure)), nil) }
            }
            q[repository.id] = queue
        }
        for (item, answer, previous) in answers { item.answer(answer, previous) }
        commitNextGroup(of: repository)
    }
}
