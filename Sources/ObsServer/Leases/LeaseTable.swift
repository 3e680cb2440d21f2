// ObsServer — leases: keys that live as long as their owner (the contract's "Keys with a
// lifetime"). This table owns who holds which lease, their TTL deadlines, and in which
// repositories each may have keys; the repositories own which keys are attached to which
// lease (`RepositoryCore`), moved under their own locks by the writes that name a lease.
//
// A lease granted without a TTL is bound to its connection and ends when that connection
// closes; one with a TTL ends when its deadline passes without a keep-alive. Every grant and
// every end is a frame of the write-ahead log, in the same durable sequence as the revisions
// that attach keys to it (ObsStore LogFrame.swift): a grant is answered once its frame is
// durable, and a restart derives the table from what the log and the snapshot hold.
//
// A write that names a lease checks it here — and records its repository in the lease —
// under one lock, while it holds its repository's lock: so either the lease ends first (the
// write is `not_found`) or its end finds the repository, and, taking that repository's lock
// after the write, the key the write attached (LeaseEnds.swift).
//
// Deadlines sit in a heap with at most one entry per lease: a keep-alive moves the lease's
// deadline only, and an entry that comes up early is pushed again at the deadline it finds —
// so millions of keep-alives cost no memory, and an idle lease costs nothing until it is due.

import HeapModule
import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit

/// Why a lease operation or a write naming a lease was refused.
enum LeaseRefusal: Error, Sendable, Equatable {
    case notFound(UInt64)
    case forbidden(UInt64, owner: UInt32)
    case tooMany(limit: Int)
    /// Storage takes no more changes (the daemon is stopping).
    case unavailable(String)

    /// The rule of who may name a live lease (keep it alive, revoke it, attach keys to it),
    /// whoever keeps the leases: its owner's uid, or uid 0. Nil if `peer` may name lease `id`
    /// of `owner`.
    static func naming(_ id: UInt64, owner: Writer, by peer: Peer) -> LeaseRefusal? {
        owner.uid == peer.uid || peer.uid == 0 ? nil : .forbidden(id, owner: owner.uid)
    }
}

/// A lease that ended: whose it was, why, the repositories where it may hold keys (each
/// deletes those still attached to it), and the table's state that records its end (nil:
/// none was recorded — storage is closed, or the end was known already).
struct EndedLease: Sendable {
    let id: UInt64
    let owner: Writer
    let end: LeaseEnd.Reason
    let repos: Set<String>
    var sequence: StateSequence? = nil
}

final class LeaseTable: DurabilityListener, DurableLine, Sendable {
    struct Lease: Sendable {
        let id: UInt64
        let owner: Writer
        /// Seconds (nil: bound to `connection`).
        let ttl: Int64?
        let connection: ConnectionID?
        /// When it expires (monotonic nanoseconds), for a lease with a TTL; `.max` until the
        /// clocks start (`startClocks`).
        var deadline: UInt64
        /// The repositories where a write attached a key to it.
        var repos: Set<String> = []
    }

    /// A frame not yet durable: what to do if storage fails it.
    private enum Unconfirmed: Sendable {
        /// A grant, not answered yet: the lease ends.
        case grant(UInt64)
        /// An end: it stands, and its frame is written again.
        case end(UInt64, LeaseEnd.Reason, Writer)
    }

    private struct State: Sendable {
        var leases: [UInt64: Lease] = [:]
        var nextID: UInt64 = 1
        var perUID: [UInt32: Int] = [:]
        /// Deadlines of leases with a TTL: at most one entry per lease (see the header).
        var deadlines = Heap<Deadline>()
        var byConnection: [ConnectionID: Set<UInt64>] = [:]
        /// Leases that ended lately, why and whose, oldest first in `endedOrder` (a key an undo
        /// attached to one again is deleted with that reason).
        var ended: [UInt64: PersistedLeases.Ended] = [:]
        var endedOrder: [UInt64] = []
        var endedHead = 0
        var ledger = DurabilityLedger()
        var unconfirmed: [(sequence: StateSequence, frame: Unconfirmed)] = []
    }

