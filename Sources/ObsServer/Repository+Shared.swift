// ObsServer — a repository whose revisions a shared store decides (etcd mode: ObsStore's
// `SharedStorage`, implemented by ObsCluster).
//
// Here the state never moves on a local write. Writes queue per repository; one group at a
// time is planned on the current state — each write with its own revision, planned on top
// of the ones before it in the group, by the same rules as ever (`KeyedState.plan`, installed
// then reverted, so readers never see a plan) — and handed to the store, which commits it
// only if that state is still current everywhere. Every committed revision, this daemon's
// and every other's, arrives through `install(shared:)` in the store's order, and is
// published exactly like a local one. A group's writers are answered once the store says:
// committed (their revisions are installed by then), current (a group of writes that change
// nothing was checked against the cluster), stale (another daemon's revisions came first:
// the same writes are planned again on the new state) or failed (the cause, for the reply).

import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// Names commit groups: this daemon's random id and a counter.
final class WriteIDs: Sendable {
    private let daemon = Epoch.random().prefix(16)
    private let counter = Atomic<UInt64>(0)

    func next() -> String { "\(daemon)-\(counter.add(1, ordering: .relaxed).newValue)" }
}

/// A write waiting for the shared store.
struct SharedItem: Sendable {
    let ops: [WriteOp<CanonicalJSON>]
    let limits: WriteLimits
    let writer: Writer?
    /// The writing connection (its outbox), for `echo: false`.
    let origin: ConnectionID?
    /// Past it, the write is answered with an error instead of being planned again.
    let deadline: ContinuousClock.Instant
    /// Called once, from any thread, with the write's outcome.
    let done: @Sendable (Result<WriteOutcome, WriteRefusal>) -> Void
}

/// A repository's writes waiting for the shared store, and the group being committed.
struct SharedQueue: Sendable {
    var waiting: [SharedItem] = []
    /// A group is being planned or committed.
    var busy = false
    /// The group being committed: its write id and the connection of each of its revisions.
    var inflight: (writeID: String, origins: [UInt64: ConnectionID])? = nil
    /// Groups whose outcome the store could not report, newest last: the store may still
    /// apply one, and its revisions must then count as their writers' (`echo: false`).
    var unsettled: [(writeID: String, origins: [UInt64: ConnectionID])] = []

    /// How many unsettled groups are remembered (the store settles a group within seconds).
    static let unsettledLimit = 64

    /// The connection that wrote `revision` of group `writeID`, if this daemon wrote it.
    func origin(of writeID: String?, revision: UInt64) -> ConnectionID? {
        guard let writeID else { return nil }
        if let inflight, inflight.writeID == writeID { return inflight.origins[revision] }
        return unsettled.last { $0.writeID == writeID }?.origins[revision]
    }
}

/// A planned group: what to commit, and each write's answer should it commit.
private struct SharedGroup: Sendable {
    let commit: SharedCommit
    let answers: [(item: SharedItem, answer: Result<WriteOutcome, WriteRefusal>)]
}

extension Repository {
    /// Queues a write for the shared store; `item.done` is called with its outcome.
    func submitShared(_ item: SharedItem) {
        let start = state.withLock { s -> Bool in
            s.shared.waiting.append(item)
            if s.shared.busy { return false }
            s.shared.busy = true
            return true
        }
        if start { commitNextGroup() }
    }

    /// The hub keeps this repository for good (a write to it is under way).
    func keep() { permanent.store(true, ordering: .releasing) }

    /// Installs and publishes revisions the shared store delivered, in order. The store
    /// checks that they continue the ones it delivered before.
    func install(shared revisions: [SharedRevision]) {
        state.withLock { s in
            for shared in revisions {
                let record = shared.record
                guard record.revision == s.data.revision + 1 else { continue }
                let origin = s.shared.origin(of: shared.writeID, revision: record.revision)
                let revision = Revision(record, encode: !s.subscriberLoops.isEmpty, origin: origin)
                s.data.install(ChangeSet(revision: record.revision, changes: record.changes))
                s.lastTime = max(s.lastTime, record.time)
                s.history.append(revision)
                s.applied += 1
                s.current = s.applied
                durableSequence.store(s.applied, ordering: .releasing)
                if record.revision == 1 {
                    stats.repositories.add(1, ordering: .relaxed)
                    permanent.store(true, ordering: .releasing)
                }
                Self.publish(revision, of: self, to: s.subscriberLoops)
            }
        }
    }

    /// Plans the next group and commits it; the queue is idle once nothing waits. (`plan`
    /// takes every waiting write unless a group is full, so no group means none waits.)
    private func commitNextGroup() {
        guard let storage = sharedStorage, let writeIDs else { return }
        let now = WallClock.unixSeconds()
        var decided: [(SharedItem, Result<WriteOutcome, WriteRefusal>)] = []
        let group = state.withLock { s -> SharedGroup? in
            let group = plan(&s, storage: storage, writeID: writeIDs.next(), now: now, decided: &decided)
            if group == nil { s.shared.busy = false }
            return group
        }
        for (item, result) in decided { item.done(result) }
        if let group { Task { self.finish(group, await storage.commit(group.commit)) } }
    }

