// ObsCluster — commits and reads.
//
// A commit is one txn: compare the counter's mod_revision with the position the group was
// planned at (`SharedCommit.basisPosition`: a move of attachments since changes no revision,
// only the position) — and, for a repository's first revision, the epoch; for each lease the
// group's writes name, the create revision of its alive key (the lease is still that one) — then
// put the counter, the final value and lease attachment of every key the group changed or
// re-attached, one log record per revision, and trim the log to `historyLimit`. In the same
// txn, the tombstones: a tomb key for each key the group leaves deleted, none any more for
// each it re-creates, the floor key (raised, and the tomb keys at or below it deleted, where
// the deletions take the repository past its bound) — so etcd's tombstones always match its
// data, whatever becomes of the log. A group that only moves attachments puts the counter
// unchanged (its position moves, its revision does not). The failure branch reads the
// counter and the leases' alive keys, to catch up — or find a lease ended — before planning
// again. A commit is acknowledged once the watch has delivered it, so the writer's next read
// on this daemon sees it.
//
// What etcd could not answer:
// - not applied, and transient (no leader, every member unreachable): retried with a backoff
//   until the deadline, then `unavailable` ("no quorum");
// - outcome unknown (a timeout, a connection lost mid-request): settled. The watch may
//   already have shown the write id; otherwise a *fence* txn — compare the counter's
//   mod_revision with the commit's, put the counter unchanged — makes the commit impossible
//   from then on if it is not in yet; if the fence's compare fails, the log record of the
//   next revision says whose write won. Only if even the fence cannot get through before
//   the deadline plus `settleGrace` is the answer "outcome unknown".
//
// A read first asks etcd for the counter (linearizable) and waits until the watch has
// delivered up to it; when etcd cannot answer within `readTimeout`, the read is answered from
// the daemon's state, and for a second after a failure reads do not ask etcd at all.

import ObsEtcd
import ObsStore
import ObservableKit
import Synchronization

/// Whether to ask the cluster at all: not for a second after it failed to answer.
final class Health: Sendable {
    private let until = Mutex<ContinuousClock.Instant?>(nil)

    var shouldAsk: Bool { until.withLock { $0.map { ContinuousClock.now >= $0 } ?? true } }

    func failed() { until.withLock { $0 = .now + .seconds(1) } }

    func succeeded() { until.withLock { $0 = nil } }
}

extension ClusterStorage {
    public func deliveredPosition(of repo: String) -> Int64? { tracker.entry(repo).position }