    /// How many ended leases the table remembers.
    static let endsRemembered = 65_536

    private let state = Locked(State())
    private let marks = DurabilityMarks()
    private let storage: any Storage
    let lineID = LineIDs.next()
    var subject: String { "the lease table" }
    /// Told (outside the lock, from the thread that commits) what storage failed: grants
    /// taken back — those leases ended — and ends whose frames must be written again.
    private let onFailure: Locked<(@Sendable (_ ended: [EndedLease], _ rewrite: [(UInt64, LeaseEnd.Reason, Writer)]) -> Void)?>

    /// A table whose grants and ends go to `storage`.
    init(storage: any Storage) {
        self.storage = storage
        self.onFailure = Locked(nil)
    }

    /// Sets what is told of frames storage failed (the hub, once).
    func whenStorageFails(_ handler: @escaping @Sendable (_ ended: [EndedLease], _ rewrite: [(UInt64, LeaseEnd.Reason, Writer)]) -> Void) {
        onFailure.withLock { $0 = handler }
    }

    /// The next id a grant would hand out (ids are never reused while data persists).
    var nextID: UInt64 { state.withLock { $0.nextID } }

    /// Live leases, for `stats`.
    var count: Int { state.withLock { $0.leases.count } }

    /// Entries in the deadline heap (at most one per lease with a TTL; tests look).
    var deadlineEntries: Int { state.withLock { $0.deadlines.count } }

    // MARK: Granting, keeping alive

