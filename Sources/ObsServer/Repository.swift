// ObsServer — one repository as the daemon serves it.
//
// The keyed state and its write rules, the bounded history for `since`, and durability.
// A revision is applied in memory at once (later writes validate against it) and handed to
// storage; nobody sees it — no event, no reply that reports it — until storage says it is
// durable. Then it is posted to every event loop with subscribers to the repository (see
// `LoopShard`), and the loops waiting for replies are told. If storage fails, the revisions
// it could not store are undone in memory and whoever waited for them gets an error.
//
// Subscribing happens under the same lock as writing, so a subscription's snapshot or
// replay and its live events meet at exactly one revision: no gap, no overlap. What a
// reader takes is copied out under the lock and encoded outside it.

import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// Identifies the state a reply was computed from: the number of revisions applied in
/// memory so far, counting those later undone. Unlike revisions, these are never reused
/// after an undo, so a reply computed from undone state can always be recognized.
typealias StateSequence = UInt64

/// The outcome of a write, for its reply.
struct WriteOutcome: Sendable {
    /// The repository revision after the write.
    let revision: UInt64
    let changed: Bool
    /// The key's previous value (single-key writes only).
    let previous: CanonicalJSON?
    /// The state the reply reports.
    let sequence: StateSequence
}

/// Why a write was refused; nothing was applied.
enum WriteRefusal: Error, Sendable {
    /// The contract's rules: a failed condition, a key written twice in a batch.
    case rules(WriteError)
    /// The write would create keys beyond the repository's limit.
    case tooManyKeys(limit: Int)
    /// The write would create this repository, and no more may be created.
    case tooManyRepositories(limit: Int)
    /// The revision would carry more bytes of keys and old and new values than allowed.
    case revisionTooLarge(bytes: Int, limit: Int)
    /// Storage no longer takes revisions (the daemon is stopping).
    case storageClosed
    /// The shared store (etcd mode) could not commit it, or could not say whether it did.
    case shared(SharedFailure)
}

/// The limits a write is checked against, after the write rules.
struct WriteLimits: Sendable {
    var maxKeys: Int
    var maxRepositories: Int
    var maxRevisionBytes: Int
}

/// Whether the state a reply reports may be shown.
enum Durability {
    case durable
    /// The loop that asked will be told (`LoopShard.Item.durable` or `.failed`).
    case pending
    /// The state was undone after a storage failure.
    case failed(StorageError)
}

/// What a new subscription starts with, copied out under the lock: its revision, the
/// sequence of the state it reports, and its snapshot values or replayed revisions.
struct SubscriptionStart {
    let revision: UInt64
    let sequence: StateSequence
    /// With `initial`: the selected entries (unsorted).
    let snapshot: [(key: Key, value: CanonicalJSON)]?
    /// With `since`: the retained revisions above it.
    let replay: [Revision]
    /// Whether the subscription went live (false when its one `once` change was replayed,
    /// or its connection is closing).
    let registered: Bool
}

final class Repository: DurabilityListener, Sendable {
    let name: String
    /// The history this repository's revisions belong to (see `Epoch`): loaded with it, or
    /// the hub's fresh epoch for one this daemon has not stored.
    let epoch: String

    struct Pending: Sendable {
        let revision: Revision
        let sequence: StateSequence
        /// Each change's key entry before the revision, to undo it.
        let previous: [Entry<CanonicalJSON>?]
    }

    struct State: Sendable {
        var data: KeyedState<CanonicalJSON>
        var history: History
        /// Sequences handed out so far: one per revision applied in memory, undone ones included.
        var applied: StateSequence = 0
        /// The sequence of the current state (after an undo: the durable state's).
        var current: StateSequence = 0
        /// Sequences of states undone after storage failures; ascending, disjoint.
        var undone: [ClosedRange<StateSequence>] = []
        var lastFailure: StorageError? = nil
        /// Applied in memory, handed to storage, not yet durable; oldest first.
        var pending: [Pending] = []
        /// Event loops with subscribers to this repository, and how many each has.
        var subscriberLoops: [(shard: LoopShard, count: Int)] = []
        /// Event loops that have waited for a state of this repository to be durable.
        var waitingLoops: [LoopShard] = []
        /// The time of the newest revision: revisions are stamped no earlier, so their
        /// times never go back whatever the clock does.
        var lastTime: Int64 = .min
        /// Writes waiting for a shared store (etcd mode; see Repository+Shared.swift).
        var shared = SharedQueue()
    }

