// ObsCluster — obsd's repositories in an etcd cluster, shared by every daemon that names the
// same cluster and prefix (several hosts, issue 14).
//
// This module owns everything obsd keeps in etcd and how it gets there: the key layout and
// encodings (KeyLayout.swift), start-up (ClusterLoader.swift), the one watch over the prefix
// that delivers every daemon's revisions, lease attachments and lease ends in order (this
// file), commits with group commit, retries and the settling of unknown outcomes, and
// linearizable reads (ClusterCommit.swift), leases (ClusterLeases.swift, LeaseMirror.swift)
// and this daemon's liveness lease (ClusterLiveness.swift). It implements ObsStore's
// `SharedStorage`; the daemon (ObsServer) never sees etcd.
//
// Revisions are decided by etcd: a commit is one txn that compares the repository's counter
// key's mod_revision with the one this daemon's state is at, and puts the counter, the
// values, one change-log record per revision and the tombstones of its deletions. The
// daemon's state moves only when the watch delivers a revision — its own writes included —
// so every daemon applies the same revisions in the same order, each exactly once; its
// tombstones in memory follow from the revisions it installs (the tomb keys the watch shows
// are not delivered: they are read only at start-up, by a daemon that installed none of the
// deletions they record). Of the tombstones, the watch keeps only each repository's floor key,
// which a commit needs.

import Logging
import ObsEtcd
import ObsStore
import ObsValues
import Synchronization

/// Repositories kept in etcd. Share one per daemon.
public final class ClusterStorage: SharedStorage {
    /// What the storage needs to know.
    public struct Configuration: Sendable {
        /// The members' client URLs (`http://HOST:PORT`).
        public var endpoints: [String]
        /// Every key obsd writes lies under it.
        public var prefix: String
        /// Change-log records kept in etcd per repository (at least 1), and loaded at start-up.
        public var historyLimit: Int
        /// The deadline of one etcd request of a commit (a write that passes it has an
        /// unknown outcome, which the storage then settles).
        public var requestTimeout: Duration = .seconds(3)
        /// How long settling an unknown outcome may run past the commit's deadline.
        public var settleGrace: Duration = .seconds(1)
        /// How long a read waits for the cluster to confirm the daemon's state is current
        /// before it is answered from that state anyway.
        public var readTimeout: Duration = .seconds(1)
        /// etcd's `--max-txn-ops` (default 128): the most operations of one txn.
        public var maxTxnOps = 128
        /// The most bytes of keys and values one txn of several revisions may carry (etcd's
        /// `--max-request-bytes` is 1.5 MiB by default).
        public var maxGroupBytes = 1 << 20
        /// The TTL of this daemon's liveness lease (at least etcd's minimum, 2 s by default):
        /// the leases it grants bound to its connections end this long after it dies or
        /// loses etcd, at most (plus etcd's half-second expiry check and a commit).
        public var livenessTTL: Duration = .seconds(5)

        /// A configuration with the default timeouts.
        public init(endpoints: [String], prefix: String, historyLimit: Int) {
            self.endpoints = endpoints
            self.prefix = prefix
            self.historyLimit = historyLimit
        }
    }

    public let configuration: Configuration
    let client: EtcdClient
    let layout: KeyLayout
    let logger: Logger
    let tracker = DeliveryTracker()
    let health = Health()
    /// Commits (txns that wrote), revisions committed, and commits that failed.
    public let counters: StorageCounters? = StorageCounters()
    let leases = LeaseMirror()
    let liveness: Liveness
    /// Names this daemon (in its lease records), new at every start.
    let daemonID = String(Epoch.random().prefix(16))
    private let snapshot = Mutex<ClusterSnapshot?>(nil)
    /// Each repository's tombstone floor key as the watch delivered it last (absent: none).
    let tombFloors = Mutex<[String: TombFloor]>([:])
    private let unloaded = Mutex<[LoadedRepository]?>(nil)
    /// The watch and the liveness keeper.
    let tasks = Mutex<[Task<Void, Never>]>([])
    /// Leases that ended while no daemon watched, found at start-up: told once the sink is there.
    private let endedBeforeStart = Mutex<[(lease: SharedLease, reason: LeaseEnd.Reason)]>([])

