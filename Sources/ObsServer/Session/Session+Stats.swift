// ObsServer — `stats`: counters. A privileged peer (root, the daemon's uid) sees the daemon's;
// others see their own connections and subscriptions and the repositories they may read.

import ObsProtocol
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

extension Session {
    func stats(_ id: JSONValue) {
        let s = hub.stats
        let uptime = hub.startTime.duration(to: .now)
        func count(_ c: borrowing Atomic<Int>) -> UInt64 { UInt64(max(0, c.load(ordering: .relaxed))) }
        func sum(_ value: (LoopCounters) -> Int) -> UInt64 { UInt64(max(0, hub.loopCounters.reduce(0) { $0 + value($1) })) }
        let privileged = peer.isPrivileged
        let readable = privileged ? hub.repositoryCount : hub.listed().filter { permission($0.name) >= .read }.count
        reply(id) { b in
            b.writeMember(",\"connections\":", privileged ? count(s.connections) : UInt64(hub.connections(of: peer.uid)))
            b.writeMember(",\"subscriptions\":", privileged ? count(s.subscriptions) : UInt64(outbox.liveCount))
            b.writeMember(",\"repos\":", UInt64(readable))
            b.writeMember(",\"peer\":{\"uid\":", UInt64(peer.uid))
            b.writeMember(",\"gid\":", UInt64(peer.gid))
            b.writeMember(",\"pid\":", UInt64(max(0, peer.pid)))
            b.writeMember(",\"privileged\":", privileged)
            b.writeByte(UInt8(ascii: "}"))
            b.writeMember(",\"server\":", "obsd/\(Server.version)")
            guard privileged else { return }
            b.writeMember(",\"connectionsTotal\":", count(s.connectionsTotal))
            b.writeMember(",\"connectionsRefused\":", count(s.connectionsRefused))
            b.writeMember(",\"requests\":", sum { $0.requests.load(ordering: .relaxed) })
            b.writeMember(",\"writes\":", sum { $0.writes.load(ordering: .relaxed) })
            b.writeMember(",\"eventsOut\":", sum { $0.eventsOut.load(ordering: .relaxed) })
            b.writeMember(",\"bytesOut\":", sum { $0.bytesOut.load(ordering: .relaxed) })
            b.writeMember(",\"overflows\":", count(s.overflows))
            b.writeMember(",\"writersHeld\":", count(s.writersHeld))
            b.writeMember(",\"repositoriesHeld\":", UInt64(hub.heldCount))
            b.writeMember(",\"leases\":", UInt64(hub.leases.count))
            b.writeMember(",\"errors\":", count(s.errors))
            b.writeMember(",\"denied\":", count(s.denied))
            b.writeMember(",\"uptimeSeconds\":", UInt64(max(0, uptime.components.seconds)))
            b.writeMember(",\"pid\":", UInt64(max(0, getpid())))
            let reloads = hub.runtime.reloads
            b.writeMember(",\"reloads\":", UInt64(reloads.ended))
            b.writeMember(",\"reloadFailures\":", UInt64(reloads.failed))
            if let error = reloads.error { b.writeMember(",\"reloadError\":", error) }
            b.writeMember(",\"storage\":", hub.storage.summary)
            if let c = hub.storage.counters {
                b.writeMember(",\"storageCommits\":", count(c.commits))
                b.writeMember(",\"storageFsyncs\":", count(c.fsyncs))
                b.writeMember(",\"storageRecords\":", count(c.records))
                b.writeMember(",\"storageFailures\":", count(c.failures))
                b.writeMember(",\"storageCheckpoints\":", count(c.checkpoints))
                b.writeMember(",\"storageCheckpointFailures\":", count(c.checkpointFailures))
            }
            b.writeRaw(",\"clients\":[")
            for (i, client) in hub.connectedPeers.sorted(by: { $0.since < $1.since }).enumerated() {
                if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                b.writeMember("{\"uid\":", UInt64(client.peer.uid))
                b.writeMember(",\"gid\":", UInt64(client.peer.gid))
                b.writeMember(",\"pid\":", UInt64(max(0, client.peer.pid)))
                b.writeMember(",\"subscriptions\":", UInt64(client.subscriptions.value))
                b.writeMember(",\"connectedSeconds\":", UInt64(max(0, client.since.duration(to: .now).components.seconds)))
                b.writeByte(UInt8(ascii: "}"))
            }
            b.writeByte(UInt8(ascii: "]"))
        }
    }
}