    /// Grants a lease to `owner` — with `ttl` seconds, or bound to `connection` — unless its
    /// uid (any uid, root's too: the contract bounds every uid) already holds `limit`. The
    /// grant is answered once the table's state `sequence` is durable.
    func grant(owner: Writer, ttl: Int64?, connection: ConnectionID, now: UInt64, limit: Int) -> Result<
        (id: UInt64, sequence: StateSequence), LeaseRefusal
    > {
        state.withLock { s in
            if s.perUID[owner.uid, default: 0] >= limit { return .failure(.tooMany(limit: limit)) }
            let id = s.nextID
            guard let sequence = record(&s, .leaseGranted(PersistedLeases.Lease(id: id, owner: owner, ttl: ttl)), .grant(id)) else {
                return .failure(.unavailable("the daemon is stopping and takes no more leases"))
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
            return .success((id, sequence))
        }
    }

    /// Starts lease `id`'s TTL again in full; its TTL (nil: bound to its connection).
    func keepAlive(_ id: UInt64, by peer: Peer, now: UInt64) -> Result<Int64?, LeaseRefusal> {
        state.withLock { s in
            guard let lease = s.leases[id] else { return .failure(.notFound(id)) }
            if let refusal = Self.refusal(lease, peer) { return .failure(refusal) }
            if let ttl = lease.ttl {
                // Its heap entry stays: coming up before this deadline, it is pushed again.
                s.leases[id]!.deadline = now &+ UInt64(ttl) * 1_000_000_000
            }
            return .success(lease.ttl)
        }
    }

    /// Whether `peer` may name lease `id` in a write to repository `repo` (nil: yes — and the
    /// lease now knows it may hold keys there). Called with that repository's lock held.
    func admit(_ id: UInt64, by peer: Peer, into repo: String) -> LeaseRefusal? {
        state.withLock { s in
            guard let lease = s.leases[id] else { return .notFound(id) }
            if let refusal = Self.refusal(lease, peer) { return refusal }
            if !lease.repos.contains(repo) { s.leases[id]!.repos.insert(repo) }
            return nil
        }
    }

    /// Whether lease `id` is live.
    func isLive(_ id: UInt64) -> Bool { state.withLock { $0.leases[id] != nil } }

    /// Why lease `id` ended and whose it was, if it ended lately (nil: live, or long gone).
    func endOf(_ id: UInt64) -> PersistedLeases.Ended? { state.withLock { $0.ended[id] } }

    private static func refusal(_ lease: Lease, _ peer: Peer) -> LeaseRefusal? {
        LeaseRefusal.naming(lease.id, owner: lease.owner, by: peer)
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
                guard let lease = s.leases[top.id] else { continue }  // ended since
                if lease.deadline > now {
                    s.deadlines.insert(Deadline(time: lease.deadline, id: lease.id))  // kept alive since
                } else if let end = self.end(&s, top.id, .expired) {
                    ended.append(end)
                }
            }
            return ended
        }
    }

    /// The earliest deadline in the heap, if any (it may be a lease's earlier one, which
    /// `expire` then pushes again).
    var nextDeadline: UInt64? {
        state.withLock { s in
            while let top = s.deadlines.min, s.leases[top.id] == nil { s.deadlines.removeMin() }
            return s.deadlines.min?.time
        }
    }

    /// Ends lease `id`, recording its end in storage unless `recording` is false.
    private func end(_ s: inout State, _ id: UInt64, _ end: LeaseEnd.Reason, recording: Bool = true) -> EndedLease? {
        guard let lease = s.leases.removeValue(forKey: id) else { return nil }
        let left = s.perUID[lease.owner.uid, default: 1] - 1
        s.perUID[lease.owner.uid] = left > 0 ? left : nil
        if let connection = lease.connection {
            s.byConnection[connection]?.remove(id)
            if s.byConnection[connection]?.isEmpty == true { s.byConnection[connection] = nil }
        }
        remember(&s, id, PersistedLeases.Ended(reason: end, owner: lease.owner))
        let sequence = recording ? record(&s, .leaseEnded(id: id, reason: end, owner: lease.owner), .end(id, end, lease.owner)) : nil
        return EndedLease(id: id, owner: lease.owner, end: end, repos: lease.repos, sequence: sequence)
    }

    private func remember(_ s: inout State, _ id: UInt64, _ ended: PersistedLeases.Ended) {
        s.ended[id] = ended
        s.endedOrder.append(id)
        if s.endedOrder.count - s.endedHead > Self.endsRemembered {
            s.ended[s.endedOrder[s.endedHead]] = nil
            s.endedHead += 1
            if s.endedHead >= 4096 {
                s.endedOrder.removeFirst(s.endedHead)
                s.endedHead = 0
            }
        }
    }

    // MARK: Durability

    /// Hands `frame` to storage as the table's next state; its sequence (nil: storage is closed).
    private func record(_ s: inout State, _ frame: LogFrame, _ unconfirmed: Unconfirmed) -> StateSequence? {
        guard storage.append(frame, sequence: s.ledger.next, listener: self) else { return nil }
        let sequence = s.ledger.apply(durable: storage.isImmediate, marks: marks)
        if !storage.isImmediate { s.unconfirmed.append((sequence, unconfirmed)) }
        return sequence
    }

    /// Writes the frames of ends storage failed again (a second after the failure).
    func rewriteEnds(_ ends: [(UInt64, LeaseEnd.Reason, Writer)]) {
        state.withLock { s in
            for (id, reason, owner) in ends { _ = record(&s, .leaseEnded(id: id, reason: reason, owner: owner), .end(id, reason, owner)) }
        }
    }

    func isDurable(_ sequence: StateSequence) -> Bool {
        if let known = marks.knownDurable(sequence) { return known }
        return state.withLock { s in !s.ledger.wasUndone(sequence) }
    }

    func awaitDurable(_ sequence: StateSequence, on shard: LoopShard) -> Durability {
        if marks.knownDurable(sequence) == true { return .durable }
        return state.withLock { s in s.ledger.await(sequence, on: shard, marks: marks) }
    }

    func durable(through sequence: UInt64) {
        state.withLock { s in confirm(&s, through: sequence) }
    }

    func failed(after sequence: UInt64, error: StorageError) {
        let (ended, rewrite) = state.withLock { s -> ([EndedLease], [(UInt64, LeaseEnd.Reason, Writer)]) in
            confirm(&s, through: sequence)
            let failed = s.unconfirmed
            s.unconfirmed = []
            storage.discard(self, after: sequence)
            s.ledger.undoPending(error, marks: marks, line: self)
            var ended: [EndedLease] = []
            var rewrite: [(UInt64, LeaseEnd.Reason, Writer)] = []
            for (_, frame) in failed {
                switch frame {
                case .grant(let id):
                    // Not answered: no client holds it. It ends — its end written later, so
                    // its id is never handed out again — and any key attached to it goes.
                    if let end = self.end(&s, id, .revoked, recording: false) {
                        ended.append(end)
                        rewrite.append((id, .revoked, end.owner))
                    }
                case .end(let id, let reason, let owner):
                    rewrite.append((id, reason, owner))
                }
            }
            return (ended, rewrite)
        }
        if let handler = onFailure.withLock({ $0 }) { handler(ended, rewrite) }
    }

    private func confirm(_ s: inout State, through sequence: StateSequence) {
        let n = s.ledger.durableCount(through: sequence)
        guard n > 0 else { return }
        s.unconfirmed.removeAll { $0.sequence <= sequence }
        s.ledger.confirm(n, marks: marks, line: self)
    }

    // MARK: Start-up

    /// Takes the leases storage kept (`persisted`) and where keys are attached to each
    /// (`repos`: lease → repositories): leases with a TTL live on — their clocks start with
    /// `startClocks` — and every other lease some key is attached to has ended: a
    /// connection-bound one now (`closed`, recorded), one that ended before with the reason
    /// it ended for, one storage never recorded as `closed`. Returns those ended leases,
    /// whose keys are owed a deletion. Ids continue after the highest stored.
    func restore(_ persisted: PersistedLeases, repos: [UInt64: Set<String>]) -> [EndedLease] {
        state.withLock { s in
            s.nextID = max(s.nextID, persisted.nextID)
            for (id, ended) in persisted.ended { remember(&s, id, ended) }
            var owed: [EndedLease] = []
            for lease in persisted.live.values.sorted(by: { $0.id < $1.id }) {
                s.nextID = max(s.nextID, lease.id + 1)
                guard let ttl = lease.ttl else {
                    // Bound to a connection of the daemon that stopped: it ended with it.
                    let reason = LeaseEnd.Reason.closed
                    remember(&s, lease.id, PersistedLeases.Ended(reason: reason, owner: lease.owner))
                    let sequence = record(&s, .leaseEnded(id: lease.id, reason: reason, owner: lease.owner), .end(lease.id, reason, lease.owner))
                    owed.append(EndedLease(id: lease.id, owner: lease.owner, end: .closed, repos: repos[lease.id] ?? [], sequence: sequence))
                    continue
                }
                s.leases[lease.id] = Lease(id: lease.id, owner: lease.owner, ttl: ttl, connection: nil, deadline: .max, repos: repos[lease.id] ?? [])
                s.perUID[lease.owner.uid, default: 0] += 1
            }
            for (id, keysIn) in repos.sorted(by: { $0.key < $1.key }) where persisted.live[id] == nil {
                s.nextID = max(s.nextID, id + 1)
                let ended = persisted.ended[id] ?? PersistedLeases.Ended(reason: .closed, owner: Writer(uid: 0, gid: 0, pid: 0))
                owed.append(EndedLease(id: id, owner: ended.owner, end: ended.reason, repos: keysIn))
            }
            return owed
        }
    }

    /// Starts the TTL of every lease restored at start-up, in full from `now` — the moment
    /// the daemon serves.
    func startClocks(now: UInt64) {
        state.withLock { s in
            for (id, lease) in s.leases where lease.deadline == .max {
                guard let ttl = lease.ttl else { continue }
                s.leases[id]!.deadline = now &+ UInt64(ttl) * 1_000_000_000
                s.deadlines.insert(Deadline(time: s.leases[id]!.deadline, id: id))
            }
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
        case .unavailable(let why): ProtocolError(.internal, why)
        }
    }
}