    /// A storage on the cluster at `configuration.endpoints`; nothing is contacted until
    /// `connect`. Throws `EtcdError.invalidConfiguration` for an endpoint that is not
    /// `http://HOST:PORT`.
    public init(configuration: Configuration, logger: Logger) throws {
        self.configuration = configuration
        var etcd = try EtcdClient.Configuration(endpoints: configuration.endpoints)
        etcd.requestTimeout = configuration.requestTimeout
        self.client = try EtcdClient(configuration: etcd)
        self.layout = KeyLayout(prefix: configuration.prefix)
        self.logger = logger
        self.liveness = Liveness(ttl: configuration.livenessTTL, client: client, logger: logger)
    }

    // MARK: Storage

    public var isImmediate: Bool { true }

    public var summary: String {
        "etcd \(configuration.endpoints.joined(separator: ",")), prefix \(configuration.prefix)"
    }

    public func load() throws(StorageError) -> [LoadedRepository] {
        unloaded.withLock { loaded in
            defer { loaded = nil }
            return loaded ?? []
        }
    }

    public var notices: [String] {
        guard let s = snapshot.withLock({ $0 }) else { return [] }
        return s.createdEpoch ? ["the etcd prefix \(configuration.prefix) held no obsd data: new epoch \(s.epoch)"] : []
    }

    /// Never used: shared storage commits through `commit`.
    public func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool { false }

    public func discard(_ listener: any DurabilityListener, after sequence: UInt64) {}

    public func close() {
        tasks.withLock { tasks in
            for task in tasks { task.cancel() }
            tasks = []
        }
        let client = self.client
        Task { await client.shutdown() }
    }

    // MARK: Start-up

    public var epoch: String { snapshot.withLock { $0?.epoch ?? "" } }

    public func connect() async throws {
        let started = ContinuousClock.now
        var lastLog: ContinuousClock.Instant? = nil
        var backoff: Duration = .milliseconds(100)
        while true {
            try Task.checkCancellation()
            do {
                let loaded = try await ClusterLoader.load(
                    client: client, layout: layout, historyLimit: max(1, configuration.historyLimit), timeout: configuration.requestTimeout)
                tombFloors.withLock { $0 = loaded.tombFloors }
                tracker.seed(loaded.positions.merging([DeliveryTracker.leases: DeliveryTracker.Entry(position: loaded.revision)]) { $1 })
                let ended = leases.reconcile(
                    records: loaded.leases.records, alive: loaded.leases.alive, counter: loaded.leases.counter, at: loaded.revision)
                endedBeforeStart.withLock { $0 = ended }
                snapshot.withLock { $0 = loaded }
                unloaded.withLock { $0 = loaded.repositories }
                if lastLog != nil { logger.notice("reached the etcd cluster after \(ContinuousClock.now - started)") }
                return
            } catch let malformed as Malformed {
                throw StorageError(.corrupt, "etcd prefix \(configuration.prefix) holds data obsd cannot read: \(malformed); refusing to start")
            } catch {
                if Task.isCancelled { throw CancellationError() }
                if lastLog.map({ ContinuousClock.now - $0 >= .seconds(10) }) ?? true {
                    lastLog = .now
                    logger.warning(
                        "waiting for the etcd cluster (\(configuration.endpoints.joined(separator: ","))) before serving: \(error)")
                }
                try await Task.sleep(for: backoff)
                backoff = min(backoff * 2, .seconds(2))
            }
        }
    }

    public func start(delivering sink: any SharedStorageSink) {
        let loaded = snapshot.withLock { $0 }
        for (repo, attachments) in (loaded?.attachments ?? [:]).sorted(by: { $0.key < $1.key }) {
            sink.deliver(repo: repo, revisions: [], attachments: attachments, replacing: true)
        }
        for (lease, reason) in endedBeforeStart.withLock({ $0 }) { sink.leaseEnded(lease, reason: reason) }
        endedBeforeStart.withLock { $0 = [] }
        let from = (loaded?.revision ?? 0) + 1
        let watch = Task { await self.watch(from: from, sink: sink) }
        let keeper = Task { await self.liveness.run { [weak sink, leases] lease in sink?.leasesLost(leases.drop(keptBy: lease)) } }
        tasks.withLock { $0 = [watch, keeper] }
    }

    // MARK: The watch

    /// Why the watch cannot go on: the daemon's history and etcd's no longer agree.
    struct HistoryLost: Error {
        let reason: String
    }

