// ObsServer — leases when repositories are shared through a store several daemons use (etcd
// mode). The store keeps the leases themselves — ids, owners, TTLs, what keeps each alive —
// and tells every daemon when one ends (ObsStore's SharedLeases.swift). This daemon keeps:
// which of its connections each lease it granted without a TTL is bound to (to end it when
// the connection closes, or to close the connection when the daemon can no longer vouch for
// the lease); which keys each lease holds here, as the store delivered the attachments; and
// the revokes waiting for their lease's keys to be deleted.
//
// When the store says a lease ended, this daemon deletes the keys still attached to it
// through the sequencer like any other daemon does (`Hub.end`), and once that is decided
// lets the store forget the lease and answers the revokes waiting for it — after a second
// look, once every revision committed before then has arrived, for repositories whose
// attachments or deletions were still on their way (`revisions(of:ending:in:)`).

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit

final class SharedLeases: LeaseService {
    let store: any SharedStorage
    /// Which repositories saw a lease's end arrive (for a revoke's second look).
    private let sequencer: SharedSequencer

    private struct State {
        /// This daemon's connection-bound leases, by connection.
        var bound: [ConnectionID: [SharedLease]] = [:]
        /// Where each of them is bound: to close the connection when the lease is lost.
        var connections: [UInt64: ConnectionRef] = [:]
        /// The keys each lease holds, by repository.
        var keys: [UInt64: [String: Set<Key>]] = [:]
        /// Revokes waiting for their lease's keys to be deleted.
        var waiting: [UInt64: [EndWaiter]] = [:]
    }

    private let state = Locked(State())

    init(store: any SharedStorage, sequencer: SharedSequencer) {
        self.store = store
        self.sequencer = sequencer
    }

    // MARK: Connections

    /// Lease `lease`, granted without a TTL, is bound to `connection` (on its loop).
    func bind(_ lease: SharedLease, to connection: Connection) {
        let ref = ConnectionRef(connection)
        state.withLock { s in
            s.bound[connection.id, default: []].append(lease)
            s.connections[lease.id] = ref
        }
    }

    /// `connection` closed: the leases bound to it.
    func unbind(_ connection: ConnectionID) -> [SharedLease] {
        state.withLock { s in
            let leases = s.bound.removeValue(forKey: connection) ?? []
            for lease in leases { s.connections[lease.id] = nil }
            return leases
        }
    }

    /// The connections the leases `ids` are bound to.
    func connections(holding ids: [UInt64]) -> [ConnectionRef] {
        state.withLock { s in ids.compactMap { s.connections[$0] } }
    }

    // MARK: Attachments

    /// Key `key` of `repo` moved from lease `from` to lease `to` (as the store delivered).
    func move(_ key: Key, of repo: String, from: UInt64?, to: UInt64?) {
        state.withLock { s in
            if let from {
                s.keys[from]?[repo]?.remove(key)
                if s.keys[from]?[repo]?.isEmpty == true { s.keys[from]?[repo] = nil }
                if s.keys[from]?.isEmpty == true { s.keys[from] = nil }
            }
            if let to { s.keys[to, default: [:]][repo, default: []].insert(key) }
        }
    }

    /// The keys lease `id` holds, by repository (it ended: they are about to go).
    func keys(of id: UInt64) -> [String: Set<Key>] { state.withLock { $0.keys[id] ?? [:] } }

    func moved(_ moves: [AttachmentMove], in repo: String) {
        for move in moves { self.move(move.key, of: repo, from: move.from, to: move.to) }
    }

    // MARK: Revokes

    /// A revoke of lease `id` waits for its keys to be deleted: registered before the store
    /// is asked, so the end cannot pass unseen.
    func expectEnd(of id: UInt64) -> EndWaiter {
        let waiter = EndWaiter()
        state.withLock { $0.waiting[id, default: []].append(waiter) }
        return waiter
    }

    func forget(_ waiter: EndWaiter, of id: UInt64) {
        state.withLock { s in
            s.waiting[id]?.removeAll { $0 === waiter }
            if s.waiting[id]?.isEmpty == true { s.waiting[id] = nil }
        }
    }

