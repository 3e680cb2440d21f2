// ObsServer — the daemon's shared state: repositories by name, connected peers, counters,
// and the current limits and access policy.
//
// A repository exists (is listed by `repos`) once a write changed it (revision > 0).
// Reading a repository that does not exist creates nothing. Subscribing to one creates an
// empty, unlisted placeholder so the subscription sees the first write; placeholders are
// dropped again when nobody uses them. A repository that was ever written in this process
// (`isPermanent`, even if storage later undid its first revision) is never dropped, so the
// common path — a write or subscribe to such a repository — takes the hub lock once, for a
// dictionary lookup, and nobody can hold a repository object the hub no longer has.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// The daemon's counters, shown by `stats`.
final class ServerStats: Sendable {
    let connections = Atomic<Int>(0)
    let connectionsTotal = Atomic<Int>(0)
    let connectionsRefused = Atomic<Int>(0)
    let subscriptions = Atomic<Int>(0)
    let overflows = Atomic<Int>(0)
    /// Times a writer's connection was held until a loop's delivery backlog went down.
    let writersHeld = Atomic<Int>(0)
    let errors = Atomic<Int>(0)
    let denied = Atomic<Int>(0)
    /// Repositories with revision > 0.
    let repositories = Atomic<Int>(0)

    /// Counts one more repository if that stays within `limit`; whether it did.
    func reserveRepository(limit: Int) -> Bool { Self.reserve(repositories, limit: limit) }

    /// Counts one more connection if that stays within `limit`; whether it did.
    func reserveConnection(limit: Int) -> Bool { Self.reserve(connections, limit: limit) }

    /// Adds one to `counter` unless it has reached `limit` — in one step, so concurrent
    /// callers cannot pass the limit together.
    private static func reserve(_ counter: borrowing Atomic<Int>, limit: Int) -> Bool {
        var current = counter.load(ordering: .relaxed)
        while current < limit {
            let (exchanged, original) = counter.compareExchange(expected: current, desired: current + 1, ordering: .relaxed)
            if exchanged { return true }
            current = original
        }
        return false
    }
}

/// A connection's live subscriptions, counted on its loop, read by `stats` anywhere.
final class SubscriptionTally: Sendable {
    private let count = Atomic<Int>(0)
    func add(_ n: Int) { count.add(n, ordering: .relaxed) }
    var value: Int { count.load(ordering: .relaxed) }
}

/// A connection as the hub knows it: who, since when, how many subscriptions, and where to
/// run code on its loop.
struct ConnectedPeer: Sendable {
    let peer: Peer
    let since: ContinuousClock.Instant
    let subscriptions: SubscriptionTally
    /// Runs on the connection's event loop: re-checks its subscriptions after a reload.
    let revalidate: @Sendable () -> Void
}

final class Hub: Sendable {
    let stats = ServerStats()
    /// The epoch of every repository this daemon has not stored yet — at revision 0 there
    /// is no history to tell apart — and that repositories created by this process keep.
    /// New at every start, so no other daemon or run hands it out — except with a shared
    /// store, whose epoch every daemon sharing it uses.
    let freshEpoch: String
    let historyLimits: HistoryLimits
    let storage: any Storage
    /// The storage, when other daemons share it (etcd mode): revisions are decided there,
    /// and reads first make sure the state here is current.
    let shared: (any SharedStorage)?
    /// Names this daemon's commit groups (etcd mode).
    let writeIDs = WriteIDs()
    /// Told when a shared store's history no longer matches this daemon's.
    private let onHistoryLost: @Sendable (String) -> Void
    let runtime: Runtime
    let users = UserDatabase()

    private struct Slot {
        let repository: Repository
        /// Operations in progress that may create or register into this repository.
        var users = 0
    }

    private let repositories = Locked<[String: Slot]>([:])
    /// Every event loop's share, by index.
    let shards: [LoopShard]
    private let peers = Locked<[ObjectIdentifier: ConnectedPeer]>([:])
    private let perUID = Locked<[UInt32: Int]>([:])

    /// A hub serving on `loops` (at least one), with what `storage` holds.
    init(
        loops: [any EventLoop], historyLimits: HistoryLimits, storage: any Storage, runtime: Runtime,
        delivery: DeliveryBudget = DeliveryBudget(), onHistoryLost: @escaping @Sendable (String) -> Void = { _ in }
    ) throws(StorageError) {
        self.historyLimits = historyLimits
        self.storage = storage
        self.shared = storage as? any SharedStorage
        self.freshEpoch = shared?.epoch ?? Epoch.random()
        self.onHistoryLost = onHistoryLost
        self.runtime = runtime
        precondition(!loops.isEmpty, "a hub needs an event loop")
        shards = loops.enumerated().map { LoopShard(eventLoop: $1, index: $0, budget: delivery) }
        let loaded = try storage.load()
        repositories.withLock { map in
            for repo in loaded {
                map[repo.name] = Slot(repository: makeRepository(repo.name, loaded: repo))
            }
        }
        stats.repositories.store(loaded.filter { $0.state.revision > 0 }.count, ordering: .relaxed)
        for shard in shards { shard.hub = self }
    }

    private func makeRepository(_ name: String, loaded: LoadedRepository? = nil) -> Repository {
        Repository(name: name, loaded: loaded, storage: storage, hub: self)
    }

    // MARK: Event loops

