// ObsServer — the lease service with local storage (in memory, or on disk): the lease table
// (LeaseTable.swift) decides at once; a grant, or a revoke, is answered once what it changed
// is durable (its frame in the log, and a revoke's deletions). What an ended lease held is
// deleted through the hub's sequencer (`Hub.end`, LeaseEnds.swift); the clock that expires
// TTLs, and makes again what storage failed, is `LeaseClock`. Also: leases across a restart
// (the contract: TTL leases and their keys survive, each TTL starting again in full when the
// daemon serves; keys of connection-bound leases are deleted with `end: "closed"` in
// revisions made before the first request). Nothing is trusted but what storage recovered:
// the leases (LEAS and the log's grants and ends) and each repository's attachments, moved by
// the same log records as the writes that moved them — so an attachment is there exactly
// when its write is.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

final class LocalLeases: LeaseService {
    /// Every lease, its grants and ends stored with the revisions.
    let table: LeaseTable
    /// Expires leases with a TTL (on the first loop).
    let clock: LeaseClock

    init(storage: any Storage, loop: IOLoop) {
        self.table = LeaseTable(storage: storage)
        self.clock = LeaseClock(loop: loop, table: table)
    }

    /// Once, when the hub is assembled.
    func attach(to hub: Hub) {
        clock.attach(to: hub)
        table.whenStorageFails { [weak hub, clock] ended, rewrite in
            // Grants storage failed have ended (their keys go now); ends it failed are written
            // again a second later.
            for lease in ended { hub?.end(lease, time: WallClock.unixSeconds()) }
            if !rewrite.isEmpty { clock.rewrite(rewrite) }
        }
    }

    var count: Int { table.count }

    func grant(_ id: JSONValue, ttl: Int64?, for session: Session) {
        let result = table.grant(
            owner: session.writer, ttl: ttl, connection: session.connection.id, now: session.shard.loop.now,
            limit: session.limits.maxLeasesPerUID)
        switch result {
        case .failure(let refusal):
            session.fail(id: id, refusal.protocolError)
        case .success(let (lease, sequence)):
            if ttl != nil { clock.deadlineMoved() }
            var bytes: [UInt8] = []
            GrantReply(lease: lease, ttl: ttl.map { UInt32($0) }).encode(into: &bytes, id: id)
            session.hold(bytes, id: id, until: sequence, in: table)
        }
    }

    func keepAlive(_ id: JSONValue, _ lease: UInt64, for session: Session) {
        switch table.keepAlive(lease, by: session.peer, now: session.shard.loop.now) {
        case .failure(let refusal):
            session.fail(id: id, refusal.protocolError)
        case .success(let ttl):
            if ttl != nil { clock.deadlineMoved() }
            session.reply(id, KeepaliveReply(ttl: ttl.map { UInt32($0) }))
        }
    }

    /// Ends the lease at once; the reply carries, per repository, the revision that deleted
    /// its keys — sent once those revisions are durable.
    func revoke(_ id: JSONValue, _ lease: UInt64, for session: Session) {
        let ended: EndedLease
        switch table.revoke(lease, by: session.peer) {
        case .failure(let refusal): return session.fail(id: id, refusal.protocolError)
        case .success(let e): ended = e
        }
        // A local store decides at once.
        let collected = Locked<[LeaseDeletion]>([])
        session.hub.end(ended, time: session.shard.loop.wallSeconds) { deletions in collected.withLock { $0 = deletions } }
        let deletions = collected.withLock { $0 }
        guard let ended = ended.sequence else {
            return session.fail(id: id, ProtocolError(.internal, "lease \(lease) ended, but the daemon is stopping and could not record it"))
        }
        var bytes: [UInt8] = []
        RevokeReply(revisions: LeaseDeletion.revisions(of: deletions)).encode(into: &bytes, id: id)
        let states: [(any DurableLine, StateSequence)] = [(table, ended)] + deletions.map { ($0.repository, $0.outcome.sequence) }
        // Storage failing the end or a deletion undoes neither in memory: the lease has ended
        // here for good, and both are made again until storage takes them.
        session.hold(bytes, id: id, until: states) { error in
            var reply: [UInt8] = []
            ReplyEncoder.error(
                &reply, id: id,
                ProtocolError(
                    .internal,
                    "lease \(lease) is revoked — a keepalive, revoke or write naming it is not_found from now on — but storage could not record it yet (\(error.description)): obsd writes the lease's end and deletes its keys again every second until storage takes them; a restart before then may find the lease still granted"
                ))
            return reply
        }
    }

    func connectionClosed(_ connection: ConnectionID, time: Int64, in hub: Hub) {
        for ended in table.connectionClosed(connection) { hub.end(ended, time: time) }
    }

    /// Every key attached to a lease that is not a live TTL lease is deleted: a
    /// connection-bound one's (`closed`), one that ended before the stop — its deletion a kill
    /// interrupted, or storage failed — with the reason it ended for.
    func restore(time: Int64, in hub: Hub) {
        var repos: [UInt64: Set<String>] = [:]
        for repository in hub.repositories.all {
            for lease in repository.attachedLeases { repos[lease, default: []].insert(repository.name) }
        }
        for ended in table.restore(hub.storage.loadLeases(), repos: repos) { hub.end(ended, time: time) }
    }

    func startClocks(now: UInt64) {
        table.startClocks(now: now)
        clock.deadlineMoved()
    }

    /// Those of `leases` that have ended meanwhile owe their deletion, made a second later.
    func reattached(in repository: Repository, to leases: Set<UInt64>) {
        for id in leases where !table.isLive(id) {
            let ended = table.endOf(id) ?? PersistedLeases.Ended(reason: .closed, owner: Writer(uid: 0, gid: 0, pid: 0))
            clock.retry(EndedLease(id: id, owner: ended.owner, end: ended.reason, repos: [repository.name]))
        }
    }
}
