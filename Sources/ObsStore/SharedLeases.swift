// ObsStore — leases in a store several daemons share (several hosts): what the daemon asks of
// the store about them, and the values they exchange. The store keeps every lease of every
// daemon — who owns it, its TTL or the daemon it is bound to — and the key → lease
// attachments, and tells every daemon, in its order, when one ends (`SharedStorageSink`, with
// ObsValues' `LeaseEnd.Reason`);
// the daemons then delete the keys still attached to it through their ordinary commits, and
// the store lets exactly one such deletion per repository through (a commit's basis).
//
// A store that keeps no leases leaves the defaults below: `grant` is then refused.

import ObsValues
import ObservableKit

/// A live lease as the shared store keeps it.
public struct SharedLease: Sendable, Hashable {
    /// Its id: small, never reused while the store's data lasts.
    public let id: UInt64
    /// Who granted it (the connection's credentials): its uid may name it.
    public let owner: Writer
    /// Its TTL in seconds as the store granted it; nil: bound to a connection of the daemon
    /// that granted it.
    public let ttl: Int64?
    /// Names this lease's one life in the store: a commit naming the lease applies only
    /// while it is still this one.
    public let generation: Int64

    public init(id: UInt64, owner: Writer, ttl: Int64?, generation: Int64) {
        self.id = id
        self.owner = owner
        self.ttl = ttl
        self.generation = generation
    }
}

/// The store's side of ObsValues' `LeaseEnd.Reason`, which is extensible: a store holds only the
/// three reasons the daemon makes. The log and the snapshot hold one as a code
/// (`LeaseJournalRecord.code` and `reason`), etcd's records by name (these).
extension LeaseEnd.Reason {
    /// The reasons a store holds, in the order of their codes (1 expired, 2 revoked, 3 closed).
    static let stored: [LeaseEnd.Reason] = [.expired, .revoked, .closed]

    /// The reason as a store writes it: itself — the daemon makes no other than the three
    /// stored ones; one it did not know would be written `closed`, as the daemon always did.
    public var toStore: LeaseEnd.Reason { Self.stored.contains(self) ? self : .closed }

    /// `name` as a reason a store holds; nil for any other name: a stored record naming one is
    /// damaged or foreign, and its reader refuses it.
    public init?(storedName name: String) {
        guard let reason = Self.stored.first(where: { $0.rawValue == name }) else { return nil }
        self = reason
    }
}

/// A key's lease attachment, as the store delivers it (nil: attached to none).
public struct SharedAttachment: Sendable, Hashable {
    public let key: Key
    public let lease: UInt64?

    public init(key: Key, lease: UInt64?) {
        self.key = key
        self.lease = lease
    }
}

/// A key whose attachment a commit moves without changing its value: the entry it keeps, and
/// the lease it is attached to afterwards (nil: none).
public struct SharedReattachment: Sendable {
    public let key: Key
    public let entry: Entry<CanonicalJSON>
    public let lease: UInt64?

    public init(key: Key, entry: Entry<CanonicalJSON>, lease: UInt64?) {
        self.key = key
        self.entry = entry
        self.lease = lease
    }
}

/// Why a lease could not be granted.
public enum SharedGrantFailure: Error, Sendable {
    /// The owner's uid holds `limit` live leases in the store (every daemon's).
    case tooMany(limit: Int)
    case store(SharedFailure)
}

extension SharedStorage {
    /// Whether the store keeps leases.
    public var keepsLeases: Bool { false }

    /// Grants `owner` a lease: with a TTL of `ttl` seconds (the store may raise it to its
    /// minimum), honoured by the store whatever becomes of this daemon; or, `ttl` nil, bound
    /// to this daemon — ended by `endLease(…, .closed)`, and by the store when this daemon
    /// stops or loses it. `limit`: the most live leases the owner's uid may hold (nil: any).
    public func grantLease(owner: Writer, ttl: Int64?, limit: Int?) async -> Result<SharedLease, SharedGrantFailure> {
        .failure(.store(SharedFailure(.refused, "this store keeps no leases")))
    }

    /// Lease `id` if it is live as far as this daemon knows now, without asking the store.
    public func liveLease(_ id: UInt64) -> SharedLease? { nil }

    /// Lease `id` if it is live: as this daemon knows it, else as the store says now
    /// (linearizable). nil: it does not exist, or it ended.
    public func lease(_ id: UInt64) async -> Result<SharedLease?, SharedFailure> { .success(nil) }

    /// Starts `lease`'s TTL again in full: whether it was still live.
    public func keepAlive(_ lease: SharedLease) async -> Result<Bool, SharedFailure> { .success(false) }

    /// Ends `lease` (`revoked`, or `closed`: its connection ended): whether it was live. The
    /// sink is told of the end like of any other.
    public func endLease(_ lease: SharedLease, reason: LeaseEnd.Reason) async -> Result<Bool, SharedFailure> { .success(false) }

    /// No key is attached to ended lease `id` any more: the store may forget it.
    public func leaseFinished(_ id: UInt64) {}

    /// Live leases in the store, every daemon's.
    public var liveLeaseCount: Int { 0 }

    /// The daemon is stopping (called before `close`): the leases bound to it end now.
    public func leave() async {}

    public func limitExceeded(by records: [RevisionRecord], extraOperations: Int) -> String? { limitExceeded(by: records) }
}
