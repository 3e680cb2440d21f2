// ObsServer — leases: keys that live as long as their owner (the contract's "Keys with a
// lifetime"). This table owns who holds which lease, their TTL deadlines, and which keys of
// which repositories each one has attached; repositories own the other half of the link
// (key → lease, `RepositoryCore`), kept in step under the repository's lock.
//
// A lease granted without a TTL is bound to its connection and ends when that connection
// closes; one with a TTL ends when its deadline passes without a keep-alive. Deadlines sit
// in a heap — an idle lease costs nothing until it is due, a keep-alive pushes its new
// deadline and the old entry is skipped when it comes up. Ending a lease marks it ended here
// first (a write that names it from then on is `not_found`), then its keys are deleted
// through the same write path as any write (see `LeaseEnds`).

import HeapModule
import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Synchronization

/// Why a lease operation or a write naming a lease was refused.
enum LeaseRefusal: Error, Sendable, Equatable {
    case notFound(UInt64)
    case forbidden(UInt64, owner: UInt32)
    case tooMany(limit: Int)
    /// The lease journal cannot be written (durable storage only).
    case unavailable(String)
}

/// A lease that ended: whose it was and the keys it still held, per repository.
struct EndedLease: Sendable {
    let id: UInt64
    let owner: Writer
    let end: LeaseEnd.Reason
    let keys: [String: Set<Key>]
}

final class LeaseTable: Sendable {
    struct Lease: Sendable {
        let id: UInt64
        let owner: Writer
        /// Seconds (nil: bound to `connection`).
        let ttl: Int64?
        let connection: ConnectionID?
        /// When it expires (monotonic nanoseconds), for a lease with a TTL.
        var deadline: UInt64
        var keys: [String: Set<Key>] = [:]
    }

    private struct State: Sendable {
        var leases: [UInt64: Lease] = [:]
        var nextID: UInt64 = 1
        var perUID: [UInt32: Int] = [:]
        /// Deadlines of leases with a TTL (a heap; stale entries skipped).
        var deadlines = Heap<Deadline>()
        var byConnection: [ConnectionID: Set<UInt64>] = [:]
    }

    private let state = Mutex(State())
    /// Where grants, ends and attachments persist (nil: in memory only).
    let journal: LeaseJournal?

    /// A table whose ids continue after `nextID` (ids are never reused while data persists),
    /// recording what happens to `journal`.
    init(nextID: UInt64 = 1, journal: LeaseJournal? = nil) {
        self.journal = journal
        state.withLock { $0.nextID = max(1, nextID) }
    }

    /// The next id a grant would hand out (persisted with the data, so ids are never reused).
    var nextID: UInt64 { state.withLock { $0.nextID } }

    /// Live leases, for `stats`.
    var count: Int { state.withLock { $0.leases.count } }

    // MARK: Granting, keeping alive

    /// Grants a lease to `owner` — with `ttl` seconds, or bound to `connection` — unless its
    /// uid (any uid, root's too: the contract bounds every uid) already holds `limit`.
    /// Under `sync = always` the grant is synced to the journal before this returns — after
    /// the table's lock is released, so the other loops' lease operations and the writes that
    /// attach keys do not wait for the disk; a grant whose sync fails is taken back.
    func grant(owner: Writer, ttl: Int64?, connection: ConnectionID, now: UInt64, limit: Int) -> Result<UInt64, LeaseRefusal> {
        var syncPoint: UInt64? = nil
        let granted = state.withLock { (s) -> Result<UInt64, LeaseRefusal> in
            if s.perUID[owner.uid, default: 0] >= limit { return .failure(.tooMany(limit: limit)) }
            let id = s.nextID
            if let journal {
                compactIfDue(&s, journal)
                do throws(StorageError) {
                    syncPoint = try journal.granted(PersistedLeases.Lease(id: id, owner: owner, ttl: ttl))
                } catch {
                    return .failure(.unavailable(error.description))
                }
            }
            s.nextID += 1
            let deadline = ttl.map { now &+ UInt64($0) * 1_000_000_000 } ?? .max
            s.leases[id] = Lease(id: id, owner: owner, ttl: ttl, connection: ttl == nil ? connection : nil, deadline: deadline)
            s.perUID[owner.uid, default: 0] += 1
            if ttl == nil {
                s.byConnection[connection, default: []].insert(id)
            } else {
                s.deadlines.insert(Deadline(time: deadline, id: id))
            }
            return .success(id)
        }
        guard case .success(let id) = granted, let journal, let syncPoint else { return granted }
        do throws(StorageError) {
            try journal.sync(through: syncPoint)
        } catch {
            // Not answered, so no client holds it: it ends here (its deadline, if any, finds
            // it gone), and the journal says so for a restart that finds its grant.
            _ = state.withLock { s in end(&s, id, .revoked) }
            return .failure(.unavailable(error.description))
        }
        return .success(id)
    }