    /// Delivers every revision under the prefix from `start`, in order, until cancelled.
    private func watch(from start: Int64, sink: any SharedStorageSink) async {
        var next = start
        while !Task.isCancelled {
            do {
                for try await response in client.watch(layout.prefix, rangeEnd: EtcdKey.prefixEnd(layout.prefix), startRevision: next, prevKV: false)
                where !response.isProgress {
                    try deliver(response, to: sink)
                    next = response.revision + 1
                    health.succeeded()
                }
            } catch EtcdError.compacted(let compactRevision) {
                // The watch fell behind an etcd compaction (it resumes from its last event,
                // which a quiet prefix leaves far back): catch up from the change log.
                logger.notice("the etcd watch resumed behind a compaction (at \(compactRevision.map(String.init) ?? "?")); catching up from the change log")
                do {
                    next = try await resync(sink)
                } catch let lost as HistoryLost {
                    return sink.historyLost(lost.reason)
                } catch {
                    if Task.isCancelled { return }
                    logger.warning("catching up with etcd failed, retrying: \(error)")
                    try? await Task.sleep(for: .milliseconds(500))
                }
            } catch let lost as HistoryLost {
                return sink.historyLost(lost.reason)
            } catch let malformed as Malformed {
                return sink.historyLost("a key under etcd prefix \(configuration.prefix) is not obsd's: \(malformed)")
            } catch {
                if Task.isCancelled { return }
                logger.warning("the etcd watch ended (\(error)); reopening it from revision \(next)")
                try? await Task.sleep(for: .milliseconds(500))
            }
        }
    }

    /// What one etcd revision brings one repository.
    private struct Found {
        var revisions: [SharedRevision] = []
        var counter: DeliveryTracker.Entry?
        var attachments: [SharedAttachment] = []
    }

    /// Hands one etcd revision to `sink`: new leases first, then each repository's revisions
    /// and attachments, then the leases that ended there.
    private func deliver(_ response: EtcdWatchResponse, to sink: any SharedStorageSink) throws {
        var order: [String] = []
        var found: [String: Found] = [:]
        var events = LeaseMirror.Events()
        func note(_ repo: String) { if found[repo] == nil { order.append(repo) } }
        for event in response.events {
            let kv = event.kv
            switch layout.classify(kv.key) {
            case .epoch:
                if event.kind == .delete || String(decoding: kv.value, as: UTF8.self) != epoch {
                    throw HistoryLost(reason: "the epoch under etcd prefix \(configuration.prefix) was deleted or replaced (the prefix was wiped or restored)")
                }
            case .counter(let repo):
                guard event.kind == .put, let revision = Codec.counter(from: kv.value) else {
                    throw HistoryLost(reason: "the revision counter of repository \(repo) was deleted or overwritten in etcd (the prefix was wiped?)")
                }
                note(repo)
                found[repo, default: Found()].counter = DeliveryTracker.Entry(revision: revision, position: kv.modRevision)
            case .log(let repo) where event.kind == .put:
                note(repo)
                found[repo, default: Found()].revisions.append(try Codec.log(from: kv.value, repo: repo))
            case .data(let repo):
                guard let key = layout.key(ofDataKey: kv.key, repo: repo) else { continue }
                note(repo)
                found[repo, default: Found()].attachments.append(
                    SharedAttachment(key: key, lease: event.kind == .put ? Codec.lease(ofData: kv.value) : nil))
            case .tombFloor(let repo):
                // Before the tracker moves past this revision: a commit on it reads the floor.
                let floor = event.kind == .put ? Codec.tombFloor(from: kv.value) : nil
                tombFloors.withLock { $0[repo] = floor }
            case .leaseCounter where event.kind == .put:
                events.counter = (Codec.counter(from: kv.value) ?? 0, kv.modRevision)
            case .lease(let id):
                if event.kind == .put { events.records.append(try Codec.lease(from: kv.value)) } else { events.recordsGone.append(id) }
            case .alive(let id):
                if event.kind == .put {
                    events.alive.append((id, LeaseMirror.Alive(etcdLease: kv.lease, created: kv.createRevision)))
                } else {
                    events.aliveGone.append(id)
                }
            case .log, .leaseCounter, .tomb, .other:
                continue
            }
        }
        leases.applyPuts(events)
        for repo in order {
            let f = found[repo]!
            try deliver(f.revisions, of: repo, counter: f.counter, attachments: f.attachments, replacing: false, to: sink)
        }
        for (lease, reason) in leases.applyEnds(events, at: response.revision) { sink.leaseEnded(lease, reason: reason) }
        tracker.advance(DeliveryTracker.leases, to: DeliveryTracker.Entry(position: response.revision))
    }

