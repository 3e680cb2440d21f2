// ObsServer — planning one group of a shared store's commits (SharedSequencer.swift): every
// waiting write and lease end of a repository, in order, each on the state the ones before it
// leave — values installed tentatively and taken back, lease attachments in an overlay — by
// the same rules as a local write, in the same functions: the write rules
// (`RepositoryCore.plan`), then the leases a write names (live, and its uid's, or uid 0:
// `LeaseRefusal.naming`), then its attachment moves (`RepositoryCore.attachmentMoves`: the
// last `set` of a key decides its lease, even with an equal value; a `delete` detaches), then
// the limits. The group also says what its installs will do to the repository's tombstones —
// those its re-created keys take away, and the floor its deletions leave past the bound — so
// the store keeps the same ones.

import ObsCore
import ObsStore
import ObsValues
import ObservableKit

extension SharedSequencer {
    /// Plans `items` into a group on the current state. Items whose answer needs no store — a
    /// lease that is not live, a deadline passed, a revision too
    /// large for one commit, a lease's end with nothing left to delete — are `decided`; those
    /// that do not fit this group are the `rest`.
    func plan(_ items: [Item], in repository: Repository) -> (Group?, decided: [(Item, WriteDecision)], rest: [Item]) {
        let clock = ContinuousClock.now
        let now = WallClock.unixSeconds()
        let writeID = writeIDs.next()
        return repository.withState { s in
            let basis = s.core.revision
            let basisPosition = store.deliveredPosition(of: repository.name)  // (under the state's lock: see SharedCommit)
            var decided: [(Item, WriteDecision)] = []
            var answers: [(item: Item, answer: WriteDecision, previous: CanonicalJSON?)] = []
            var records: [RevisionRecord] = []
            var tentatives: [RepositoryCore.Tentative] = []
            var origins: [UInt64: ConnectionID] = [:]
            var rest: [Item] = []
            var time = now
            // Attachments the group moved so far, and the leases its writes name.
            var moved: [Key: UInt64?] = [:]
            var named: [UInt64: SharedLease] = [:]
            var leaseEnds: [UInt64: LeaseEnd] = [:]
            // Keys the group re-creates that have a tombstone (each takes one more operation).
            var recreated = 0
            var planBuffer = OpPlanBuffer()
            func attachment(_ key: Key, _ core: RepositoryCore) -> UInt64? {
                if let lease = moved[key] { return lease }
                return core.lease(of: key)
            }

            for (index, item) in items.enumerated() {
                if clock >= item.deadline {
                    let failure = SharedFailure(
                        .unavailable,
                        "the write could not be committed in time: other daemons' writes to repository \(repository.name) kept coming first; nothing was applied")
                    decided.append((item, .failure(.shared(failure))))
                    continue
                }
                let changes: [Change<CanonicalJSON>]
                var previous: CanonicalJSON? = nil
                var creates = false
                var writer: Writer?
                var origin: ConnectionID?
                var moves: [(Key, UInt64?)] = []
                var leases: [SharedLease] = []
                var end: LeaseEnd?
                switch item.work {
                case .write(let write):
                    // The write rules, on the state the group leaves so far: its changes (and the
                    // value a single-key write replaced) copied out, as the store takes values.
                    let planned = write.ops.withRawOps { ops in
                        Result { () throws(WriteRefusal) -> (changes: [Change<CanonicalJSON>], previous: CanonicalJSON?, creates: Bool) in
                            let plans = planBuffer.room(for: ops.count)
                            let plan = try s.core.plan(ops, limits: write.context.limits, into: plans)
                            let previous = write.context.single ? plans[0].old.map { CanonicalJSON(canonical: Array($0), isPlain: plans[0].oldIsPlain) } : nil
                            let changes = RepositoryCore.withChanges(ops, plans, changed: plan.changed) { $0.map(\.materialized) }
                            return (changes, previous, plan.creates)
                        }
                    }
                    switch planned {
                    case .failure(let error):
                        answers.append((item, .failure(.refused(error, at: s.current)), nil))  // a conflict: true if the state is current
                        continue
                    case .success(let planned):
                        (changes, previous, creates) = planned
                    }
                    switch Self.leases(named: write, in: store) {
                    case .failure(let refusal):
                        decided.append((item, .failure(.lease(refusal))))
                        continue
                    case .success(let found):
                        leases = found
                    }
                    // The attachment rule (RepositoryCore's, as a local write moves them), on the
                    // attachments the group leaves so far; the group takes the moves if it takes
                    // the write.
                    var pending: [Key: UInt64?] = [:]
                    moves = write.ops.withRawOps { ops in
                        RepositoryCore.attachmentMoves(ops) { key, to in
                            let from = pending[key] ?? attachment(key, s.core)
                            pending.updateValue(to, forKey: key)
                            return from
                        }
                    }.map { ($0.key, $0.to) }
                    guard !changes.isEmpty else {
                        for (key, lease) in moves { moved[key] = lease }
                        for lease in leases { named[lease.id] = lease }
                        answers.append((item, .success(WriteOutcome(revision: s.core.revision, changed: false, existed: previous != nil, sequence: 0)), previous))
                        continue
                    }
                    if creates, stats.repositories.load(ordering: .relaxed) >= write.context.maxRepositories {
                        answers.append((item, .failure(.tooManyRepositories(limit: write.context.maxRepositories)), nil))
                        continue
                    }
                    (writer, origin) = (write.context.writer, write.context.origin)
                    time = max(time, write.context.time)
                case .leaseEnd(let ended, let limit):
                    // The keys attached to it here, and those the group attached to it so far.
                    let candidates = Set(s.core.keys(attachedTo: ended.id)).union(moved.compactMap { $0.value == ended.id ? $0.key : nil })
                    let doomed = candidates.filter { attachment($0, s.core) == ended.id && s.core[$0] != nil }.sorted().prefix(limit)
                    let deletion = WriteOps(deleting: Array(doomed)).withRawOps { ops in
                        Result { () throws(WriteRefusal) -> [Change<CanonicalJSON>] in
                            let plans = planBuffer.room(for: ops.count)
                            let plan = try s.core.plan(ops, limits: WriteLimits(maxKeys: .max, maxRevisionBytes: .max), into: plans)
                            return RepositoryCore.withChanges(ops, plans, changed: plan.changed) { $0.map(\.materialized) }
                        }
                    }
                    guard !doomed.isEmpty, case .success(let deleted) = deletion, !deleted.isEmpty else {
                        // Nothing left: say which revision deleted them, if it is known.
                        let known = endRevision(of: ended.id, in: repository) ?? 0
                        decided.append((item, .success(WriteOutcome(revision: known, changed: false, existed: false, sequence: s.current))))
                        continue
                    }
                    changes = deleted
                    writer = ended.owner
                    moves = doomed.map { ($0, nil) }
                    end = LeaseEnd(lease: ended.id, reason: ended.end)
                }
                let revision = s.core.revision + 1
                let record = RevisionRecord(repo: repository.name, changeSet: ChangeSet(revision: revision, changes: changes), time: time, writer: writer)
                // (The value of a key the revision changes carries its attachment: a lease's
                // end moves none apart.)
                let tombstones = s.core.tombstones.isEmpty ? 0 : changes.count(where: { $0.old == nil && $0.new != nil && s.core.tombstones[$0.key] != nil })
                let extra = moved.count + (end == nil ? moves.count : 0) + named.count + leases.count + recreated + tombstones
                if let reason = store.limitExceeded(by: records + [record], extraOperations: extra) {
                    guard records.isEmpty else {
                        rest = Array(items[index...])
                        break
                    }
                    decided.append((item, .failure(.shared(SharedFailure(.tooLarge, reason)))))
                    continue
                }
                tentatives.append(s.core.installTentatively(changes))
                records.append(record)
                recreated += tombstones
                for (key, lease) in moves { moved[key] = lease }
                for lease in leases { named[lease.id] = lease }
                if let origin { origins[revision] = origin }
                if let end { leaseEnds[revision] = end }
                answers.append((item, .success(WriteOutcome(revision: revision, changed: true, existed: previous != nil, sequence: 0)), previous))
            }
            // After the group: the lease of every key it changed, and the keys it only re-attached.
            var changed = Set<Key>()
            var attachments: [Key: UInt64] = [:]
            for record in records {
                for change in record.changes {
                    changed.insert(change.key)
                    if change.new != nil, let lease = attachment(change.key, s.core) { attachments[change.key] = lease }
                }
            }
            var reattached: [SharedReattachment] = []
            for (key, lease) in moved where !changed.contains(key) && lease != s.core.lease(of: key) {
                if let entry = s.core[key] { reattached.append(SharedReattachment(key: key, entry: entry, lease: lease)) }
            }
            // The tombstones every daemon's install of the group will change (the tentative
            // installs leave them as they are on the basis): the ones it takes away, and the
            // floor it leaves.
            var steps: [Tombstones.Step] = []
            var removed: [Key: UInt64] = [:]
            for record in records {
                for change in record.changes {
                    if change.new == nil {
                        steps.append(.deleted(change.key, at: record.revision))
                    } else if change.old == nil {
                        steps.append(.recreated(change.key))
                        if let at = s.core.tombstones[change.key] { removed[change.key] = at }
                    }
                }
            }
            let floor = s.core.tombstones.planned(steps)
            s.core.revert(tentatives)
            guard !answers.isEmpty else { return (nil, decided, rest) }
            let deadline = answers.map(\.item.deadline).min()!
            var commit = SharedCommit(repo: repository.name, basisRevision: basis, records: records, writeID: writeID, deadline: deadline)
            commit.leases = named.values.sorted { $0.id < $1.id }
            commit.attachments = attachments
            commit.reattached = reattached.sorted { $0.key < $1.key }
            commit.leaseEnds = leaseEnds
            commit.tombstonesRemoved = removed
            commit.tombstoneFloor = floor
            commit.basisPosition = basisPosition
            return (Group(commit: commit, records: records, origins: origins, answers: answers), decided, rest)
        }
    }

    /// The live leases `write` names, or why one may not be named: not live (as far as this
    /// daemon knows — the store's compare has the last word), or another uid's.
    private static func leases(named write: WriteRequest, in store: any SharedStorage) -> Result<[SharedLease], LeaseRefusal> {
        var found: [SharedLease] = []
        for id in write.leases.sorted() {
            guard let lease = store.liveLease(id) else { return .failure(.notFound(id)) }
            if let refusal = LeaseRefusal.naming(id, owner: lease.owner, by: write.context.peer) { return .failure(refusal) }
            found.append(lease)
        }
        return .success(found)
    }
}