    /// Answers a group's writes by the store's outcome, then goes on with the next group.
    private func finish(_ group: SharedGroup, _ outcome: SharedCommitOutcome) {
        var answers: [(SharedItem, Result<WriteOutcome, WriteRefusal>)] = []
        state.withLock { s in
            if case .failed(let failure) = outcome, failure.kind == .outcomeUnknown, let inflight = s.shared.inflight {
                s.shared.unsettled.append(inflight)
                if s.shared.unsettled.count > SharedQueue.unsettledLimit { s.shared.unsettled.removeFirst() }
            }
            s.shared.inflight = nil
            switch outcome {
            case .committed, .current:
                answers = group.answers.map { ($0.item, $0.answer) }
            case .stale:
                s.shared.waiting.insert(contentsOf: group.answers.map(\.item), at: 0)
            case .failed(let failure):
                answers = group.answers.map { ($0.item, .failure(.shared(failure))) }
            }
        }
        for (item, answer) in answers { item.done(answer) }
        commitNextGroup()
    }

    /// Takes waiting writes into a group planned on the current state (under the lock).
    /// Writes whose answer needs no store — a batch naming a key twice, a deadline passed,
    /// a revision too large for one commit — go to `decided`.
    private func plan(
        _ s: inout State, storage: any SharedStorage, writeID: String, now: Int64,
        decided: inout [(SharedItem, Result<WriteOutcome, WriteRefusal>)]
    ) -> SharedGroup? {
        let basis = s.data.revision
        let clock = ContinuousClock.now
        var answers: [(item: SharedItem, answer: Result<WriteOutcome, WriteRefusal>)] = []
        var records: [RevisionRecord] = []
        var installed: [(ChangeSet<CanonicalJSON>, [Entry<CanonicalJSON>?])] = []
        var origins: [UInt64: ConnectionID] = [:]
        var time = max(now, s.lastTime)
        while let item = s.shared.waiting.first {
            if clock >= item.deadline {
                s.shared.waiting.removeFirst()
                decided.append((item, .failure(.shared(SharedFailure(.unavailable, "the write could not be committed in time: other daemons' writes to repository \(name) kept coming first; nothing was applied")))))
                continue
            }
            let ops = item.ops
            let previous = ops.count == 1 ? s.data[ops[0].key]?.value : nil
            let changes: [Change<CanonicalJSON>]
            do throws(WriteError) {
                changes = try s.data.plan(ops)
            } catch {
                s.shared.waiting.removeFirst()
                if case .duplicateKey = error {
                    decided.append((item, .failure(.rules(error))))
                } else {
                    answers.append((item, .failure(.rules(error))))  // a conflict: true if the state is current
                }
                continue
            }
            guard !changes.isEmpty else {
                s.shared.waiting.removeFirst()
                answers.append((item, .success(WriteOutcome(revision: s.data.revision, changed: false, previous: previous, sequence: 0))))
                continue
            }
            if let refusal = Self.limitRefusal(changes, data: s.data, limits: item.limits, stats: stats) {
                s.shared.waiting.removeFirst()
                answers.append((item, .failure(refusal)))
                continue
            }
            let changeSet = ChangeSet(revision: s.data.revision + 1, changes: changes)
            let record = RevisionRecord(repo: name, changeSet: changeSet, time: time, writer: item.writer)
            if let reason = storage.limitExceeded(by: records + [record]) {
                guard records.isEmpty else { break }  // the next group takes it
                s.shared.waiting.removeFirst()
                decided.append((item, .failure(.shared(SharedFailure(.tooLarge, reason)))))
                continue
            }
            s.shared.waiting.removeFirst()
            let before = Dictionary(ops.map { ($0.key, s.data[$0.key]) }, uniquingKeysWith: { first, _ in first })
            installed.append((changeSet, changes.map { before[$0.key] ?? nil }))
            s.data.install(changeSet)
            time = record.time
            records.append(record)
            if let origin = item.origin { origins[record.revision] = origin }
            answers.append((item, .success(WriteOutcome(revision: changeSet.revision, changed: true, previous: previous, sequence: 0))))
        }
        for (changeSet, previous) in installed.reversed() { s.data.revert(changeSet, previous: previous) }
        guard !answers.isEmpty else { return nil }
        if !records.isEmpty { s.shared.inflight = (writeID, origins) }
        let deadline = answers.map(\.item.deadline).min()!
        let commit = SharedCommit(repo: name, basisRevision: basis, records: records, writeID: writeID, deadline: deadline)
        return SharedGroup(commit: commit, answers: answers)
    }

    /// The limits a write's changes would pass, on `data` (as `write` checks them).
    private static func limitRefusal(
        _ changes: [Change<CanonicalJSON>], data: KeyedState<CanonicalJSON>, limits: WriteLimits, stats: ServerStats
    ) -> WriteRefusal? {
        if let refusal = sizeRefusal(changes, keys: data.count, limits: limits) { return refusal }
        if data.revision == 0, stats.repositories.load(ordering: .relaxed) >= limits.maxRepositories {
            return .tooManyRepositories(limit: limits.maxRepositories)
        }
        return nil
    }
}
