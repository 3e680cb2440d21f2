// ObsServer — one repository as the daemon serves it: its value core (ObsCore) under a lock,
// the loops with subscribers to it, and which of its states may be shown.
//
// A revision is applied in memory at once — later writes are planned against it — and shown
// to nobody (no event, no reply that reports it) until it is durable; then its record is
// posted to every loop with subscribers. The sequencer decides writes (Sequencer.swift); this
// type keeps the state and publishes what is decided. A state is named by a sequence number
// (`StateSequence`), one per revision applied, never reused after an undo, so a reply computed
// from undone state can always be recognised.
//
// Subscribing happens under the same lock as writing, so a subscription's snapshot or replay
// and its live events meet at exactly one revision.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// Identifies the state a reply was computed from (see the file header).
typealias StateSequence = UInt64

/// Whether the state a reply reports may be shown.
enum Durability {
    case durable
    /// The loop that asked will be told (`DurabilityNews`).
    case pending
    /// The state was undone after a storage failure.
    case failed(StorageError)
}

final class Repository: DurabilityListener, Sendable {
    let name: String
    /// The name's UTF-8 bytes (compared with a request's in place).
    private let nameUTF8: [UInt8]
    /// Never reused in this process (loops route by it).
    let id: UInt64
    let epoch: String

    struct State: Sendable {
        var core: RepositoryCore
        /// Sequences handed out so far: one per revision applied, undone ones included.
        var applied: StateSequence = 0
        /// The sequence of the current state (after an undo: the durable state's).
        var current: StateSequence = 0
        /// Sequences of pending revisions, oldest first (their states become durable in order).
        var pendingSequences: [(revision: UInt64, sequence: StateSequence)] = []
        /// Sequences of states undone after storage failures; ascending, disjoint.
        var undone: [ClosedRange<StateSequence>] = []
        var lastFailure: StorageError? = nil
        /// Loops with subscribers to this repository, and how many each has.
        var subscriberLoops: [(shard: LoopShard, count: Int)] = []
        /// Loops that have waited for a state of this repository to be durable.
        var waitingLoops: [LoopShard] = []
        /// Pending revisions that are a lease's end (its deletions), oldest first: one undone
        /// is made again (`leaseEndUndone`).
        var leaseEnds: [(revision: UInt64, ended: EndedLease)] = []
    }

    private let state: Mutex<State>
    /// The sequence of the latest durable state; readable without the lock.
    private let durableSequence = Atomic<StateSequence>(0)
    /// The highest sequence ever undone (0: none); readable without the lock.
    private let undoneCeiling = Atomic<StateSequence>(0)
    /// Subscriptions of every loop; readable without the lock.
    private let subscribers = Atomic<Int>(0)
    /// Loaded from storage, or written in this process (even if storage undid it since): the
    /// hub never drops it. Set once, never cleared.
    private let permanent = Atomic<Bool>(false)

    /// The store its revisions are handed to (for `discard` after an undo), and the counters
    /// of repositories that exist.
    private let storage: any Storage
    private let stats: ServerStats
    /// The daemon's leases, told when an undo moves keys back between them (none: a shared
    /// store, whose attachments come decided with its revisions).
    private let leases: LeaseTable?
    /// Called (outside the lock) with a lease's end whose deletion storage failed and this
    /// repository undid: its keys are attached to the lease again, to be deleted again.
    private let leaseEndUndone: @Sendable (EndedLease) -> Void

    private static let ids = Atomic<UInt64>(0)

    init(
        name: String, epoch: String, historyLimits: HistoryLimits, loaded: LoadedRepository? = nil, storage: any Storage, stats: ServerStats,
        leases: LeaseTable? = nil, leaseEndUndone: @escaping @Sendable (EndedLease) -> Void = { _ in }
    ) {
        self.name = name
        self.nameUTF8 = Array(name.utf8)
        self.storage = storage
        self.stats = stats
        self.leases = leases
        self.leaseEndUndone = leaseEndUndone
        self.id = Self.ids.add(1, ordering: .relaxed).newValue
        self.epoch = loaded?.epoch ?? epoch
        self.state = Mutex(State(core: RepositoryCore(name: name, epoch: loaded?.epoch ?? epoch, historyLimits: historyLimits, loaded: loaded)))
        if loaded != nil { permanent.store(true, ordering: .relaxed) }
    }

    /// Runs `body` with the state under the lock (the sequencers plan and commit there).
    /// Inlined: as a call, its closure's captures (the sequencer, the repository) were
    /// retained and released around it on every write.
    @inline(__always)
    func withState<R, E: Error>(_ body: (inout State) throws(E) -> R) throws(E) -> R {
        try state.withLock { (s) throws(E) -> R in try body(&s) }
    }

    // MARK: Reading