    public func commit(_ group: SharedCommit) async -> SharedCommitOutcome {
        let counters = self.counters!
        // The position of the basis: the tracker moves only after the sink installed, so a
        // basis ahead of it is about to be there.
        var entry = tracker.entry(group.repo)
        if entry.revision < group.basisRevision {
            _ = await tracker.wait(group.repo, revision: group.basisRevision, timeout: .seconds(2))
            entry = tracker.entry(group.repo)
        }
        guard entry.revision == group.basisRevision else { return .stale }
        // The position the group was planned at, where it says (a move of attachments since,
        // which changes no revision, then fails the compare: the group is planned again).
        let position = min(group.basisPosition ?? entry.position, entry.position)
        if !group.writes && group.leases.isEmpty { return await check(group, position: position) }

        let (compare, success, failure) = transaction(for: group, position: position)
        tracker.expect(group.writeID)
        defer { tracker.forget(group.writeID) }
        var backoff: Duration = .milliseconds(50)
        var lastCause = "no attempt"
        while true {
            let remaining = ContinuousClock.now.duration(to: group.deadline)
            guard remaining > .zero else {
                counters.failures.add(1, ordering: .relaxed)
                health.failed()
                return .failed(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot commit writes now (\(lastCause)); nothing was applied"))
            }
            do {
                let result = try await client.txn(
                    compare: compare, success: success, failure: failure, timeout: min(remaining, configuration.requestTimeout))
                health.succeeded()
                if result.succeeded {
                    guard group.writes else { return .current }  // the leases named are live, the basis current
                    counters.commits.add(1, ordering: .relaxed)
                    counters.records.add(group.records.count, ordering: .relaxed)
                    await awaitDelivery(group.repo, position: result.revision, deadline: group.deadline)
                    return .committed
                }
                let ended = endedLeases(group, failure: result.responses)
                guard ended.isEmpty else {
                    leases.drop(ended)
                    if case .range(let counter)? = result.responses.first, let now = counter.kvs.first?.modRevision, now > position {
                        await awaitDelivery(group.repo, position: now, deadline: group.deadline)
                    }
                    return .leaseEnded(ended)
                }
                return await catchUp(group, position: position, failure: result.responses)
            } catch let error as EtcdError {
                if error.isOutcomeUnknown { return await settle(group, position: position, cause: error) }
                if case .server(_, let message) = error, message.contains("too large") || message.contains("too many operations") {
                    counters.failures.add(1, ordering: .relaxed)
                    return .failed(SharedFailure(.tooLarge, "etcd refuses this write: \(message) (etcd's --max-request-bytes and --max-txn-ops); nothing was applied"))
                }
                guard error.isTransient else {
                    counters.failures.add(1, ordering: .relaxed)
                    return .failed(SharedFailure(.refused, "etcd refused the write: \(error); nothing was applied"))
                }
                lastCause = error.description
                health.failed()
                try? await Task.sleep(for: min(backoff, remaining))
                backoff = min(backoff * 2, .milliseconds(500))
            } catch {
                return .failed(SharedFailure(.refused, "\(error)"))
            }
        }
    }

    /// The txn of a group: compares, puts, and the failure branch's reads.
    func transaction(for group: SharedCommit, position: Int64) -> (compare: [EtcdCompare], success: [EtcdOp], failure: [EtcdOp]) {
        let repo = group.repo
        let counterKey = layout.counterKey(repo)
        var compare: [EtcdCompare] = [.modRevision(counterKey, .equal, position)]
        if group.basisRevision == 0 { compare.append(.value(layout.epochKey, .equal, Array(epoch.utf8))) }
        compare += group.leases.map { .createRevision(layout.aliveKey($0.id), .equal, $0.generation) }
        var failure: [EtcdOp] = [.range(EtcdRangeRequest(key: counterKey)), .range(EtcdRangeRequest(key: layout.epochKey))]
        failure += group.leases.map { .range(EtcdRangeRequest(key: layout.aliveKey($0.id))) }
        guard group.writes else { return (compare, [], failure) }
        let last = group.records.last?.revision ?? group.basisRevision
        var success: [EtcdOp] = [.put(key: counterKey, value: Codec.counter(last))]
        // Each key's final state after the group, in the order keys first changed; and the
        // revision it is left deleted at (nil: it exists).
        var order: [[UInt8]] = []
        var final: [[UInt8]: EtcdOp] = [:]
        var changedKeys: [Key] = []
        var deletedAt: [Key: UInt64?] = [:]
        for record in group.records {
            for change in record.changes {
                let key = layout.dataKey(repo, change.key)
                if final[key] == nil { order.append(key) }
                final[key] =
                    change.new.map { .put(key: key, value: Codec.data(revision: record.revision, value: $0, lease: group.attachments[change.key])) }
                    ?? .deleteRange(key: key)
                if deletedAt.updateValue(change.new == nil ? record.revision : nil, forKey: change.key) == nil { changedKeys.append(change.key) }
            }
        }
        for moved in group.reattached {
            let key = layout.dataKey(repo, moved.key)
            guard final[key] == nil else { continue }
            order.append(key)
            final[key] = .put(key: key, value: Codec.data(revision: moved.entry.revision, value: moved.entry.value, lease: moved.lease))
        }
        success += order.compactMap { final[$0] }
        for record in group.records {
            success.append(
                .put(key: layout.logKey(repo, record.revision), value: Codec.log(record, writeID: group.writeID, lease: group.leaseEnds[record.revision])))
        }
        // The trim stops before the group's own records, which the watch delivers (etcd refuses
        // a txn that puts a key one of its deletions covers): a group of more revisions than
        // the limit leaves a few more in the log, until the next commit trims them.
        let keep = UInt64(max(1, configuration.historyLimit))
        if let first = group.records.first?.revision, last > keep, min(last - keep + 1, first) > 1 {
            success.append(.deleteRange(key: layout.logPrefix(repo), rangeEnd: layout.logKey(repo, min(last - keep + 1, first))))
        }
        if !group.records.isEmpty {
            success += tombstoneOperations(group, changedKeys: changedKeys, deletedAt: deletedAt, last: last)
        }
        return (compare, success, failure)
    }

    /// The tombstones of a group of revisions: etcd's become what every daemon's install of
    /// the group makes of its own. Above the floor, a tomb key per key the group leaves
    /// deleted, none for a key it re-creates; the floor raised to the group's (the oldest
    /// forgotten) — or to the basis where etcd's tombstones do not reach it (a daemon that
    /// keeps none committed since, or the repository is older than them) — with every tomb
    /// key at or below it deleted; never lowered (another daemon may remember fewer).
    private func tombstoneOperations(_ group: SharedCommit, changedKeys: [Key], deletedAt: [Key: UInt64?], last: UInt64) -> [EtcdOp] {
        let repo = group.repo
        let known = tombFloors.withLock { $0[repo] }
        var floor = max(group.tombstoneFloor, known?.floor ?? 0)
        if (known?.through ?? 0) != group.basisRevision { floor = max(floor, group.basisRevision) }
        var operations: [EtcdOp] = []
        if floor > (known?.floor ?? 0) {
            operations.append(.deleteRange(key: layout.tombPrefix(repo), rangeEnd: layout.tombPrefix(repo, revision: floor + 1)))
        }
        for (key, revision) in group.tombstonesRemoved.sorted(by: { $0.key < $1.key }) where revision > floor {
            operations.append(.deleteRange(key: layout.tombKey(repo, revision, key)))
        }
        for key in changedKeys {
            if case .some(.some(let revision)) = deletedAt[key], revision > floor { operations.append(.put(key: layout.tombKey(repo, revision, key), value: [])) }
        }
        operations.append(.put(key: layout.tombFloorKey(repo), value: Codec.tombFloor(TombFloor(floor: floor, through: last))))
        return operations
    }

    /// The leases of `group` whose alive key the failed txn's reads found gone or replaced.
    private func endedLeases(_ group: SharedCommit, failure: [EtcdOpResult]) -> Set<UInt64> {
        var ended = Set<UInt64>()
        for (i, lease) in group.leases.enumerated() where failure.count > 2 + i {
            guard case .range(let alive) = failure[2 + i] else { continue }
            if alive.kvs.first?.createRevision != lease.generation { ended.insert(lease.id) }
        }
        return ended
    }

    /// The compare failed: waits for the watch to deliver what beat the group.
    private func catchUp(_ group: SharedCommit, position: Int64, failure: [EtcdOpResult]) async -> SharedCommitOutcome {
        guard failure.count >= 2, case .range(let counter) = failure[0], case .range(let epochNow) = failure[1] else {
            return .failed(SharedFailure(.refused, "etcd answered a failed commit without its reads"))
        }
        if epochNow.kvs.first.map({ String(decoding: $0.value, as: UTF8.self) }) != epoch {
            return .failed(SharedFailure(.refused, "the epoch under etcd prefix \(configuration.prefix) changed (the prefix was wiped?); nothing was applied"))
        }
        let now = counter.kvs.first?.modRevision ?? 0
        guard now > position else {
            return .failed(SharedFailure(.refused, "the revision counter of repository \(group.repo) went back in etcd (the prefix was wiped?); nothing was applied"))
        }
        await awaitDelivery(group.repo, position: now, deadline: group.deadline)
        return .stale
    }

    /// Whether the basis is current, by a linearizable read of the counter.
    private func check(_ group: SharedCommit, position: Int64) async -> SharedCommitOutcome {
        var backoff: Duration = .milliseconds(50)
        var lastCause = "no attempt"
        while true {
            let remaining = ContinuousClock.now.duration(to: group.deadline)
            guard remaining > .zero else {
                return .failed(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot confirm the repository's state now (\(lastCause))"))
            }
            do {
                let found = try await client.range(layout.counterKey(group.repo), timeout: min(remaining, configuration.requestTimeout))
                health.succeeded()
                let now = found.kvs.first?.modRevision ?? 0
                if now == position { return .current }
                await awaitDelivery(group.repo, position: now, deadline: group.deadline)
                return .stale
            } catch {
                lastCause = "\(error)"
                health.failed()
                try? await Task.sleep(for: min(backoff, remaining))
                backoff = min(backoff * 2, .milliseconds(500))
            }
        }
    }

    /// Settles a commit etcd did not answer: applied (`committed`), never to be applied
    /// (`stale`: plan again), or unknown.
    private func settle(_ group: SharedCommit, position: Int64, cause: EtcdError) async -> SharedCommitOutcome {
        let counters = self.counters!
        let repo = group.repo
        let counterKey = layout.counterKey(repo)
        let next = layout.logKey(repo, group.basisRevision + 1)
        let deadline = group.deadline + configuration.settleGrace
        var backoff: Duration = .milliseconds(50)
        logger.notice("settling a commit to repository \(repo) whose outcome etcd did not report (\(cause))")
        while true {
            if tracker.hasSeen(group.writeID) {
                counters.commits.add(1, ordering: .relaxed)
                counters.records.add(group.records.count, ordering: .relaxed)
                return .committed
            }
            let remaining = ContinuousClock.now.duration(to: deadline)
            guard remaining > .zero else { break }
            do {
                let fence = try await client.txn(
                    compare: [.modRevision(counterKey, .equal, position)],
                    success: [.put(key: counterKey, value: Codec.counter(group.basisRevision))],
                    failure: [.range(EtcdRangeRequest(key: counterKey)), .range(EtcdRangeRequest(key: next))],
                    timeout: min(remaining, configuration.requestTimeout))
                health.succeeded()
                if fence.succeeded {
                    // The commit can never apply now: plan again once the fence is delivered.
                    await awaitDelivery(repo, position: fence.revision, deadline: deadline)
                    return .stale
                }
                guard fence.responses.count == 2, case .range(let counter) = fence.responses[0], case .range(let record) = fence.responses[1]
                else { break }
                // The counter moved: whoever won, this commit can never apply from now on.
                // The next revision's record names the winner — unless the log was trimmed
                // meanwhile, and then the watch, once it has delivered that far, knows.
                let now = counter.kvs.first?.modRevision ?? 0
                let winner = try record.kvs.first.map { try Codec.log(from: $0.value, repo: repo).writeID }
                let delivered = await awaitDelivery(repo, position: now, deadline: deadline)
                if winner == group.writeID || tracker.hasSeen(group.writeID) {
                    counters.commits.add(1, ordering: .relaxed)
                    counters.records.add(group.records.count, ordering: .relaxed)
                    return .committed
                }
                if winner == nil && !delivered { break }
                return .stale
            } catch {
                health.failed()
                try? await Task.sleep(for: min(backoff, remaining))
                backoff = min(backoff * 2, .milliseconds(500))
            }
        }
        counters.failures.add(1, ordering: .relaxed)
        return .failed(
            SharedFailure(
                .outcomeUnknown,
                "outcome unknown: the etcd cluster did not answer (\(cause)) and the write could not be settled; it may still be applied — every daemon would then show it — so read before retrying"
            ))
    }

    /// Waits for the watch to deliver `repo` up to `position` (a little past the deadline at
    /// most: the commit is in etcd, and the reply should not wait on a broken watch forever).
    @discardableResult
    private func awaitDelivery(_ repo: String, position: Int64, deadline: ContinuousClock.Instant) async -> Bool {
        let wait = max(ContinuousClock.now.duration(to: deadline), .zero) + .seconds(2)
        if await tracker.wait(repo, position: position, timeout: wait) { return true }
        logger.warning("the etcd watch has not delivered repository \(repo) up to etcd revision \(position) yet; answering anyway")
        return false
    }

    /// Why `records` cannot be one commit, if they cannot: more operations than one txn may
    /// hold (`maxTxnOps`), or — for more than one record — more than `maxGroupBytes` of keys
    /// and values (a single record is left to etcd's own request size limit).
    public func limitExceeded(by records: [RevisionRecord]) -> String? { limitExceeded(by: records, extraOperations: 0) }

    public func limitExceeded(by records: [RevisionRecord], extraOperations: Int) -> String? {
        var keys = Set<Key>()
        var deleted = Set<Key>()
        var bytes = 0
        for record in records {
            for change in record.changes {
                keys.insert(change.key)
                if change.new == nil { deleted.insert(change.key) }
            }
            bytes += 2 * record.byteSize
        }
        // The counter, the log's trim, the tombstone floor and the range of forgotten
        // tombstones; a value per key, a tombstone per deleted key, a record per revision.
        let operations = 4 + keys.count + deleted.count + records.count + extraOperations
        if operations > configuration.maxTxnOps {
            return records.count == 1
                ? "in etcd mode one revision may change at most \(configuration.maxTxnOps - 5) keys, a deleted key counting twice (its tombstone) (etcd's --max-txn-ops is \(configuration.maxTxnOps)); this one changes \(keys.count), deleting \(deleted.count): split the batch"
                : "the group needs \(operations) operations of one txn"
        }
        if records.count > 1 && bytes > configuration.maxGroupBytes { return "the group carries \(bytes) bytes" }
        return nil
    }

    // MARK: Reads

    public func linearize(_ scope: SharedScope) async -> Bool {
        guard health.shouldAsk else { return false }
        let deadline = ContinuousClock.now + configuration.readTimeout
        do {
            let targets: [(String, Int64)]
            switch scope {
            case .repository(let repo):
                let found = try await client.range(layout.counterKey(repo), timeout: configuration.readTimeout)
                targets = [(repo, found.kvs.first?.modRevision ?? 0)]
            case .all:
                let found = try await client.range(
                    EtcdRangeRequest(key: layout.counterPrefix, rangeEnd: EtcdKey.prefixEnd(layout.counterPrefix), keysOnly: true),
                    timeout: configuration.readTimeout)
                targets = found.kvs.compactMap { kv in
                    if case .counter(let repo) = layout.classify(kv.key) { return (repo, kv.modRevision) }
                    return nil
                }
            }
            health.succeeded()
            for (repo, position) in targets {
                let wait = max(ContinuousClock.now.duration(to: deadline), .milliseconds(1))
                guard await tracker.wait(repo, position: position, timeout: wait) else { return false }
            }
            return true
        } catch {
            health.failed()
            return false
        }
    }
}
