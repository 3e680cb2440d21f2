// ObsServer — the daemon's shared state: repositories by name, the parts the storage mode
// decided (StorageMode.swift: the sequencer that decides writes, the lease service, the read
// barrier, a shared store's delivery), connected peers, counters, and the current limits and
// access policy.
//
// A repository exists (is listed by `repos`) once a write changed it (revision > 0). Reading
// a repository that does not exist creates nothing. Subscribing to one — or writing to it
// while the write waits for a shared store — holds an empty, unlisted placeholder, dropped
// again when nobody uses it. A repository that was ever written in this process is never
// dropped, so the common path — a write or subscribe to such a repository — takes the hub
// lock once, for a dictionary lookup, and nobody can hold a repository the hub no longer has.

#if canImport(Glibc)
import Glibc
#endif
import ObsCore
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

    /// Adds one to `counter` unless it has reached `limit` — in one step, so concurrent callers
    /// cannot pass the limit together.
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
    /// The bytes of large subscription starts being sent, daemon-wide (StartBudget.swift).
    let startBudget = StartBudget()
    /// When the daemon started serving (`uptimeSeconds`).
    let startTime = ContinuousClock.now
    /// The epoch of every repository this daemon has not stored yet — at revision 0 there is
    /// no history to tell apart — and that repositories created by this process keep. New at
    /// every start, except with a shared store, whose epoch every daemon sharing it uses.
    let freshEpoch: String
    let historyLimits: HistoryLimits
    let storage: any Storage
    /// Delivers what storage reports about the frames handed to it.
    let courier: DurabilityCourier
    /// Decides writes (`LocalSequencer`, or `SharedSequencer` when other daemons share the store).
    let sequencer: any Sequencer
    /// Reads first make sure the state here is current: the shared store, when there is one.
    let readBarrier: (any SharedStorage)?
    /// Installs what a shared store decided (`deliver`), when there is one.
    let delivery: SharedDelivery?
    /// Told when a shared store's history no longer matches this daemon's.
    private let onHistoryLost: @Sendable (String) -> Void
    let runtime: Runtime
    let users = UserDatabase()
    /// The uid the daemon runs as (its peers of this uid are privileged), read once.
    let daemonUID = getuid()
    /// The leases, whoever keeps them (LeaseService.swift).
    let leases: any LeaseService

    private struct Slot {
        let repository: Repository
        /// Operations in progress that may create or register into this repository.
        var users = 0
    }

    private let repositories = Mutex<[String: Slot]>([:])
    /// Every event loop's share, by index.
    let shards: [LoopShard]
    private let shardRefs: [Unmanaged<LoopShard>]
    private let peers = Mutex<[ConnectionID: ConnectedPeer]>([:])
    private let perUID = Mutex<[UInt32: Int]>([:])

    /// A hub serving on `shards` (at least one), with what `storage` holds.
    init(
        shards: [LoopShard], historyLimits: HistoryLimits, storage: any Storage, runtime: Runtime,
        onHistoryLost: @escaping @Sendable (String) -> Void = { _ in }
    ) throws(StorageError) {
        precondition(!shards.isEmpty, "a hub needs an event loop")
        self.historyLimits = historyLimits
        self.storage = storage
        self.shards = shards
        self.shardRefs = shards.map { Unmanaged.passUnretained($0) }
        self.runtime = runtime
        self.onHistoryLost = onHistoryLost
        let parts = StorageMode(storage).parts(stats: stats, loop: shards[0].loop)
        self.sequencer = parts.sequencer
        self.leases = parts.leases
        self.readBarrier = parts.readBarrier
        self.delivery = parts.delivery
        self.freshEpoch = parts.freshEpoch
        let courier = DurabilityCourier(storage, wakes: shards[0].loop)
        self.courier = courier
        let loaded = try storage.load()
        let made = loaded.map { ($0.name, makeRepository($0.name, loaded: $0)) }
        repositories.withLock { map in
            for (name, repository) in made { map[name] = Slot(repository: repository) }
        }
        stats.repositories.store(loaded.filter { $0.state.revision > 0 }.count, ordering: .relaxed)
        for shard in shards {
            // Each loop commits the writes it made, and delivers what storage reported about
            // them, before it delivers events and writes.
            shard.loop.beforeTick = { [storage] in
                storage.flush()
                courier.deliver()
            }
        }
        leases.attach(to: self)
        delivery?.attach(to: self)
    }

    private func makeRepository(_ name: String, loaded: LoadedRepository? = nil) -> Repository {
        Repository(
            name: name, epoch: freshEpoch, historyLimits: historyLimits, loaded: loaded, storage: storage, stats: stats,
            onUndo: { [unowned self] repository, attached in leases.reattached(in: repository, to: attached) })
    }

    // MARK: Event loops

    /// A loop whose delivery backlog is at its limit, if any: writers wait for it.
    var backloggedShard: LoopShard? {
        // Asked after every write: the shards are read through unretained references (a
        // retain and release of each shard per write, before the check, was 1 % of the
        // daemon's time at fan-out 1); the hub holds them all for its life.
        for shard in shardRefs where shard._withUnsafeGuaranteedRef({ $0.isBacklogged }) { return shard.takeUnretainedValue() }
        return nil
    }

    /// Every loop's counters.
    var loopCounters: [LoopCounters] { shards.map(\.counters) }

    // MARK: Repositories

    /// The repository if it exists or is held; never creates one.
    func existing(_ name: String) -> Repository? {
        repositories.withLock { $0[name]?.repository }
    }

    /// The repository `name` (created, unlisted and empty, if needed), kept until `release`.
    func hold(_ name: String) -> Repository {
        repositories.withLock { map -> Repository in
            if map[name] == nil { map[name] = Slot(repository: makeRepository(name)) }
            map[name]!.users += 1
            return map[name]!.repository
        }
    }

    /// Ends a `hold`: drops the repository if it is a placeholder nobody uses.
    func release(_ name: String) {
        repositories.withLock { map in
            guard var slot = map[name] else { return }
            slot.users -= 1
            map[name] = Self.isDisposable(slot) ? nil : slot
        }
    }

    /// Called after a subscription to `repository` ended, by whoever ended it (a session, or
    /// a connection for what its loop's delivery ended): drops the repository if it was a
    /// placeholder nobody uses any more.
    func subscriptionEnded(_ repository: Repository) {
        guard !repository.isPermanent else { return }
        repositories.withLock { map in
            if let slot = map[repository.name], slot.repository === repository, Self.isDisposable(slot) { map[repository.name] = nil }
        }
    }

    private static func isDisposable(_ slot: Slot) -> Bool {
        slot.users == 0 && !slot.repository.isPermanent && slot.repository.subscriberCount == 0
    }

    /// Every repository held, placeholders included, in no order.
    func allRepositories() -> [Repository] {
        repositories.withLock { $0.values.map(\.repository) }
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
    func admit(_ connection: ConnectionID, _ entry: ConnectedPeer) -> String? {
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
    func leave(_ connection: ConnectionID) {
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

extension Hub {
    /// Repository `name` kept for good (a shared store delivered revisions of it), made if
    /// need be — under the map's lock, so a placeholder cannot be dropped between here and the
    /// install that makes it a repository.
    func permanentRepository(_ name: String) -> Repository {
        repositories.withLock { map -> Repository in
            let repository = map[name]?.repository ?? makeRepository(name)
            if map[name] == nil { map[name] = Slot(repository: repository) }
            repository.makePermanent()
            return repository
        }
    }

    func historyLost(_ reason: String) {
        onHistoryLost(reason)
    }
}
