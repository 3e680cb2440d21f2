// ObsCluster — obsd's repositories in an etcd cluster, shared by every daemon that names the
// same cluster and prefix (several hosts, issue 14).
//
// This module owns everything obsd keeps in etcd and how it gets there: the key layout and
// encodings (KeyLayout.swift), start-up (ClusterLoader.swift), the one watch over the prefix
// that delivers every daemon's revisions in order (this file), commits with group commit,
// retries and the settling of unknown outcomes, and linearizable reads (ClusterCommit.swift).
// It implements ObsStore's `SharedStorage`; the daemon (ObsServer) never sees etcd.
//
// Revisions are decided by etcd: a commit is one txn that compares the repository's counter
// key's mod_revision with the one this daemon's state is at, and puts the counter, the
// values and one change-log record per revision. The daemon's state moves only when the
// watch delivers a revision — its own writes included — so every daemon applies the same
// revisions in the same order, each exactly once.

import Logging
import ObsEtcd
import ObsStore
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
    private let snapshot = Mutex<ClusterSnapshot?>(nil)
    private let unloaded = Mutex<[LoadedRepository]?>(nil)
    private let watchTask = Mutex<Task<Void, Never>?>(nil)

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
    public func append(_ record: RevisionRecord, listener: any DurabilityListener) -> Bool { false }

    public func discard(_ listener: any DurabilityListener, after revision: UInt64) {}

    public func close() {
        watchTask.withLock { task in
            task?.cancel()
            task = nil
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
                tracker.seed(loaded.positions)
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
        let from = (snapshot.withLock { $0?.revision } ?? 0) + 1
        let task = Task { await self.watch(from: from, sink: sink) }
        watchTask.withLock { $0 = task }
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

    /// Hands the revisions of one etcd revision to `sink`, by repository.
    private func deliver(_ response: EtcdWatchResponse, to sink: any SharedStorageSink) throws {
        var order: [String] = []
        var found: [String: (revisions: [SharedRevision], counter: DeliveryTracker.Entry?)] = [:]
        for event in response.events {
            switch layout.classify(event.kv.key) {
            case .epoch:
                if event.kind == .delete || String(decoding: event.kv.value, as: UTF8.self) != epoch {
                    throw HistoryLost(reason: "the epoch under etcd prefix \(configuration.prefix) was deleted or replaced (the prefix was wiped or restored)")
                }
            case .counter(let repo):
                guard event.kind == .put, let revision = Codec.counter(from: event.kv.value) else {
                    throw HistoryLost(reason: "the revision counter of repository \(repo) was deleted or overwritten in etcd (the prefix was wiped?)")
                }
                if found[repo] == nil { order.append(repo) }
                found[repo, default: ([], nil)].counter = DeliveryTracker.Entry(revision: revision, position: event.kv.modRevision)
            case .log(let repo) where event.kind == .put:
                if found[repo] == nil { order.append(repo) }
                found[repo, default: ([], nil)].revisions.append(try Codec.log(from: event.kv.value, repo: repo))
            case .log, .data, .other:
                continue
            }
        }
        for repo in order {
            let (revisions, counter) = found[repo]!
            try deliver(revisions, of: repo, counter: counter, to: sink)
        }
    }

    /// Delivers the revisions of `repo` after the ones delivered so far, checking that they
    /// continue them, and moves the tracker to the counter.
    private func deliver(_ revisions: [SharedRevision], of repo: String, counter: DeliveryTracker.Entry?, to sink: any SharedStorageSink) throws {
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
        if !fresh.isEmpty {
            sink.deliver(repo: repo, revisions: fresh)
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
            try deliver(revisions, of: repo, counter: DeliveryTracker.Entry(revision: revision, position: kv.modRevision), to: sink)
        }
        for (repo, entry) in tracker.all where entry.revision > 0 && !present.contains(repo) {
            throw HistoryLost(reason: "repository \(repo) disappeared from etcd (the prefix was wiped?)")
        }
        return at + 1
    }
}
