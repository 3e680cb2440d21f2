// ObsServer — the storage mode, decided once where the server is assembled (`Server.run`
// makes a `StorageMode` from the storage it opened; `Hub.init` builds its parts from it), and
// nowhere else: what decides writes (`LocalSequencer` or `SharedSequencer`), who keeps the
// leases (`LocalLeases`, `SharedLeases` or `NoLeases`), whether reads wait for a shared
// store first (the read barrier), and who installs what a shared store decided
// (`SharedDelivery`). No other file tests or casts the storage's type.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

/// Local storage (in memory or on disk), or a store several daemons share (etcd).
enum StorageMode: Sendable {
    case local(any Storage)
    case shared(any SharedStorage)

    /// The mode `storage` runs in.
    init(_ storage: any Storage) {
        if let shared = storage as? any SharedStorage { self = .shared(shared) } else { self = .local(storage) }
    }

    var storage: any Storage {
        switch self {
        case .local(let storage): storage
        case .shared(let shared): shared
        }
    }

    /// The store the server connects to before serving, delivers to, and leaves on stopping.
    var shared: (any SharedStorage)? {
        if case .shared(let shared) = self { shared } else { nil }
    }

    /// What the mode decides, for a hub with `stats` whose first loop is `loop`.
    func parts(stats: ServerStats, loop: IOLoop) -> Parts {
        switch self {
        case .local(let storage):
            let leases = LocalLeases(storage: storage, loop: loop)
            return Parts(
                sequencer: LocalSequencer(storage: storage, stats: stats, leases: leases.table), leases: leases, readBarrier: nil,
                delivery: nil, freshEpoch: Epoch.random())
        case .shared(let shared):
            let sequencer = SharedSequencer(store: shared, stats: stats, leaseLoop: loop)
            let leases: any LeaseService = shared.keepsLeases ? SharedLeases(store: shared, sequencer: sequencer) : NoLeases()
            return Parts(
                sequencer: sequencer, leases: leases, readBarrier: shared, delivery: SharedDelivery(sequencer: sequencer, leases: leases),
                freshEpoch: shared.epoch)
        }
    }

    struct Parts {
        let sequencer: any Sequencer
        let leases: any LeaseService
        /// Reads first make sure the state here is current (a shared store), or nil.
        let readBarrier: (any SharedStorage)?
        /// Installs what a shared store decided, or nil.
        let delivery: SharedDelivery?
        /// The epoch of repositories this daemon has not stored yet.
        let freshEpoch: String
    }
}