    /// The current revision, the number of keys, and the state they are of (a reply reporting them
    /// waits until it is durable).
    var summary: (revision: UInt64, keys: Int, sequence: StateSequence) {
        state.withLock { ($0.core.revision, $0.core.count, $0.current) }
    }
    var revision: UInt64 { state.withLock { $0.core.revision } }
    var isPermanent: Bool { permanent.load(ordering: .acquiring) }
    var subscriberCount: Int { subscribers.load(ordering: .relaxed) }

    /// Whether `bytes` are this repository's name.
    func hasName(_ bytes: UnsafeRawBufferPointer) -> Bool {
        nameUTF8.withUnsafeBytes { $0.count == bytes.count && (bytes.isEmpty || memcmp($0.baseAddress!, bytes.baseAddress!, bytes.count) == 0) }
    }

    /// The hub keeps this repository for good (it has, or had, a revision).
    func makePermanent() { permanent.store(true, ordering: .releasing) }

    /// The key's entry, and the state it was read from.
    func get(_ key: Key) -> (entry: Entry<CanonicalJSON>?, sequence: StateSequence) {
        state.withLock { ($0.core[key], $0.current) }
    }

    /// The keys with a prefix (all: nil) and their values, unsorted, at the current revision.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: CanonicalJSON)], sequence: StateSequence) {
        state.withLock { s in (s.core.revision, s.core.entries(.prefix(prefix ?? "")), s.current) }
    }

    /// The lease `key` is attached to, if any.
    func lease(of key: Key) -> UInt64? { state.withLock { $0.core.lease(of: key) } }

    /// The current state, for replies that report it (a conflict, say).
    var sequence: StateSequence { state.withLock { $0.current } }

    // MARK: Publishing (under the lock)

    /// A revision was applied: names its state; `durable` if it may be shown at once.
    static func applied(_ s: inout State, revision: UInt64, durable: Bool, on repository: Repository) -> StateSequence {
        s.applied += 1
        s.current = s.applied
        if durable {
            repository.durableSequence.store(s.applied, ordering: .releasing)
        } else {
            s.pendingSequences.append((revision, s.applied))
        }
        return s.applied
    }

    /// Posts a durable revision to the loops with subscribers. Under the lock, so each loop
    /// sees this repository's revisions in order.
    static func publish(_ view: RevisionView, to loops: [(shard: LoopShard, count: Int)], of repository: Repository) {
        for loop in loops { loop.shard.post(view, of: repository, weight: loop.count) }
    }

    // MARK: Durability

    /// Whether the state `sequence` is durable.
    func isDurable(_ sequence: StateSequence) -> Bool {
        if durableSequence.load(ordering: .acquiring) < sequence { return false }
        if sequence > undoneCeiling.load(ordering: .acquiring) { return true }
        return state.withLock { s in !s.undone.contains { $0.contains(sequence) } }
    }

    /// Whether the state `sequence` may be shown; if it is not durable yet, `shard` is told
    /// once it is — or once it is undone — and holds the reply meanwhile.
    func awaitDurable(_ sequence: StateSequence, on shard: LoopShard) -> Durability {
        if durableSequence.load(ordering: .acquiring) >= sequence, sequence > undoneCeiling.load(ordering: .acquiring) {
            return .durable
        }
        return state.withLock { s in
            if s.undone.contains(where: { $0.contains(sequence) }), let failure = s.lastFailure { return .failed(failure) }
            if durableSequence.load(ordering: .relaxed) >= sequence { return .durable }
            if !s.waitingLoops.contains(where: { $0 === shard }) { s.waitingLoops.append(shard) }
            return .pending
        }
    }

    // Storage's news comes from its committer thread, which calls these directly: the lock is
    // held for microseconds (the records are published to the loops' inboxes under it), and a
    // hop through an event loop would add a thread switch to every durable write's path.

    /// Every revision up to `revision` is durable: shows them, and tells the waiting loops.
    func durable(through revision: UInt64) {
        state.withLock { s in confirm(&s, through: revision) }
    }

    /// Storage kept the revisions up to `revision` and never will keep the others: undoes them.
    func failed(after revision: UInt64, error: StorageError) {
        let undoneEnds = state.withLock { s -> [EndedLease] in
            confirm(&s, through: revision)
            let (_, removedFirst, movedBack) = s.core.undo(after: revision)
            if removedFirst { stats.repositories.subtract(1, ordering: .relaxed) }
            for move in movedBack { leases?.move(move.key, of: name, from: move.from, to: move.to) }
            let undoneEnds = s.leaseEnds.filter { $0.revision > revision }.map(\.ended)
            if !undoneEnds.isEmpty { s.leaseEnds.removeAll { $0.revision > revision } }
            s.pendingSequences.removeAll { $0.revision > revision }
            // Under the lock: a revision written after this undo reuses those numbers, and the
            // store must not drop it as one of the undone.
            storage.discard(self, after: revision)
            // Every state after the durable one is gone, including those reported by no-op
            // writes and reads; what remains is the durable state itself.
            let durable = durableSequence.load(ordering: .relaxed)
            guard s.applied > durable else { return undoneEnds }
            let gone = (durable + 1)...s.applied
            if let last = s.undone.last, last.lowerBound == gone.lowerBound {
                s.undone[s.undone.count - 1] = gone
            } else {
                s.undone.append(gone)
            }
            undoneCeiling.store(s.applied, ordering: .releasing)
            s.current = durable
            s.lastFailure = error
            // Exactly these states are gone: a loop may already hold replies of later ones
            // (written after this undo, before the loop hears of it), which stand.
            for shard in s.waitingLoops { shard.post(.failed(self, undone: gone, error)) }
            return undoneEnds
        }
        for ended in undoneEnds { leaseEndUndone(ended) }
    }

    private func confirm(_ s: inout State, through revision: UInt64) {
        let loops = s.subscriberLoops
        let confirmed = s.core.confirm(through: revision) { view in Self.publish(view, to: loops, of: self) }
        guard confirmed > 0 else { return }
        if !s.leaseEnds.isEmpty { s.leaseEnds.removeAll { $0.revision <= revision } }
        let durable = s.pendingSequences[confirmed - 1].sequence
        s.pendingSequences.removeFirst(confirmed)
        durableSequence.store(durable, ordering: .releasing)
        for shard in s.waitingLoops { shard.post(.durable(self, through: durable)) }
    }

    /// Installs revisions a shared store decided (every daemon's, in the store's order) and
    /// publishes them; each names who wrote it (`origin`: a connection of this daemon, or 0)
    /// and carries `tail` (a lease's end) in its event. Then applies the lease attachments
    /// the store delivered with them (`replacing`: every attachment); returns the moves.
    @discardableResult
    func install(
        _ revisions: [(record: RevisionRecord, origin: UInt64, tail: [UInt8])], attachments: [SharedAttachment] = [], replacing: Bool = false
    ) -> [(key: Key, from: UInt64?, to: UInt64?)] {
        state.withLock { s in
            let loops = s.subscriberLoops
            for (record, origin, tail) in revisions {
                let info = RevisionInfo(revision: record.revision, time: record.time, writer: record.writer, origin: origin, weight: record.byteSize)
                guard s.core.install(record.changes, info: info, tail: tail) else { continue }
                _ = Self.applied(&s, revision: record.revision, durable: true, on: self)
                if record.revision == 1 {
                    stats.repositories.add(1, ordering: .relaxed)
                    makePermanent()
                }
                if !loops.isEmpty { s.core.withLastRecord { Self.publish($0, to: loops, of: self) } }
            }
            var moves: [(key: Key, from: UInt64?, to: UInt64?)] = []
            if replacing {
                let listed = Set(attachments.map(\.key))
                for (key, lease) in s.core.attachments where !listed.contains(key) {
                    s.core.setAttachment(key, to: nil)
                    moves.append((key, lease, nil))
                }
            }
            for attachment in attachments {
                let from = s.core.setAttachment(attachment.key, to: attachment.lease)
                if from != attachment.lease { moves.append((attachment.key, from, attachment.lease)) }
            }
            return moves
        }
    }

    // MARK: Subscribing

    /// Starts `subscription` for `request`: takes what it starts with and — unless its one
    /// `once` change is in the replay, or its connection closed — makes it live and routes
    /// it on its loop, all under the lock, so its start and its first event meet at one
    /// revision.
    func subscribe(_ subscription: Subscription, _ request: SubscribeRequest, now: Int64) throws(RepositoryCore.StartRefusal) -> (
        start: RepositoryCore.Start, sequence: StateSequence, registered: Bool
    ) {
        try state.withLock { (s) throws(RepositoryCore.StartRefusal) in
            // No cap on the replay's size: a large one is streamed (Session+Subscribe.swift).
            let start = try s.core.start(request, sub: subscription.id, skipOrigin: subscription.skippedOrigin, now: now, maxReplayBytes: .max)
            let live = !(request.once && start.replayed > 0) && subscription.connection.outbox.register(subscription)
            if live {
                subscription.after = start.revision
                subscription.completeThrough = start.revision
                let shard = subscription.connection.shard
                shard.route(subscription)
                if let i = s.subscriberLoops.firstIndex(where: { $0.shard === shard }) {
                    s.subscriberLoops[i].count += 1
                } else {
                    s.subscriberLoops.append((shard, 1))
                }
                subscribers.add(1, ordering: .relaxed)
            }
            return (start, s.current, live)
        }
    }

    /// A subscription on `shard` ended (the shard stopped routing it).
    func subscriberLeft(_ shard: LoopShard) {
        state.withLock { s in
            guard let i = s.subscriberLoops.firstIndex(where: { $0.shard === shard }) else { return }
            s.subscriberLoops[i].count -= 1
            if s.subscriberLoops[i].count == 0 { s.subscriberLoops.remove(at: i) }
        }
        subscribers.subtract(1, ordering: .relaxed)
    }
}
