// ObsServer — one repository as the daemon serves it.
//
// The in-process `ObservableKit` parts, composed with the daemon's concerns: the keyed
// state and its write rules, the index of subscriptions, ordered delivery of each
// revision's pre-encoded event outside the lock, the bounded history for `since`, and
// durability. A revision is applied in memory at once (later writes validate against it)
// and handed to storage; nobody sees it — no event, no reply that reports it — until
// storage says it is durable. If storage fails, the revisions it could not store are
// undone in memory and whoever waited for them gets an error.
//
// Subscribing happens under the same lock as writing, so a subscription's snapshot or
// replay and its live events meet at exactly one revision: no gap, no overlap.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// A subscription as the index holds it: revisions at or below `after` were covered by
/// its subscribe reply (snapshot or replay), so delivery skips them.
struct Subscriber: Sendable {
    let subscription: Subscription
    let after: UInt64
}

/// One subscription of one connection.
final class Subscription: Sendable {
    /// The subscription number on its connection.
    let id: UInt64
    let repository: Repository
    let outbox: Outbox
    let once: Bool
    let indexID = ObserverID.next()

    init(id: UInt64, repository: Repository, outbox: Outbox, once: Bool) {
        self.id = id
        self.repository = repository
        self.outbox = outbox
        self.once = once
    }
}

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
}

/// The limits a write is checked against, after the write rules.
struct WriteLimits: Sendable {
    var maxKeys: Int
    var maxRepositories: Int
    var maxRevisionBytes: Int
}

/// Called once when a state is durable (`.success`) or will never be (`.failure`).
typealias DurabilityWaiter = @Sendable (Result<Void, StorageError>) -> Void

/// Whether the state a reply reports may be shown.
enum Durability {
    case durable
    /// A waiter was registered and will be called.
    case pending
    /// The state was undone after a storage failure.
    case failed(StorageError)
}

final class Repository: DurabilityListener, Sendable {
    let name: String
    /// The history this repository's revisions belong to (see `Epoch`): loaded with it, or
    /// the hub's fresh epoch for one this daemon has not stored.
    let epoch: String

    private struct Pending: Sendable {
        let record: RevisionRecord
        let sequence: StateSequence
        /// Each change's key entry before the revision, to undo it.
        let previous: [Entry<CanonicalJSON>?]
    }

    private struct State: Sendable {
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
        var waiters: [(sequence: StateSequence, waiter: DurabilityWaiter)] = []
        /// Subscriptions registered on a state that is not durable yet.
        var unconfirmed: [(subscriber: Subscriber, sequence: StateSequence)] = []
    }

    private let state: Locked<State>
    /// The sequence of the latest durable state; readable without the lock.
    private let durableSequence = Atomic<StateSequence>(0)
    /// Loaded from storage, or written in this process (even if storage undid it since): the
    /// hub never drops it (see `Hub`). Set once, never cleared.
    private let permanent = Atomic<Bool>(false)
    /// The highest sequence ever undone (0: none); readable without the lock.
    private let undoneCeiling = Atomic<StateSequence>(0)
    private let index = KeyedObserverIndex<Subscriber>()
    private let delivery: SerialDeliveryQueue<RevisionRecord>
    private let storage: any Storage
    /// Where delivery runs when durability is reported by the storage thread.
    private let deliveryLoop: (any EventLoop)?
    /// Counts repositories that exist (revision > 0).
    private let stats: ServerStats

    init(
        name: String, loaded: LoadedRepository? = nil, historyLimit: Int, historyMaxAge: Int64?, storage: any Storage,
        deliveryLoop: (any EventLoop)?, hub: Hub
    ) {
        self.name = name
        self.epoch = loaded?.epoch ?? hub.freshEpoch
        self.storage = storage
        self.stats = hub.stats
        self.deliveryLoop = storage.isImmediate ? nil : deliveryLoop
        var history = History(capacity: historyLimit, maxAge: historyMaxAge)
        for record in loaded?.history ?? [] { history.append(record) }
        let data = loaded?.state ?? KeyedState()
        self.state = Locked(State(data: data, history: history))
        if loaded != nil { permanent.store(true, ordering: .relaxed) }
        let index = self.index
        self.delivery = SerialDeliveryQueue { [weak hub] record in
            guard let hub else { return }
            Self.deliver(record, through: index, hub: hub)
        }
    }

    // MARK: Reading

    /// The current revision and number of keys.
    var summary: (revision: UInt64, keys: Int) {
        state.withLock { ($0.data.revision, $0.data.count) }
    }

    var revision: UInt64 { state.withLock { $0.data.revision } }

