// ObsServer — a session's lease requests: `grant`, `keepalive`, `revoke` (the contract's
// "Keys with a lifetime"). Writes that name a lease go through the write path like any other
// (Session.swift, Sequencer.swift).

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    func grant(_ id: JSONValue, ttl: Int64?) {
        if hub.shared != nil {
            return fail(
                id: id,
                ProtocolError(
                    .badRequest,
                    "leases are not available in this version when repositories are shared through etcd (storage.etcd-endpoints)"))
        }
        let result = hub.leases.grant(
            owner: writer, ttl: ttl, connection: connection.id, now: shard.loop.now,
            limit: limits.maxLeasesPerUID)
        switch result {
        case .failure(let refusal):
            fail(id: id, refusal.protocolError)
        case .success(let lease):
            if ttl != nil { hub.leaseClock.deadlineMoved() }
            reply(id, GrantReply(lease: lease, ttl: ttl.map { UInt32($0) }))
        }
    }

    func keepAlive(_ id: JSONValue, _ lease: UInt64) {
        switch hub.leases.keepAlive(lease, by: peer, now: shard.loop.now) {
        case .failure(let refusal):
            fail(id: id, refusal.protocolError)
        case .success(let ttl):
            if ttl != nil { hub.leaseClock.deadlineMoved() }
            reply(id, KeepaliveReply(ttl: ttl.map { UInt32($0) }))
        }
    }

    /// Ends the lease at once; the reply carries, per repository, the revision that deleted
    /// its keys — sent once those revisions are durable.
    func revoke(_ id: JSONValue, _ lease: UInt64) {
        let ended: EndedLease
        switch hub.leases.revoke(lease, by: peer) {
        case .failure(let refusal): return fail(id: id, refusal.protocolError)
        case .success(let e): ended = e
        }
        // A local store decides at once (the only kind leases are granted with).
        let collected = Locked<[LeaseDeletion]>([])
        hub.end(ended, time: shard.loop.wallSeconds) { deletions in collected.withLock { $0 = deletions } }
        let deletions = collected.withLock { $0 }.sorted { $0.repository.name.utf8.lexicographicallyPrecedes($1.repository.name.utf8) }
        var bytes: [UInt8] = []
        let revisions = Dictionary(deletions.map { ($0.repository.name, $0.outcome.revision) }, uniquingKeysWith: max)
        RevokeReply(revisions: revisions).encode(into: &bytes, id: id)
        hold(bytes, id: id, until: deletions.map { ($0.repository, $0.outcome.sequence) })
    }
}
