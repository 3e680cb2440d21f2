// ObsServer — `stats`: counters, written through ObsProtocol's typed `Stats` like every other
// reply. A privileged peer (root, the daemon's uid) sees the daemon's; others see their own
// connections and subscriptions and the repositories they may read.

import ObsProtocol
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

extension Session {
    func stats(_ id: JSONValue) {
        let s = hub.stats
        func count(_ c: borrowing Atomic<Int>) -> UInt64 { UInt64(max(0, c.load(ordering: .relaxed))) }
        func sum(_ value: (LoopCounters) -> Int) -> UInt64 { UInt64(max(0, hub.loopCounters.reduce(0) { $0 + value($1) })) }
        let privileged = peer.isPrivileged
        var stats = Stats(
            connections: privileged ? count(s.connections) : UInt64(hub.peers.connections(of: peer.uid)),
            subscriptions: privileged ? count(s.subscriptions) : UInt64(outbox.liveCount),
            repositories: UInt64(privileged ? hub.repositories.count : hub.repositories.listed().filter { permission($0.name) >= .read }.count),
            peer: Stats.Peer(uid: peer.uid, gid: peer.gid, pid: max(0, peer.pid), privileged: privileged),
            server: "obsd/\(Server.version)")
        if privileged {
            stats.connectionsTotal = count(s.connectionsTotal)
            stats.connectionsRefused = count(s.connectionsRefused)
            stats.requests = sum { $0.requests.load(ordering: .relaxed) }
            stats.writes = sum { $0.writes.load(ordering: .relaxed) }
            stats.eventsOut = sum { $0.eventsOut.load(ordering: .relaxed) }
            stats.bytesOut = sum { $0.bytesOut.load(ordering: .relaxed) }
            stats.overflows = count(s.overflows)
            stats.writersHeld = count(s.writersHeld)
            stats.repositoriesHeld = UInt64(hub.repositories.heldCount)
            stats.leases = UInt64(hub.leases.count)
            stats.errors = count(s.errors)
            stats.denied = count(s.denied)
            stats.uptimeSeconds = UInt64(max(0, hub.startTime.duration(to: .now).components.seconds))
            stats.pid = UInt64(max(0, getpid()))
            let reloads = hub.runtime.reloads
            stats.reloads = UInt64(reloads.ended)
            stats.reloadFailures = UInt64(reloads.failed)
            stats.reloadError = reloads.error
            stats.storage = hub.storage.summary
            if let c = hub.storage.counters {
                stats.storageCommits = count(c.commits)
                stats.storageFsyncs = count(c.fsyncs)
                stats.storageRecords = count(c.records)
                stats.storageFailures = count(c.failures)
                stats.storageCheckpoints = count(c.checkpoints)
                stats.storageCheckpointFailures = count(c.checkpointFailures)
            }
            stats.clients = hub.peers.all.sorted(by: { $0.since < $1.since }).map { client in
                Stats.Client(
                    uid: client.peer.uid, gid: client.peer.gid, pid: max(0, client.peer.pid), subscriptions: client.subscriptions.value,
                    connectedSeconds: UInt64(max(0, client.since.duration(to: .now).components.seconds)))
            }
        }
        reply(id, stats)
    }
}
