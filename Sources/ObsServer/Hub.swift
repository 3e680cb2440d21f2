// ObsServer — the daemon's shared parts, assembled once (Hub.init) and reached by every
// connection: the repositories by name (Repositories.swift), the connected peers
// (Peers.swift), the counters (ServerStats.swift), the parts the storage mode decided
// (StorageMode.swift: the sequencer that decides writes, the lease service, the read barrier,
// a shared store's delivery), every loop's shard, and the current limits and access policy.

#if canImport(Glibc)
import Glibc
#endif
import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

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

    /// The repositories by name.
    let repositories: Repositories
    /// The connected peers.
    let peers: Peers
    /// Every event loop's share, by index.
    let shards: [LoopShard]
    private let shardRefs: [Unmanaged<LoopShard>]

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
        self.peers = Peers(runtime: runtime, stats: stats)
        self.repositories = Repositories(loaded: try storage.load(), stats: stats) {
            [epoch = parts.freshEpoch, stats, leases = parts.leases] name, loaded in
            Repository(
                name: name, epoch: epoch, historyLimits: historyLimits, loaded: loaded, storage: storage, stats: stats,
                onUndo: { [unowned leases] repository, attached in leases.reattached(in: repository, to: attached) })
        }
        for shard in shards {
            // Each loop commits the writes it made, and delivers what storage reported about
            // them, before it delivers events and writes — and, where that is cheap, also
            // before it sends replies in the middle of a read (LoopShard.commitEarly).
            let commit = { [storage] in
                storage.flush()
                courier.deliver()
            }
            shard.loop.beforeTick = commit
            shard.earlyCommit = storage.flushesCheaply ? commit : nil
        }
        leases.attach(to: self)
        delivery?.attach(to: self)
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

    /// Applies new limits and policy; every connection re-checks its subscriptions.
    func reload(limits: Limits, policy: AccessPolicy) {
        runtime.update(limits: limits, policy: policy)
        peers.revalidateAll()
    }
}

// MARK: - A shared store's history

extension Hub {
    /// A shared store's history no longer matches this daemon's.
    func historyLost(_ reason: String) {
        onHistoryLost(reason)
    }
}