    let state: Locked<State>
    /// The sequence of the latest durable state; readable without the lock.
    let durableSequence = Atomic<StateSequence>(0)
    /// The highest sequence ever undone (0: none); readable without the lock.
    private let undoneCeiling = Atomic<StateSequence>(0)
    /// Subscriptions of every loop; readable without the lock (the hub drops placeholders
    /// nobody subscribes to).
    let subscribers = Atomic<Int>(0)
    /// Loaded from storage, or written in this process (even if storage undid it since): the
    /// hub never drops it (see `Hub`). Set once, never cleared.
    let permanent = Atomic<Bool>(false)
    let storage: any Storage
    /// Counts repositories that exist (revision > 0).
    let stats: ServerStats
    /// The hub's shared store (etcd mode), where revisions are decided; nil otherwise.
    let sharedStorage: (any SharedStorage)?
    /// Names this daemon's commit groups (etcd mode).
    let writeIDs: WriteIDs?
    /// Every event loop's share; storage's durability news goes to one of them.
    private let shards: [LoopShard]
    /// The shard that handles storage's news: the last writer's, so the news usually
    /// reaches the loop that waits for it with no further hop.
    private let home: Atomic<Int>

    init(name: String, loaded: LoadedRepository? = nil, storage: any Storage, hub: Hub) {
        self.name = name
        self.epoch = loaded?.epoch ?? hub.freshEpoch
        self.storage = storage
        self.stats = hub.stats
        self.sharedStorage = hub.shared
        self.writeIDs = hub.shared == nil ? nil : hub.writeIDs
        self.shards = hub.shards
        self.home = Atomic(abs(name.hashValue % max(1, hub.shards.count)))
        var history = History(limits: hub.historyLimits)
        for record in loaded?.history ?? [] { history.append(Revision(record, encode: false)) }
        let data = loaded?.state ?? KeyedState()
        var state = State(data: data, history: history)
        state.lastTime = loaded?.history.last?.time ?? .min
        self.state = Locked(state)
        if loaded != nil { permanent.store(true, ordering: .relaxed) }
    }

    // MARK: Reading

    /// The current revision and number of keys.
    var summary: (revision: UInt64, keys: Int) {
        state.withLock { ($0.data.revision, $0.data.count) }
    }

    var revision: UInt64 { state.withLock { $0.data.revision } }

    /// Whether the hub keeps this repository for good (see `permanent`).
    var isPermanent: Bool { permanent.load(ordering: .acquiring) }

    /// The number of live subscriptions, on every loop.
    var subscriberCount: Int { subscribers.load(ordering: .relaxed) }

    /// The key's entry, and the state it was read from.
    func get(_ key: Key) -> (entry: Entry<CanonicalJSON>?, sequence: StateSequence) {
        state.withLock { ($0.data[key], $0.current) }
    }

