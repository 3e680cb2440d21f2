// ObsServer — the connected peers, daemon-wide: admission under the connection limits (in
// all, and per uid), who is connected since when with how many subscriptions (privileged
// `stats`), and the re-check of every connection's subscriptions after a reload.

import ObsProtocol
import ObservableKit

/// A connection as the daemon knows it: who, since when, how many subscriptions, and where to
/// run code on its loop.
struct ConnectedPeer: Sendable {
    let peer: Peer
    let since: ContinuousClock.Instant
    let subscriptions: SubscriptionTally
    /// Runs on the connection's event loop: re-checks its subscriptions after a reload.
    let revalidate: @Sendable () -> Void
}

/// The admitted connections, and how many each uid has.
final class Peers: Sendable {
    private let runtime: Runtime
    private let stats: ServerStats
    private let peers = Locked<[ConnectionID: ConnectedPeer]>([:])
    private let perUID = Locked<[UInt32: Int]>([:])

    init(runtime: Runtime, stats: ServerStats) {
        self.runtime = runtime
        self.stats = stats
    }

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
    var all: [ConnectedPeer] { peers.withLock { Array($0.values) } }

    /// The number of connections of `uid`.
    func connections(of uid: UInt32) -> Int { perUID.withLock { $0[uid] ?? 0 } }

    /// Has every connection re-check its subscriptions (on its own loop), after a reload.
    func revalidateAll() {
        for entry in all { entry.revalidate() }
    }
}