    /// Starts lease `id`'s TTL again in full; its TTL (nil: bound to its connection).
    func keepAlive(_ id: UInt64, by peer: Peer, now: UInt64) -> Result<Int64?, LeaseRefusal> {
        state.withLock { s in
            guard var lease = s.leases[id] else { return .failure(.notFound(id)) }
            if let refusal = Self.refusal(lease, peer) { return .failure(refusal) }
            if let ttl = lease.ttl {
                lease.deadline = now &+ UInt64(ttl) * 1_000_000_000
                s.leases[id] = lease
                s.deadlines.insert(Deadline(time: lease.deadline, id: id))
            }
            return .success(lease.ttl)
        }
    }

    /// Whether `peer` may name lease `id` in a write (nil: yes).
    func check(_ id: UInt64, by peer: Peer) -> LeaseRefusal? {
        state.withLock { s in
            guard let lease = s.leases[id] else { return .notFound(id) }
            return Self.refusal(lease, peer)
        }
    }

    private static func refusal(_ lease: Lease, _ peer: Peer) -> LeaseRefusal? {
        lease.owner.uid == peer.uid || peer.uid == 0 ? nil : .forbidden(lease.id, owner: lease.owner.uid)
    }

    // MARK: Attachments (under the repository's lock)

    /// Key `key` of `repo` is now attached to `lease` (nil: to none), and no longer to `previous`.
    func move(_ key: Key, of repo: String, from previous: UInt64?, to lease: UInt64?) {
        guard previous != lease else { return }
        state.withLock { s in
            if let journal {
                // Rewritten first, if due: a rewrite holds the table's state, not this move yet.
                compactIfDue(&s, journal)
                journal.attached(key, of: repo, to: lease)
            }
            if let previous, s.leases[previous] != nil {
                s.leases[previous]!.keys[repo]?.remove(key)
                if s.leases[previous]!.keys[repo]?.isEmpty == true { s.leases[previous]!.keys[repo] = nil }
            }
            if let lease, s.leases[lease] != nil { s.leases[lease]!.keys[repo, default: []].insert(key) }
        }
    }

    // MARK: Ending

    /// Ends lease `id` (`revoke`), if `peer` may: what it held.
    func revoke(_ id: UInt64, by peer: Peer) -> Result<EndedLease, LeaseRefusal> {
        state.withLock { s in
            guard let lease = s.leases[id] else { return .failure(.notFound(id)) }
            if let refusal = Self.refusal(lease, peer) { return .failure(refusal) }
            return .success(self.end(&s, id, .revoked)!)
        }
    }

    /// Ends the leases bound to `connection` (it closed).
    func connectionClosed(_ connection: ConnectionID) -> [EndedLease] {
        state.withLock { s in
            guard let ids = s.byConnection.removeValue(forKey: connection) else { return [] }
            return ids.sorted().compactMap { self.end(&s, $0, .closed) }
        }
    }

    /// Ends the leases whose deadline passed by `now`.
    func expire(now: UInt64) -> [EndedLease] {
        state.withLock { s in
            var ended: [EndedLease] = []
            while let top = s.deadlines.min, top.time <= now {
                s.deadlines.removeMin()
                guard let lease = s.leases[top.id], lease.deadline == top.time else { continue }  // kept alive since, or ended
                if let end = self.end(&s, top.id, .expired) { ended.append(end) }
            }
            return ended
        }
    }