    /// Delivers the revisions of `repo` after the ones delivered so far, checking that they
    /// continue them, and the attachments its counter's move brought; moves the tracker to
    /// the counter.
    private func deliver(
        _ revisions: [SharedRevision], of repo: String, counter: DeliveryTracker.Entry?, attachments: [SharedAttachment], replacing: Bool,
        to sink: any SharedStorageSink
    ) throws {
        let current = tracker.entry(repo)
        let fresh = revisions.filter { $0.record.revision > current.revision }.sorted { $0.record.revision < $1.record.revision }
        for (i, revision) in fresh.enumerated() where revision.record.revision != current.revision + 1 + UInt64(i) {
            throw HistoryLost(
                reason: "repository \(repo) in etcd went from revision \(current.revision) to \(revision.record.revision) without the revisions between")
        }
        let last = fresh.last?.record.revision ?? current.revision
        if let counter, counter.revision < last {
            throw HistoryLost(reason: "the revision counter of repository \(repo) in etcd went back to \(counter.revision)")
        }
        // Attachments written with a counter this daemon has not passed yet (every commit
        // moves the counter), or all of them (replacing).
        let moved = replacing || (counter.map { $0.position > current.position } ?? false)
        if !fresh.isEmpty || (moved && !attachments.isEmpty) || replacing {
            sink.deliver(repo: repo, revisions: fresh, attachments: moved ? attachments : [], replacing: replacing)
        }
        let entry = DeliveryTracker.Entry(revision: last, position: counter?.position ?? current.position)
        tracker.advance(repo, to: entry, writeIDs: fresh.compactMap(\.writeID))
    }

    /// After a compaction the watch could not resume from: delivers what the change log holds
    /// beyond what was delivered, and returns the revision to watch from.
    private func resync(_ sink: any SharedStorageSink) async throws -> Int64 {
        let timeout = configuration.requestTimeout
        let counters = try await client.range(layout.counterPrefix, rangeEnd: EtcdKey.prefixEnd(layout.counterPrefix), timeout: timeout)
        let at = counters.revision
        let epochNow = try await client.range(layout.epochKey, revision: at, timeout: timeout)
        guard epochNow.kvs.first.map({ String(decoding: $0.value, as: UTF8.self) }) == epoch else {
            throw HistoryLost(reason: "the epoch under etcd prefix \(configuration.prefix) was deleted or replaced (the prefix was wiped or restored)")
        }
        // Attachments and leases may have moved in the gap too: read them whole.
        let data = try await client.range(layout.dataPrefix, rangeEnd: EtcdKey.prefixEnd(layout.dataPrefix), revision: at, timeout: timeout)
        let attachments = ClusterLoader.attachments(in: data, layout: layout)
        let leaseState = try await ClusterLoader.leases(client: client, layout: layout, at: at, timeout: timeout)
        // The tombstone floors too (the tombstones in memory come from the revisions delivered).
        let floors = try await ClusterLoader.tombFloors(client: client, layout: layout, at: at, timeout: timeout)
        tombFloors.withLock { $0 = floors }
        var present = Set<String>()
        for kv in counters.kvs {
            guard case .counter(let repo) = layout.classify(kv.key), let revision = Codec.counter(from: kv.value) else { continue }
            present.insert(repo)
            let current = tracker.entry(repo)
            var revisions: [SharedRevision] = []
            if revision > current.revision {
                let log = try await client.range(
                    layout.logKey(repo, current.revision + 1), rangeEnd: EtcdKey.prefixEnd(layout.logPrefix(repo)), revision: at,
                    timeout: timeout)
                revisions = try log.kvs.map { kv throws(Malformed) in try Codec.log(from: kv.value, repo: repo) }.filter { $0.record.revision <= revision }
                guard revisions.first?.record.revision == current.revision + 1, revisions.count == Int(revision - current.revision) else {
                    throw HistoryLost(
                        reason: "this daemon missed revisions \(current.revision + 1)–\(revision) of repository \(repo) while cut off, and etcd's change log no longer holds them all (history.limit)")
                }
            }
            try deliver(
                revisions, of: repo, counter: DeliveryTracker.Entry(revision: revision, position: kv.modRevision),
                attachments: attachments[repo] ?? [], replacing: true, to: sink)
        }
        for (repo, entry) in tracker.all where entry.revision > 0 && !present.contains(repo) {
            throw HistoryLost(reason: "repository \(repo) disappeared from etcd (the prefix was wiped?)")
        }
        let ended = leases.reconcile(records: leaseState.records, alive: leaseState.alive, counter: leaseState.counter, at: at)
        for (lease, reason) in ended { sink.leaseEnded(lease, reason: reason) }
        tracker.advance(DeliveryTracker.leases, to: DeliveryTracker.Entry(position: at))
        return at + 1
    }
}
