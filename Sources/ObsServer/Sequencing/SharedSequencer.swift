// ObsServer — writes decided by a shared store (etcd mode: ObsStore's `SharedStorage`,
// implemented by ObsCluster).
//
// Here the state never moves on a local write. Writes queue per repository; one group at a
// time is planned on the current state — each write on top of the ones before it in the
// group, by the same rules as ever, installed tentatively then taken back, so readers never
// see a plan — and handed to the store, which commits it only if that state is still current
// everywhere. Every committed revision, this daemon's and every other's, arrives through the
// hub (`SharedStorageSink`) in the store's order and is installed and published like a local
// one. A group's writers are answered once the store says: committed (their revisions are
// installed by then), current (writes that change nothing were checked against the cluster),
// stale (another daemon's revisions came first: the same writes are planned again on the new
// state) or failed (the cause, for the reply).

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
    private let stats: ServerStats
    private let writeIDs = WriteIDs()
    /// How long a write may wait for the cluster before it is answered with the cause (the
    /// store may take a little longer to settle an unknown outcome).
    static let writeTimeout: Duration = .seconds(4)

    /// A write waiting for the store.
    private struct Item: Sendable {
        let write: WriteRequest
        let route: AnswerRoute
        let token: UInt64
        /// Past it, the write is answered with an error instead of being planned again.
        let deadline: ContinuousClock.Instant

        func answer(_ result: WriteDecision) { route.answer(token, result) }
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

    private let queues = Mutex<[UInt64: Queue]>([:])

    init(store: any SharedStorage, stats: ServerStats) {
        self.store = store
        self.stats = stats
    }

    func submit(_ write: WriteRequest, to repository: Repository, route: AnswerRoute, token: UInt64) -> WriteDecision? {
        let item = Item(write: write, route: route, token: token, deadline: .now + Self.writeTimeout)
        let start = queues.withLock { q -> Bool in
            q[repository.id, default: Queue()].waiting.append(item)
            if q[repository.id]!.busy { return false }
            q[repository.id]!.busy = true
            return true
        }
        if start { commitNextGroup(of: repository) }
        return nil
    }

    /// Leases are not granted when the store is shared (see `Session.grant`): none ends here.
    func end(_ lease: EndedLease, keys: Set<Key>, in repository: Repository, time: Int64, done: @escaping @Sendable (WriteOutcome?) -> Void) {
        done(nil)
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
            guard let loop = items.first?.route.loop else { return }
            let (group, decided, rest) = plan(items, in: repository)
            for (item, result) in decided { item.answer(result) }
            if !rest.isEmpty { queues.withLock { q in q[repository.id, default: Queue()].waiting.insert(contentsOf: rest, at: 0) } }
            guard let group else { continue }  // every write decided without the store: on to the next ones
            if !group.records.isEmpty {
                queues.withLock { q in q[repository.id, default: Queue()].inflight = (group.commit.writeID, group.origins) }
            }
            let store = self.store
            // On the first writer's loop (not the global pool): the loops run the daemon's work.
            Task(executorPreference: loop) { self.finish(group, in: repository, await store.commit(group.commit)) }
            return
        }
    }

    private struct Group: Sendable {
        let commit: SharedCommit
        let records: [RevisionRecord]
        let origins: [UInt64: ConnectionID]
        let answers: [(item: Item, answer: WriteDecision)]
    }

    /// Answers a group's writes by the store's outcome, then goes on with the next group.
    private func finish(_ group: Group, in repository: Repository, _ outcome: SharedCommitOutcome) {
        var answers: [(Item, WriteDecision)] = []
        queues.withLock { q in
            var queue = q[repository.id] ?? Queue()
            if case .failed(let failure) = outcome, failure.kind == .outcomeUnknown, let inflight = queue.inflight {
                queue.unsettled.append(inflight)
                if queue.unsettled.count > Self.unsettledLimit { queue.unsettled.removeFirst() }
            }
            queue.inflight = nil
            switch outcome {
            case .committed, .current:
                answers = group.answers.map { ($0.item, $0.answer) }
            case .stale:
                queue.waiting.insert(contentsOf: group.answers.map(\.item), at: 0)
            case .failed(let failure):
                answers = group.answers.map { ($0.item, .failure(.shared(failure))) }
            }
            q[repository.id] = queue
        }
        for (item, answer) in answers { item.answer(answer) }
        commitNextGroup(of: repository)
    }

    /// Plans `items` into a group on the current state. Writes whose answer needs no store —
    /// a batch naming a key twice, a deadline passed, a revision too large for one commit —
    /// are `decided`; those that do not fit this group are the `rest`.
    private func plan(_ items: [Item], in repository: Repository) -> (Group?, decided: [(Item, WriteDecision)], rest: [Item]) {
        let clock = ContinuousClock.now
        let now = WallClock.unixSeconds()
        let writeID = writeIDs.next()
        return repository.withState { s in
            let basis = s.core.revision
            var decided: [(Item, WriteDecision)] = []
            var answers: [(item: Item, answer: WriteDecision)] = []
            var records: [RevisionRecord] = []
            var tentatives: [RepositoryCore.Tentative] = []
            var origins: [UInt64: ConnectionID] = [:]
            var rest: [Item] = []
            var time = now
            for (index, item) in items.enumerated() {
                if clock >= item.deadline {
                    let failure = SharedFailure(
                        .unavailable,
                        "the write could not be committed in time: other daemons' writes to repository \(repository.name) kept coming first; nothing was applied")
                    decided.append((item, .failure(.shared(failure))))
                    continue
                }
                let plan: WritePlan
                do throws(WriteRefusal) {
                    plan = try s.core.plan(item.write.ops, limits: item.write.limits)
                } catch {
                    if case .rules(.duplicateKey) = error {
                        decided.append((item, .failure(.refused(error))))
                    } else {
                        answers.append((item, .failure(.refused(error))))  // a conflict: true if the state is current
                    }
                    continue
                }
                guard !plan.changes.isEmpty else {
                    answers.append((item, .success(WriteOutcome(revision: s.core.revision, changed: false, previous: plan.previous, sequence: 0))))
                    continue
                }
                if plan.creates, stats.repositories.load(ordering: .relaxed) >= item.write.maxRepositories {
                    answers.append((item, .failure(.tooManyRepositories(limit: item.write.maxRepositories))))
                    continue
                }
                let revision = s.core.revision + 1
                time = max(time, item.write.time)
                let record = RevisionRecord(
                    repo: repository.name, changeSet: ChangeSet(revision: revision, changes: plan.changes), time: time, writer: item.write.writer)
                if let reason = store.limitExceeded(by: records + [record]) {
                    guard records.isEmpty else {
                        rest = Array(items[index...])
                        break
                    }
                    decided.append((item, .failure(.shared(SharedFailure(.tooLarge, reason)))))
                    continue
                }
                tentatives.append(s.core.installTentatively(plan))
                records.append(record)
                origins[revision] = item.write.origin
                answers.append((item, .success(WriteOutcome(revision: revision, changed: true, previous: plan.previous, sequence: 0))))
            }
            s.core.revert(tentatives)
            guard !answers.isEmpty else { return (nil, decided, rest) }
            let deadline = answers.map(\.item.deadline).min()!
            let commit = SharedCommit(repo: repository.name, basisRevision: basis, records: records, writeID: writeID, deadline: deadline)
            return (Group(commit: commit, records: records, origins: origins, answers: answers), decided, rest)
        }
    }
}