    /// A loop whose delivery backlog is at its limit, if any: writers wait for it.
    var backloggedShard: LoopShard? {
        for shard in shards where shard.isBacklogged { return shard }
        return nil
    }

    /// The shard of `loop` (every connection's loop is one of the hub's).
    func shard(for loop: any EventLoop) -> LoopShard {
        shards.first { $0.eventLoop === loop }!
    }

    /// Every loop's counters.
    var loopCounters: [LoopCounters] { shards.map(\.counters) }

    // MARK: Repositories

    /// The repository if it exists or has subscribers; never creates one.
    func existing(_ name: String) -> Repository? {
        repositories.withLock { $0[name]?.repository }
    }

    /// Runs `body` with the repository `name`, created (unlisted, empty) if needed and kept
    /// alive for the duration of `body`.
    func using<R, E: Error>(_ name: String, _ body: (Repository) throws(E) -> R) throws(E) -> R {
        if let repo = existing(name), repo.isPermanent {
            return try body(repo)
        }
        let repo = hold(name)
        defer { release(name) }
        return try body(repo)
    }

    /// The repository `name` (created, unlisted and empty, if needed), kept until `release`:
    /// for an operation that outlives one call (a write waiting for the shared store).
    func hold(_ name: String) -> Repository {
        repositories.withLock { map -> Repository in
            if map[name] == nil { map[name] = Slot(repository: makeRepository(name)) }
            map[name]!.users += 1
            return map[name]!.repository
        }
    }

    /// Ends a `hold` (or a `using`): drops the repository if it is a placeholder nobody uses.
    func release(_ name: String) {
        repositories.withLock { map in
            guard var slot = map[name] else { return }
            slot.users -= 1
            if Self.isDisposable(slot) {
                map[name] = nil
            } else {
                map[name] = slot
            }
        }
    }

    /// Called after a subscription to `repo` ended, whatever ended it: drops the repository
    /// if it was a placeholder nobody uses any more.
    func subscriptionEnded(_ repo: Repository) {
        if !repo.isPermanent {
            repositories.withLock { map in
                if let slot = map[repo.name], slot.repository === repo, Self.isDisposable(slot) {
                    map[repo.name] = nil
                }
            }
        }
    }

    private static func isDisposable(_ slot: Slot) -> Bool {
        slot.users == 0 && !slot.repository.isPermanent && slot.repository.subscriberCount == 0
    }

    /// The repositories that exist (revision > 0), sorted by name.
    func listed() -> [Repository] {
        let all = repositories.withLock { $0.values.map(\.repository) }
        return all.filter { $0.revision > 0 }.sorted { $0.name.utf8.lexicographicallyPrecedes($1.name.utf8) }
    }

    /// The number of repositories that exist.
    var repositoryCount: Int { stats.repositories.load(ordering: .relaxed) }

    /// The repository objects held in memory: those that exist, and placeholders for
    /// subscriptions and writes under way (privileged `stats`: `repositoriesHeld`).
    var heldCount: Int { repositories.withLock { $0.count } }

    // MARK: Connections

    /// Admits a connection, or says why not (too many connections, in all or for its uid).
    func admit(_ connection: ObjectIdentifier, _ entry: ConnectedPeer) -> String? {
        let limits = runtime.snapshot.limits
        guard stats.reserveConnection(limit: limits.maxConnections) else {
            return "too many connections (limit \(limits.maxConnections))"
        }
        let uid = entry.peer.uid
        let refused = perUID.withLock { counts -> Bool in
            if !entry.peer.isPrivileged, counts[uid, default: 0] >= limits.maxConnectionsPerUID { return true }
            counts[uid, default: 0] += 1
            return false
        }
        if refused {
            stats.connections.subtract(1, ordering: .relaxed)
            return "too many connections from uid \(uid) (limit \(limits.maxConnectionsPerUID))"
        }
        peers.withLock { $0[connection] = entry }
        stats.connectionsTotal.add(1, ordering: .relaxed)
        return nil
    }

    /// Forgets an admitted connection.
    func leave(_ connection: ObjectIdentifier) {
        guard let entry = peers.withLock({ $0.removeValue(forKey: connection) }) else { return }
        perUID.withLock { counts in
            let left = counts[entry.peer.uid, default: 1] - 1
            counts[entry.peer.uid] = left > 0 ? left : nil
        }
        stats.connections.subtract(1, ordering: .relaxed)
    }

    /// The connected peers (for privileged `stats`).
    var connectedPeers: [ConnectedPeer] { peers.withLock { Array($0.values) } }

    /// The number of connections of `uid`.
    func connections(of uid: UInt32) -> Int { perUID.withLock { $0[uid] ?? 0 } }

    /// Applies new limits and policy; every connection re-checks its subscriptions.
    func reload(limits: Limits, policy: AccessPolicy) {
        runtime.update(limits: limits, policy: policy)
        for entry in connectedPeers { entry.revalidate() }
    }
}

// MARK: - A shared store's revisions

extension Hub: SharedStorageSink {
    func deliver(repo name: String, revisions: [SharedRevision]) {
        // Kept for good under the map's lock, so a placeholder cannot be dropped between here
        // and the install that makes it a repository.
        let repository = repositories.withLock { map -> Repository in
            let repository = map[name]?.repository ?? makeRepository(name)
            if map[name] == nil { map[name] = Slot(repository: repository) }
            repository.keep()
            return repository
        }
        repository.install(shared: revisions)
    }

    func historyLost(_ reason: String) {
        onHistoryLost(reason)
    }
}
