// ObsServer — a session's lease requests: `grant`, `keepalive`, `revoke` (the contract's
// "Keys with a lifetime"). Writes that name a lease go through the write path like any other
// (Session.swift, Sequencer.swift).
//
// With local storage the lease table decides at once; a grant, or a revoke, is answered once
// what it changed is durable (its frame in the log, and a revoke's deletions). With a shared
// store (etcd mode) the store keeps the leases (SharedLeases.swift): the request waits for it
// — the connection's later requests wait behind it, as behind a write — and is answered on
// the session's loop.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    func grant(_ id: JSONValue, ttl: Int64?) {
        if hub.shared != nil {
            guard let shared = hub.sharedLeases else {
                return fail(id: id, ProtocolError(.badRequest, "leases are not available: this daemon's shared store keeps none"))
            }
            return sharedGrant(id, ttl: ttl, shared)
        }
        let result = hub.leases.grant(
            owner: writer, ttl: ttl, connection: connection.id, now: shard.loop.now,
            limit: limits.maxLeasesPerUID)
        switch result {
        case .failure(let refusal):
            fail(id: id, refusal.protocolError)
        case .success(let (lease, sequence)):
            if ttl != nil { hub.leaseClock.deadlineMoved() }
            var bytes: [UInt8] = []
            GrantReply(lease: lease, ttl: ttl.map { UInt32($0) }).encode(into: &bytes, id: id)
            hold(bytes, id: id, until: sequence, in: hub.leases)
        }
    }

    func keepAlive(_ id: JSONValue, _ lease: UInt64) {
        if let shared = hub.sharedLeases { return sharedKeepAlive(id, lease, shared) }
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
        if let shared = hub.sharedLeases { return sharedRevoke(id, lease, shared) }
        let ended: EndedLease
        switch hub.leases.revoke(lease, by: peer) {
        case .failure(let refusal): return fail(id: id, refusal.protocolError)
        case .success(let e): ended = e
        }
        // A local store decides at once.
        let collected = Locked<[LeaseDeletion]>([])
        hub.end(ended, time: shard.loop.wallSeconds) { deletions in collected.withLock { $0 = deletions } }
        let deletions = collected.withLock { $0 }
        guard let ended = ended.sequence else {
            return fail(id: id, ProtocolError(.internal, "lease \(lease) ended, but the daemon is stopping and could not record it"))
        }
        var bytes: [UInt8] = []
        RevokeReply(revisions: Self.revisions(of: deletions)).encode(into: &bytes, id: id)
        let states: [(any DurableLine, StateSequence)] = [(hub.leases, ended)] + deletions.map { ($0.repository, $0.outcome.sequence) }
        // Storage failing the end or a deletion undoes neither in memory: the lease has ended
        // here for good, and both are made again until storage takes them.
        hold(bytes, id: id, until: states) { error in
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

    private static func revisions(of deletions: [LeaseDeletion]) -> [String: UInt64] {
        Dictionary(deletions.map { ($0.repository.name, $0.outcome.revision) }, uniquingKeysWith: max)
    }

    // MARK: With a shared store

    private func sharedGrant(_ id: JSONValue, ttl: Int64?, _ shared: SharedLeases) {
        let (owner, limit) = (writer, limits.maxLeasesPerUID)  // every uid, root's too
        let hub = self.hub
        afterStore {
            await shared.store.grantLease(owner: owner, ttl: ttl, limit: limit)
        } ifClosed: { result in
            // Its connection closed while it was granted: it ends at once.
            if case .success(let lease) = result, lease.ttl == nil { hub.endBound(lease, in: shared) }
        } then: { session, result in
            switch result {
            case .success(let lease):
                if lease.ttl == nil { shared.bind(lease, to: session.connection) }
                session.reply(id, GrantReply(lease: lease.id, ttl: lease.ttl.map { UInt32(clamping: $0) }))
            case .failure(.tooMany(let limit)):
                session.fail(id: id, LeaseRefusal.tooMany(limit: limit).protocolError)
            case .failure(.store(let failure)):
                session.fail(id: id, ProtocolError(.internal, failure.message))
            }
        }
    }

    private func sharedKeepAlive(_ id: JSONValue, _ lease: UInt64, _ shared: SharedLeases) {
        let peer = self.peer
        afterStore { () async -> Result<Int64?, ProtocolError> in
            switch await Self.named(lease, by: peer, in: shared.store) {
            case .failure(let error): return .failure(error)
            case .success(let found):
                switch await shared.store.keepAlive(found) {
                case .success(true): return .success(found.ttl)
                case .success(false): return .failure(LeaseRefusal.notFound(lease).protocolError)
                case .failure(let failure): return .failure(ProtocolError(.internal, failure.message))
                }
            }
        } then: { session, result in
            switch result {
            case .success(let ttl): session.reply(id, KeepaliveReply(ttl: ttl.map { UInt32(clamping: $0) }))
            case .failure(let error): session.fail(id: id, error)
            }
        }
    }

    /// How long a revoke waits for its lease's keys to be deleted before it is answered with
    /// the cause (the lease has ended; the deletion follows once the cluster takes writes).
    static let revokeTimeout: Duration = .seconds(10)

    private func sharedRevoke(_ id: JSONValue, _ lease: UInt64, _ shared: SharedLeases) {
        let peer = self.peer
        afterStore { () async -> Result<[String: UInt64], ProtocolError> in
            let found: SharedLease
            switch await Self.named(lease, by: peer, in: shared.store) {
            case .failure(let error): return .failure(error)
            case .success(let lease): found = lease
            }
            let waiter = shared.expectEnd(of: lease)
            switch await shared.store.endLease(found, reason: .revoked) {
            case .success(true): break
            case .success(false):
                shared.forget(waiter, of: lease)
                return .failure(LeaseRefusal.notFound(lease).protocolError)
            case .failure(let failure):
                shared.forget(waiter, of: lease)
                return .failure(ProtocolError(.internal, failure.message))
            }
            guard let deletions = await waiter.deletions(within: Self.revokeTimeout) else {
                return .failure(
                    ProtocolError(
                        .internal,
                        "lease \(lease) is revoked, but deleting its keys could not be committed within \(Self.revokeTimeout) (the etcd cluster takes no writes now); they are deleted once it does"))
            }
            return .success(Self.revisions(of: deletions))
        } then: { session, result in
            switch result {
            case .success(let revisions): session.reply(id, RevokeReply(revisions: revisions))
            case .failure(let error): session.fail(id: id, error)
            }
        }
    }

    /// Lease `id` if it is live and `peer` may name it (its owner's uid, or uid 0).
    private static func named(_ id: UInt64, by peer: Peer, in store: any SharedStorage) async -> Result<SharedLease, ProtocolError> {
        switch await store.lease(id) {
        case .failure(let failure): return .failure(ProtocolError(.internal, failure.message))
        case .success(nil): return .failure(LeaseRefusal.notFound(id).protocolError)
        case .success(let lease?):
            guard lease.owner.uid == peer.uid || peer.uid == 0 else {
                return .failure(LeaseRefusal.forbidden(id, owner: lease.owner.uid).protocolError)
            }
            return .success(lease)
        }
    }

    /// Runs `work` off the loop, then `body` with its result on this session's loop, holding
    /// the connection's later requests meanwhile; if the connection closed in between,
    /// `ifClosed` gets the result instead.
    func afterStore<T: Sendable>(
        _ work: @escaping @Sendable () async -> T, ifClosed: @escaping @Sendable (T) -> Void = { _ in },
        then body: @escaping (Session, T) -> Void
    ) {
        wait(for: .cluster)
        let ref = ConnectionRef(connection)
        let run = UncheckedSendableBox(body)
        Task(executorPreference: ref.loop) {
            let result = await work()
            ref.loop.execute {
                guard let session = ref.session else { return ifClosed(result) }
                run.value(session, result)
                session.resume(from: .cluster)
            }
        }
    }
}