    /// Whether the hub keeps this repository for good (see `permanent`).
    var isPermanent: Bool { permanent.load(ordering: .acquiring) }

    /// The key's entry, and the state it was read from.
    func get(_ key: Key) -> (entry: Entry<CanonicalJSON>?, sequence: StateSequence) {
        state.withLock { ($0.data[key], $0.current) }
    }

    /// The keys (optionally with a prefix) in byte order, with their values, at the current revision.
    /// Replies that report them carry `epoch` too.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: CanonicalJSON)], sequence: StateSequence) {
        state.withLock { s in
            let keys = s.data.keys(prefix: prefix)
            return (s.data.revision, keys.map { ($0, s.data[$0]!.value) }, s.current)
        }
    }

    /// The current state, for replies that report it (a conflict, say).
    var sequence: StateSequence { state.withLock { $0.current } }

    // MARK: Writing

    /// Applies `ops` atomically. The resulting revision (if any) is delivered to
    /// subscribers once durable; `whenDurable` tells the writer.
    ///
    /// The write rules are checked first: a write that fails them, or changes nothing, gets
    /// that answer whatever the limits. Then the limits, before anything is applied.
    func write(_ ops: [WriteOp<CanonicalJSON>], now: Int64, limits: WriteLimits) throws(WriteRefusal) -> WriteOutcome {
        let outcome = try state.withLock { (s) throws(WriteRefusal) -> WriteOutcome in
            let changes: [Change<CanonicalJSON>]
            do throws(WriteError) { changes = try s.data.plan(ops) } catch { throw .rules(error) }
            let before = ops.map { s.data[$0.key] }
            let previous = ops.count == 1 ? before[0]?.value : nil
            guard !changes.isEmpty else {
                return WriteOutcome(revision: s.data.revision, changed: false, previous: previous, sequence: s.current)
            }
            var created = 0
            var removed = 0
            var bytes = 0
            for change in changes {
                if change.old == nil { created += 1 }
                if change.new == nil { removed += 1 }
                bytes += Self.recordedSize(change)
            }
            if created > 0, s.data.count + created - removed > limits.maxKeys { throw .tooManyKeys(limit: limits.maxKeys) }
            if bytes > limits.maxRevisionBytes { throw .revisionTooLarge(bytes: bytes, limit: limits.maxRevisionBytes) }
            // Only a `set` brings an empty repository into existence; the count is reserved
            // atomically, so concurrent creators cannot pass the limit together.
            let creates = s.data.revision == 0
            if creates, !stats.reserveRepository(limit: limits.maxRepositories) {
                throw .tooManyRepositories(limit: limits.maxRepositories)
            }
            let changeSet = ChangeSet(revision: s.data.revision + 1, changes: changes)
            let record = RevisionRecord(repo: name, changeSet: changeSet, time: now)
            // Storage never calls back from inside `append` (this lock is held): a store that
            // no longer takes revisions says so, and nothing is applied.
            if !storage.isImmediate, !storage.append(record, listener: self) {
                if creates { stats.repositories.subtract(1, ordering: .relaxed) }
                throw .storageClosed
            }
            s.data.install(changeSet)
            if creates { permanent.store(true, ordering: .releasing) }
            s.applied += 1
            s.current = s.applied
            s.history.append(record)
            if storage.isImmediate {
                durableSequence.store(s.applied, ordering: .releasing)
                enqueueForDelivery(record)
            } else {
                let beforeByKey = Dictionary(zip(ops.map(\.key), before), uniquingKeysWith: { first, _ in first })
                s.pending.append(Pending(record: record, sequence: s.applied, previous: changes.map { beforeByKey[$0.key] ?? nil }))
            }
            return WriteOutcome(revision: changeSet.revision, changed: true, previous: previous, sequence: s.applied)
        }
        if outcome.changed && storage.isImmediate { delivery.drain() }
        return outcome
    }

    /// What one change adds to a revision record: its key, old and new value, and framing.
    static func recordedSize(_ change: Change<CanonicalJSON>) -> Int {
        change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 32
    }

    // MARK: Durability

    /// Whether the state `sequence` is durable.
    func isDurable(_ sequence: StateSequence) -> Bool {
        if durableSequence.load(ordering: .acquiring) < sequence { return false }
        if sequence > undoneCeiling.load(ordering: .acquiring) { return true }
        return state.withLock { s in !s.undone.contains { $0.contains(sequence) } }
    }

    /// Whether the state `sequence` may be shown; if it is not durable yet, `waiter` is
    /// called once it is — or once it is undone.
    func whenDurable(_ sequence: StateSequence, _ waiter: @escaping DurabilityWaiter) -> Durability {
        if durableSequence.load(ordering: .acquiring) >= sequence, sequence > undoneCeiling.load(ordering: .acquiring) {
            return .durable
        }
        return state.withLock { s in
            if s.undone.contains(where: { $0.contains(sequence) }), let failure = s.lastFailure { return .failed(failure) }
            if durableSequence.load(ordering: .relaxed) >= sequence { return .durable }
            s.waiters.append((sequence, waiter))
            return .pending
        }
    }

    func durable(through revision: UInt64) {
        let ready = state.withLock { s in confirm(&s, through: revision) }
        scheduleDelivery()
        for waiter in ready { waiter(.success(())) }
    }

    func failed(after revision: UInt64, error: StorageError) {
        let (ready, failed) = state.withLock { s in
            let ready = confirm(&s, through: revision)
            // Undo, newest first, every revision storage did not keep.
            let undone = s.pending.filter { $0.record.revision > revision }
            for p in undone.reversed() {
                s.data.revert(ChangeSet(revision: p.record.revision, changes: p.record.changes), previous: p.previous)
                if p.record.revision == 1 { stats.repositories.subtract(1, ordering: .relaxed) }
            }
            s.history.removeLast(undone.count)
            s.pending.removeAll { $0.record.revision > revision }
            storage.discard(self, after: revision)
            // Every state after the durable one is gone, including those reported by no-op
            // writes and reads; what remains is the durable state itself.
            let durable = durableSequence.load(ordering: .relaxed)
            if s.applied > durable {
                if let last = s.undone.last, last.lowerBound == durable + 1 {
                    s.undone[s.undone.count - 1] = last.lowerBound...s.applied
                } else {
                    s.undone.append((durable + 1)...s.applied)
                }
                undoneCeiling.store(s.applied, ordering: .releasing)
            }
            s.current = durable
            s.lastFailure = error
            let failed = s.waiters.filter { $0.sequence > durable }.map(\.waiter)
            s.waiters.removeAll { $0.sequence > durable }
            // Subscriptions that began on an undone state saw values that are gone; their
            // subscribe waiters (among `failed`) end them on their connections.
            for orphan in s.unconfirmed where orphan.sequence > durable { index.remove(orphan.subscriber.subscription.indexID) }
            s.unconfirmed.removeAll { $0.sequence > durable }
            return (ready, failed)
        }
        scheduleDelivery()
        for waiter in ready { waiter(.success(())) }
        for waiter in failed { waiter(.failure(error)) }
    }

    /// Moves revisions up to `revision` from pending to delivery; returns the waiters it satisfies.
    private func confirm(_ s: inout State, through revision: UInt64) -> [DurabilityWaiter] {
        var confirmed = 0
        for p in s.pending {
            guard p.record.revision <= revision else { break }
            enqueueForDelivery(p.record)
            confirmed += 1
        }
        guard confirmed > 0 else { return [] }
        let durable = s.pending[confirmed - 1].sequence
        s.pending.removeFirst(confirmed)
        durableSequence.store(durable, ordering: .releasing)
        s.unconfirmed.removeAll { $0.sequence <= durable }
        let ready = s.waiters.filter { $0.sequence <= durable }.map(\.waiter)
        s.waiters.removeAll { $0.sequence <= durable }
        return ready
    }

    /// Queues a revision for delivery — unless nobody subscribes to the repository. Runs
    /// under the state lock, as subscribing does: a subscription registered later starts
    /// at or above this revision and would not be sent it anyway.
    private func enqueueForDelivery(_ record: RevisionRecord) {
        if index.count > 0 { delivery.enqueue(record) }
    }

    private func scheduleDelivery() {
        if let deliveryLoop {
            deliveryLoop.execute { [delivery] in delivery.drain() }
        } else {
            delivery.drain()
        }
    }

    // MARK: Subscribing

    /// Registers `subscription` and reserves its reply in its outbox, with the snapshot
    /// or replay the request asks for. Returns the slot, the bytes to fill it with, and the
    /// state that must be durable before they may be sent.
    ///
    /// - Throws: `compacted` when `since` cannot be served from the history.
    func subscribe(
        _ subscription: Subscription, _ request: SubscribeRequest, replyID: JSONValue, now: Int64
    ) throws(ProtocolError) -> (slot: Outbox.Slot, reply: ByteBuffer, events: Int, sequence: StateSequence) {
        try state.withLock { (s) throws(ProtocolError) in
            let revision = s.data.revision
            var replay: [RevisionRecord] = []
            if let since = request.since {
                if let seen = request.epoch, seen != epoch {
                    throw ProtocolError(
                        .compacted,
                        "epoch \(JSONValue.string(String(seen.prefix(80))).jsonText) is not repository \(name)'s history (its epoch is \(epoch)): revision \(since) of that history means nothing here; subscribe with initial: true"
                    )
                }
                guard since <= revision else {
                    throw ProtocolError(
                        .compacted,
                        "since \(since) is ahead of repository \(name)'s revision \(revision): this daemon does not have that history; subscribe with initial: true"
                    )
                }
                guard let records = s.history.records(after: since, current: revision, now: now) else {
                    let oldest = s.history.oldestRevision(now: now).map { "starts at revision \($0)" } ?? "is empty"
                    throw ProtocolError(
                        .compacted,
                        "history of repository \(name) \(oldest); since \(since) is older: subscribe with initial: true")
                }
                replay = records
            }

            var buffer = ByteBuffer()
            ReplyEncoder.begin(&buffer, id: replyID)
            buffer.writeMember(",\"sub\":", subscription.id)
            buffer.writeMember(",\"rev\":", revision)
            buffer.writeMember(",\"epoch\":", epoch)
            ReplyEncoder.end(&buffer)
            var events = 0
            if request.initial {
                Self.writeSnapshot(&buffer, of: s.data, subscription: subscription, request: request)
                events += 1
            }
            for record in replay {
                let keys = record.keys
                let selected: SelectedChanges
                switch request.selection {
                case .all: selected = .all
                default:
                    let positions = keys.indices.filter { request.selection.matches(keys[$0]) }
                    if positions.isEmpty { continue }
                    selected = positions.count == keys.count ? .all : .some(positions)
                }
                record.writeEvent(&buffer, sub: subscription.id, selected: selected)
                events += 1
                if subscription.once {
                    // Its one change was in the replay: it ends here, unregistered.
                    return (subscription.outbox.reserveSlot(), buffer, events, s.current)
                }
            }
            if request.since != nil {
                EventEncoder.writeSynced(&buffer, sub: subscription.id, repo: name, rev: revision)
                events += 1
            }
            let slot = subscription.outbox.reserveSlot()
            if subscription.outbox.register(subscription, completeThrough: revision) {
                let subscriber = Subscriber(subscription: subscription, after: revision)
                index.insert(subscriber, for: request.selection, id: subscription.indexID)
                if durableSequence.load(ordering: .relaxed) < s.current { s.unconfirmed.append((subscriber, s.current)) }
            }
            return (slot, buffer, events, s.current)
        }
    }

    /// Removes a subscription from the index. Idempotent.
    func removeSubscriber(_ subscription: Subscription) {
        index.remove(subscription.indexID)
    }

    /// The number of subscriptions in the index.
    var subscriberCount: Int { index.count }

    // MARK: Delivery

    private static func writeSnapshot(
        _ buffer: inout ByteBuffer, of data: KeyedState<CanonicalJSON>, subscription: Subscription, request: SubscribeRequest
    ) {
        buffer.writeMember("{\"event\":\"snapshot\",\"sub\":", subscription.id)
        buffer.writeMember(",\"repo\":", subscription.repository.name)
        buffer.writeMember(",\"rev\":", data.revision)
        buffer.writeRaw(",\"values\":{")
        var first = true
        func member(_ key: Key, _ value: CanonicalJSON) {
            if !first { buffer.writeByte(UInt8(ascii: ",")) }
            first = false
            buffer.writeJSONString(key)
            buffer.writeByte(UInt8(ascii: ":"))
            buffer.writeCanonical(value)
        }
        switch request.selection {
        case .keys(let keys):
            for key in keys.sorted() { if let e = data[key] { member(key, e.value) } }
        case .prefix(let prefix):
            for key in data.keys(prefix: prefix) { member(key, data[key]!.value) }
        case .all:
            for key in data.keys() { member(key, data[key]!.value) }
        }
        buffer.writeRaw("}}\n")
    }

    private static func deliver(_ record: RevisionRecord, through index: KeyedObserverIndex<Subscriber>, hub: Hub) {
        var delivered = 0
        for match in index.route(record.keys) where record.revision > match.observer.after {
            let subscription = match.observer.subscription
            switch subscription.outbox.deliver(record, selected: match.selected, to: subscription) {
            case .delivered:
                delivered += 1
            case .skipped:
                break
            case .ended:
                delivered += 1
                hub.subscriptionEnded(subscription)
            case .overflowed(let victims):
                for victim in victims { hub.subscriptionEnded(victim) }
            }
        }
        hub.stats.eventsOut.add(delivered, ordering: .relaxed)
    }
}
