// ObsServer — the daemon's leases as one service, whatever keeps them: the contract's "Keys
// with a lifetime" (`grant`, `keepalive`, `revoke`, a connection-bound lease ending with its
// connection, TTLs restarting when the daemon serves). Which implementation the daemon runs
// is decided once, where the hub is assembled from the storage mode (Hub.init):
// - `LocalLeases` (LocalLeases.swift): the lease table kept with local storage (in memory,
//   or with the revisions in the log);
// - `SharedLeases` (SharedLeases.swift): leases kept by a shared store (etcd);
// - `NoLeases`: a shared store that keeps none (a grant is refused; no lease exists).
// Nothing else in the daemon asks which one it is.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

protocol LeaseService: AnyObject, Sendable {
    /// Once, when the hub is assembled (before it serves or storage delivers).
    func attach(to hub: Hub)
    /// Answers `grant` from `session` (on its loop).
    func grant(_ id: JSONValue, ttl: Int64?, for session: Session)
    /// Answers `keepalive` from `session` (on its loop).
    func keepAlive(_ id: JSONValue, _ lease: UInt64, for session: Session)
    /// Answers `revoke` from `session` (on its loop): once the lease's keys are deleted.
    func revoke(_ id: JSONValue, _ lease: UInt64, for session: Session)
    /// `connection` closed: the leases bound to it end (`closed`).
    func connectionClosed(_ connection: ConnectionID, time: Int64, in hub: Hub)
    /// Restores what storage kept, making the deletions a restart owes: once, after the hub
    /// loaded and before it serves.
    func restore(time: Int64, in hub: Hub)
    /// Starts every restored TTL in full: once, when the daemon serves.
    func startClocks(now: UInt64)
    /// Live leases (`stats`): every daemon's when a shared store keeps them.
    var count: Int { get }

    /// An undo in `repository` attached keys to `leases` again.
    func reattached(in repository: Repository, to leases: Set<UInt64>)
    /// The shared store moved attachments of `repo`'s keys.
    func moved(_ moves: [AttachmentMove], in repo: String)
    /// The shared store says `lease` ended: what it held here is deleted through `hub`.
    func ended(_ lease: SharedLease, reason: LeaseEnd.Reason, in hub: Hub)
    /// The shared store can no longer vouch for `ids`.
    func lost(_ ids: [UInt64])
}

extension LeaseService {
    // What only one kind of store reports: the others never hear of it.
    func reattached(in repository: Repository, to leases: Set<UInt64>) {}
    func moved(_ moves: [AttachmentMove], in repo: String) {}
    func ended(_ lease: SharedLease, reason: LeaseEnd.Reason, in hub: Hub) {}
    func lost(_ ids: [UInt64]) {}
}

/// A shared store that keeps no leases: a grant is refused, and no lease exists to keep alive or
/// revoke.
final class NoLeases: LeaseService {
    private static let refusal = ProtocolError(.badRequest, "leases are not available: this daemon's shared store keeps none")

    func grant(_ id: JSONValue, ttl: Int64?, for session: Session) { session.fail(id: id, Self.refusal) }
    func keepAlive(_ id: JSONValue, _ lease: UInt64, for session: Session) { session.fail(id: id, LeaseRefusal.notFound(lease).protocolError) }
    func revoke(_ id: JSONValue, _ lease: UInt64, for session: Session) { session.fail(id: id, LeaseRefusal.notFound(lease).protocolError) }
    func attach(to hub: Hub) {}
    func connectionClosed(_ connection: ConnectionID, time: Int64, in hub: Hub) {}
    func restore(time: Int64, in hub: Hub) {}
    func startClocks(now: UInt64) {}
    var count: Int { 0 }
}