    /// The keys of ended lease `id` are deleted (`deletions`, per repository).
    func finished(_ id: UInt64, _ deletions: [LeaseDeletion]) {
        for waiter in state.withLock({ $0.waiting.removeValue(forKey: id) ?? [] }) { waiter.complete(deletions) }
    }
}

/// A revoke's wait for its lease's keys to be deleted.
final class EndWaiter: Sendable {
    private let state = Locked<(deletions: [LeaseDeletion]?, continuation: CheckedContinuation<[LeaseDeletion]?, Never>?)>((nil, nil))

    func complete(_ deletions: [LeaseDeletion]) {
        let continuation = state.withLock { s in
            s.deletions = deletions
            defer { s.continuation = nil }
            return s.continuation
        }
        continuation?.resume(returning: deletions)
    }

    /// The deletions, or nil after `timeout`.
    func deletions(within timeout: Duration) async -> [LeaseDeletion]? {
        await withCheckedContinuation { (continuation: CheckedContinuation<[LeaseDeletion]?, Never>) in
            let done = state.withLock { s -> [LeaseDeletion]? in
                if s.deletions == nil { s.continuation = continuation }
                return s.deletions
            }
            if let done { return continuation.resume(returning: done) }
            Task {
                try? await Task.sleep(for: timeout)
                self.state.withLock { s in
                    defer { s.continuation = nil }
                    return s.continuation
                }?.resume(returning: nil)
            }
        }
    }
}

// MARK: - The lease service

extension SharedLeases {
    /// Live leases: the store's (every daemon's).
    var count: Int { store.liveLeaseCount }

    // The store keeps the leases: nothing to restore, and its TTLs run in the store.
    func attach(to hub: Hub) {}
    func restore(time: Int64, in hub: Hub) {}
    func startClocks(now: UInt64) {}

    func grant(_ id: JSONValue, ttl: Int64?, for session: Session) {
        let (owner, limit) = (session.writer, session.limits.maxLeasesPerUID)  // every uid, root's too
        session.afterStore {
            await self.store.grantLease(owner: owner, ttl: ttl, limit: limit)
        } ifClosed: { result in
            // Its connection closed while it was granted: it ends at once.
            if case .success(let lease) = result, lease.ttl == nil { self.endBound(lease) }
        } then: { session, result in
            switch result {
            case .success(let lease):
                if lease.ttl == nil { self.bind(lease, to: session.connection) }
                session.reply(id, GrantReply(lease: lease.id, ttl: lease.ttl.map { UInt32(clamping: $0) }))
            case .failure(.tooMany(let limit)):
                session.fail(id: id, LeaseRefusal.tooMany(limit: limit).protocolError)
            case .failure(.store(let failure)):
                session.fail(id: id, ProtocolError(.internal, failure.message))
            }
        }
    }