    /// The earliest deadline of a lease with a TTL, if any.
    var nextDeadline: UInt64? {
        state.withLock { s in
            while let top = s.deadlines.min, s.leases[top.id]?.deadline != top.time { s.deadlines.removeMin() }
            return s.deadlines.min?.time
        }
    }

    private func end(_ s: inout State, _ id: UInt64, _ end: LeaseEnd.Reason) -> EndedLease? {
        guard let lease = s.leases.removeValue(forKey: id) else { return nil }
        journal?.ended(id, SharedLeaseReason(end))
        let left = s.perUID[lease.owner.uid, default: 1] - 1
        s.perUID[lease.owner.uid] = left > 0 ? left : nil
        if let connection = lease.connection {
            s.byConnection[connection]?.remove(id)
            if s.byConnection[connection]?.isEmpty == true { s.byConnection[connection] = nil }
        }
        return EndedLease(id: id, owner: lease.owner, end: end, keys: lease.keys)
    }
}

extension LeaseTable {
    // MARK: Persistence

    /// Rewrites the journal from this table when it asks to be (grown, or a write failed).
    private func compactIfDue(_ s: inout State, _ journal: LeaseJournal) {
        guard journal.wantsCompaction else { return }
        do throws(StorageError) {
            try journal.compact(live: Self.persisted(s), attachments: Self.attachments(s), nextID: s.nextID)
        } catch {
            // The journal logged it; grants are refused until a rewrite succeeds.
        }
    }

    /// Rewrites the journal now (start-up, once the restart's deletions were made).
    func compactJournal(keeping deletions: [PersistedLeases.Deletion]) throws(StorageError) {
        guard let journal else { return }
        try state.withLock { s throws(StorageError) in
            try journal.compact(live: Self.persisted(s), attachments: Self.attachments(s), nextID: s.nextID, deletions: deletions)
        }
    }

    private static func persisted(_ s: borrowing State) -> [PersistedLeases.Lease] {
        s.leases.values.map { PersistedLeases.Lease(id: $0.id, owner: $0.owner, ttl: $0.ttl) }
    }

    private static func attachments(_ s: borrowing State) -> [(repo: String, key: Key, lease: UInt64)] {
        s.leases.values.sorted { $0.id < $1.id }.flatMap { lease in
            lease.keys.sorted { $0.key < $1.key }.flatMap { repo, keys in keys.sorted().map { (repo, $0, lease.id) } }
        }
    }

    /// Takes the leases with a TTL a restart found, each TTL starting again in full from
    /// `now`, with their keys (repository → keys); ids continue after `nextID`.
    func restore(_ leases: [PersistedLeases.Lease], keys: [UInt64: [String: Set<Key>]], nextID: UInt64, now: UInt64) {
        state.withLock { s in
            s.nextID = max(s.nextID, nextID)
            for lease in leases {
                guard let ttl = lease.ttl else { continue }
                let deadline = now &+ UInt64(ttl) * 1_000_000_000
                s.leases[lease.id] = Lease(id: lease.id, owner: lease.owner, ttl: ttl, connection: nil, deadline: deadline, keys: keys[lease.id] ?? [:])
                s.perUID[lease.owner.uid, default: 0] += 1
                s.deadlines.insert(Deadline(time: deadline, id: lease.id))
            }
        }
    }
}

extension SharedLeaseReason {
    init(_ reason: LeaseEnd.Reason) {
        switch reason {
        case .expired: self = .expired
        case .revoked: self = .revoked
        default: self = .closed
        }
    }
}

extension LeaseRefusal {
    /// The error reply for it.
    var protocolError: ProtocolError {
        switch self {
        case .notFound(let id): ProtocolError(.notFound, "lease \(id) does not exist (it ended, or was never granted)")
        case .forbidden(let id, let owner): ProtocolError(.forbidden, "lease \(id) belongs to uid \(owner)")
        case .tooMany(let limit): ProtocolError(.overloaded, "this uid holds \(limit) leases, the limit (limits.max-leases-per-uid): revoke some first")
        case .unavailable(let why): ProtocolError(.internal, "the lease could not be stored: \(why)")
        }
    }
}