    /// The keys (optionally with a prefix) with their values, unsorted, at the current
    /// revision: copied out under the lock, sorted by the caller.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: CanonicalJSON)], sequence: StateSequence) {
        state.withLock { s in (s.data.revision, Self.entries(of: s.data, .prefix(prefix ?? "")), s.current) }
    }

    /// The current state, for replies that report it (a conflict, say).
    var sequence: StateSequence { state.withLock { $0.current } }

    // MARK: Writing

    /// Whether `changes` would pass the key-count or the revision-size limit of a repository
    /// holding `keys` keys (checked before anything is applied).
    static func sizeRefusal(_ changes: [Change<CanonicalJSON>], keys: Int, limits: WriteLimits) -> WriteRefusal? {
        var created = 0
        var removed = 0
        var bytes = 0
        for change in changes {
            if change.old == nil { created += 1 }
            if change.new == nil { removed += 1 }
            bytes += RevisionRecord.byteSize(of: change)
        }
        if created > 0, keys + created - removed > limits.maxKeys { return .tooManyKeys(limit: limits.maxKeys) }
        if bytes > limits.maxRevisionBytes { return .revisionTooLarge(bytes: bytes, limit: limits.maxRevisionBytes) }
        return nil
    }

    /// Applies `ops` atomically, written by `writer` on connection `origin`. The resulting
    /// revision (if any) is delivered to subscribers once durable; `awaitDurable` tells the
    /// writer's loop (`from`, whose shard then hears storage's news first).
    ///
    /// The write rules are checked first: a write that fails them, or changes nothing, gets
    /// that answer whatever the limits. Then the limits, before anything is applied.
    func write(
        _ ops: [WriteOp<CanonicalJSON>], now: Int64, limits: WriteLimits, from shard: LoopShard? = nil, writer: Writer? = nil,
        origin: ConnectionID? = nil
    ) throws(WriteRefusal) -> WriteOutcome {
        if let shard, home.load(ordering: .relaxed) != shard.index { home.store(shard.index, ordering: .relaxed) }
        return try state.withLock { (s) throws(WriteRefusal) -> WriteOutcome in
            let changes: [Change<CanonicalJSON>]
            do throws(WriteError) { changes = try s.data.plan(ops) } catch { throw .rules(error) }
            // A single write's reply carries the value it replaced (the change's old value, or
            // the equal value it left in place).
            let previous: CanonicalJSON? =
                if ops.count != 1 { nil } else if let change = changes.first { change.old } else { s.data[ops[0].key]?.value }
            guard !changes.isEmpty else {
                return WriteOutcome(revision: s.data.revision, changed: false, previous: previous, sequence: s.current)
            }
            if let refusal = Self.sizeRefusal(changes, keys: s.data.count, limits: limits) { throw refusal }
            // Only a `set` brings an empty repository into existence; the count is reserved
            // atomically, so concurrent creators cannot pass the limit together.
            let creates = s.data.revision == 0
            if creates, !stats.reserveRepository(limit: limits.maxRepositories) {
                throw .tooManyRepositories(limit: limits.maxRepositories)
            }
            let changeSet = ChangeSet(revision: s.data.revision + 1, changes: changes)
            let record = RevisionRecord(repo: name, changeSet: changeSet, time: max(now, s.lastTime), writer: writer)
            let revision = Revision(record, encode: !s.subscriberLoops.isEmpty, origin: origin)
            // What each changed key held, to undo the write should storage fail it.
            let before = storage.isImmediate ? [] : ops.map { s.data[$0.key] }
            // Storage never calls back from inside `append` (this lock is held): a store that
            // no longer takes revisions says so, and nothing is applied.
            if !storage.isImmediate, !storage.append(record, listener: self) {
                if creates { stats.repositories.subtract(1, ordering: .relaxed) }
                throw .storageClosed
            }
            s.data.install(changeSet)
            s.lastTime = record.time
            if creates { permanent.store(true, ordering: .releasing) }
            s.applied += 1
            s.current = s.applied
            s.history.append(revision)
            if storage.isImmediate {
                durableSequence.store(s.applied, ordering: .releasing)
                Self.publish(revision, of: self, to: s.subscriberLoops)
            } else {
                let beforeByKey = Dictionary(zip(ops.map(\.key), before), uniquingKeysWith: { first, _ in first })
                s.pending.append(Pending(revision: revision, sequence: s.applied, previous: changes.map { beforeByKey[$0.key] ?? nil }))
            }
            return WriteOutcome(revision: changeSet.revision, changed: true, previous: previous, sequence: s.applied)
        }
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

    // Storage's news arrives on its own thread, which never takes this lock: it is handed
    // to the home shard's loop, which applies it. News posted before `home` moved may be
    // applied after news posted since, on another loop — harmless: `confirm` only ever
    // moves forward, and `undo` confirms what storage kept before it undoes the rest.

    func durable(through revision: UInt64) {
        shards[home.load(ordering: .relaxed)].post(.confirm(self, through: revision))
    }

    func failed(after revision: UInt64, error: StorageError) {
        shards[home.load(ordering: .relaxed)].post(.undo(self, after: revision, error))
    }

    /// Every revision up to `revision` is durable: shows them (on a loop, see `durable`).
    func confirm(through revision: UInt64) {
        state.withLock { s in _ = confirm(&s, through: revision) }
    }

    /// Storage kept the revisions up to `revision` and never will keep the others: undoes
    /// them (on a loop, see `failed`).
    func undo(after revision: UInt64, error: StorageError) {
        state.withLock { s in
            confirm(&s, through: revision)
            // Undo, newest first, every revision storage did not keep.
            let undone = s.pending.filter { $0.revision.revision > revision }
            for p in undone.reversed() {
                s.data.revert(ChangeSet(revision: p.revision.revision, changes: p.revision.record.changes), previous: p.previous)
                if p.revision.revision == 1 { stats.repositories.subtract(1, ordering: .relaxed) }
            }
            s.history.removeLast(undone.count)
            s.pending.removeAll { $0.revision.revision > revision }
            storage.discard(self, after: revision)
            // Every state after the durable one is gone, including those reported by no-op
            // writes and reads; what remains is the durable state itself.
            let durable = durableSequence.load(ordering: .relaxed)
            guard s.applied > durable else { return }
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
        }
    }

    /// Publishes the pending revisions up to `revision` and tells the waiting loops.
    @discardableResult
    private func confirm(_ s: inout State, through revision: UInt64) -> Bool {
        var confirmed = 0
        for p in s.pending {
            guard p.revision.revision <= revision else { break }
            Self.publish(p.revision, of: self, to: s.subscriberLoops)
            confirmed += 1
        }
        guard confirmed > 0 else { return false }
        let durable = s.pending[confirmed - 1].sequence
        s.pending.removeFirst(confirmed)
        durableSequence.store(durable, ordering: .releasing)
        for shard in s.waitingLoops { shard.post(.durable(self, through: durable)) }
        return true
    }

    /// Posts a durable revision to the loops with subscribers. Under the state lock, so each
    /// loop's inbox holds this repository's revisions in order.
    static func publish(_ revision: Revision, of repository: Repository, to loops: [(shard: LoopShard, count: Int)]) {
        for loop in loops { loop.shard.post(.revision(revision, repository, weight: loop.count)) }
    }
}