    func keepAlive(_ id: JSONValue, _ lease: UInt64, for session: Session) {
        let peer = session.peer
        session.afterStore { () async -> Result<Int64?, ProtocolError> in
            switch await self.named(lease, by: peer) {
            case .failure(let error): return .failure(error)
            case .success(let found):
                switch await self.store.keepAlive(found) {
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

    func revoke(_ id: JSONValue, _ lease: UInt64, for session: Session) {
        let peer = session.peer
        let hub = session.hub
        session.afterStore { () async -> Result<[String: UInt64], ProtocolError> in
            let found: SharedLease
            switch await self.named(lease, by: peer) {
            case .failure(let error): return .failure(error)
            case .success(let lease): found = lease
            }
            let waiter = self.expectEnd(of: lease)
            switch await self.store.endLease(found, reason: .revoked) {
            case .success(true): break
            case .success(false):
                self.forget(waiter, of: lease)
                return .failure(LeaseRefusal.notFound(lease).protocolError)
            case .failure(let failure):
                self.forget(waiter, of: lease)
                return .failure(ProtocolError(.internal, failure.message))
            }
            guard let deletions = await waiter.deletions(within: Self.revokeTimeout) else {
                return .failure(
                    ProtocolError(
                        .internal,
                        "lease \(lease) is revoked, but deleting its keys could not be committed within \(Self.revokeTimeout) (the etcd cluster takes no writes now); they are deleted once it does"))
            }
            return .success(await self.revisions(of: deletions, ending: found, in: hub))
        } then: { session, result in
            switch result {
            case .success(let revisions): session.reply(id, RevokeReply(revisions: revisions))
            case .failure(let error): session.fail(id: id, error)
            }
        }
    }

    /// A revoke's `revs`: the repositories whose keys the end of `lease` deleted, each with
    /// the revision — the `deletions` this daemon's end found, and those it could not see.
    /// The lease's end and the repositories' revisions arrive on separate watches, so when the
    /// end came, an attachment another daemon committed before it (or one behind a lagging
    /// etcd member) may not have reached this daemon yet — or the other daemon's deletion of
    /// it already had, leaving nothing attached here. So once every revision committed before
    /// now has arrived (`linearize`), the lease ends again in each repository where it still
    /// holds keys or where a deletion of them arrived, and was not counted: the sequencer
    /// deletes what is left or names the deletion that came first (the robustness suite's
    /// `etcd-revoke-revs`: a revoke answered without a repository the other daemon deleted in).
    private func revisions(of deletions: [LeaseDeletion], ending lease: SharedLease, in hub: Hub) async -> [String: UInt64] {
        var revisions = LeaseDeletion.revisions(of: deletions)
        guard await store.linearize(.all) else { return revisions }  // unreachable: what it knows
        let missed = Set(keys(of: lease.id).keys).union(sequencer.repositoriesEnding(lease.id)).subtracting(revisions.keys)
        guard !missed.isEmpty else { return revisions }
        let again = EndedLease(id: lease.id, owner: lease.owner, end: .revoked, repos: missed)
        let more = await withCheckedContinuation { continuation in
            hub.end(again, time: WallClock.unixSeconds()) { continuation.resume(returning: $0) }
        }
        revisions.merge(LeaseDeletion.revisions(of: more), uniquingKeysWith: max)
        return revisions
    }

    /// Lease `id` if it is live and `peer` may name it (its owner's uid, or uid 0).
    private func named(_ id: UInt64, by peer: Peer) async -> Result<SharedLease, ProtocolError> {
        switch await store.lease(id) {
        case .failure(let failure): return .failure(ProtocolError(.internal, failure.message))
        case .success(nil): return .failure(LeaseRefusal.notFound(id).protocolError)
        case .success(let lease?):
            if let refusal = LeaseRefusal.naming(id, owner: lease.owner, by: peer) { return .failure(refusal.protocolError) }
            return .success(lease)
        }
    }

    /// The store says lease `lease` ended: deletes the keys still attached to it here (every
    /// daemon does; one deletion per repository goes through), then lets the store forget it.
    func ended(_ lease: SharedLease, reason: LeaseEnd.Reason, in hub: Hub) {
        let ended = EndedLease(id: lease.id, owner: lease.owner, end: reason, repos: Set(keys(of: lease.id).keys))
        hub.end(ended, time: WallClock.unixSeconds()) { deletions in
            self.store.leaseFinished(lease.id)
            self.finished(lease.id, deletions)
        }
    }

    /// This daemon can no longer vouch for leases `ids` bound to its connections: those
    /// connections close, as if they had ended (their clients learn it at once).
    func lost(_ ids: [UInt64]) {
        for ref in connections(holding: ids) { ref.loop.execute { ref.connection?.close() } }
    }

    /// A connection closed: the leases bound to it end (`closed`) in the store, retried while
    /// it cannot be reached and this daemon still vouches for them.
    func connectionClosed(_ connection: ConnectionID, time: Int64, in hub: Hub) {
        for lease in unbind(connection) { endBound(lease) }
    }

    /// Ends connection-bound `lease` in the store (its connection is gone).
    private func endBound(_ lease: SharedLease) {
        let store = self.store
        Task {
            while case .failure = await store.endLease(lease, reason: .closed), store.liveLease(lease.id) != nil {
                try? await Task.sleep(for: .seconds(1))
            }
        }
    }
}
