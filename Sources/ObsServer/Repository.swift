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

/// The outcome of a write, for its reply.
struct WriteOutcome: Sendable {
    /// The repository revision after the write.
    let revision: UInt64
    let changed: Bool
    /// The key's previous value (single-key writes only).
    let previous: StoredValue?
}

/// Called once when a revision is durable (`.success`) or will never be (`.failure`).
typealias DurabilityWaiter = @Sendable (Result<Void, StorageError>) -> Void

final class Repository: DurabilityListener, Sendable {
    let name: String

    private struct Pending: Sendable {
        let record: RevisionRecord
        /// Each change's key entry before the revision, to undo it.
        let previous: [Entry<StoredValue>?]
    }

    private struct State: Sendable {
        var data: KeyedState<StoredValue>
        var history: History
        /// Applied in memory, handed to storage, not yet durable; oldest first.
        var pending: [Pending] = []
        var waiters: [(revision: UInt64, waiter: DurabilityWaiter)] = []
        /// Subscriptions registered at a revision that is not durable yet.
        var unconfirmed: [Subscriber] = []
    }

    private let state: Locked<State>
    /// The highest durable revision; readable without the lock.
    private let durableRevision: Atomic<UInt64>
    private let index = KeyedObserverIndex<Subscriber>()
    private let delivery: SerialDeliveryQueue<RevisionRecord>
    private let storage: any Storage
    /// Where delivery runs when durability is reported by the storage thread.
    private let deliveryLoop: (any EventLoop)?

    init(
        name: String, loaded: LoadedRepository? = nil, historyLimit: Int, historyMaxAge: Int64?, storage: any Storage,
        deliveryLoop: (any EventLoop)?, hub: Hub
    ) {
        self.name = name
        self.storage = storage
        self.deliveryLoop = storage.isImmediate ? nil : deliveryLoop
        var history = History(capacity: historyLimit, maxAge: historyMaxAge)
        for record in loaded?.history ?? [] { history.append(record) }
        let data = loaded?.state ?? KeyedState()
        self.state = Locked(State(data: data, history: history))
        self.durableRevision = Atomic(data.revision)
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

    /// The key's entry, and the repository revision it was read at.
    func get(_ key: Key) -> (entry: Entry<StoredValue>?, revision: UInt64) {
        state.withLock { ($0.data[key], $0.data.revision) }
    }

    /// The keys (optionally with a prefix) in byte order, with their values, at the current revision.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: StoredValue)]) {
        state.withLock { s in
            let keys = s.data.keys(prefix: prefix)
            return (s.data.revision, keys.map { ($0, s.data[$0]!.value) })
        }
    }

    // MARK: Writing

    /// Applies `ops` atomically. The resulting revision (if any) is delivered to
    /// subscribers once durable; `whenDurable` tells the writer.
    func write(_ ops: [WriteOp<StoredValue>], now: Int64) throws(WriteError) -> WriteOutcome {
        let outcome = try state.withLock { (s) throws(WriteError) -> WriteOutcome in
            let before = ops.map { s.data[$0.key] }
            let previous = ops.count == 1 ? before[0]?.value : nil
            guard let changeSet = try s.data.apply(ops) else {
                return WriteOutcome(revision: s.data.revision, changed: false, previous: previous)
            }
            let record = RevisionRecord(repo: name, changeSet: changeSet, time: now)
            s.history.append(record)
            if storage.isImmediate {
                durableRevision.store(changeSet.revision, ordering: .releasing)
                delivery.enqueue(record)
            } else {
                let beforeByKey = Dictionary(zip(ops.map(\.key), before), uniquingKeysWith: { first, _ in first })
                s.pending.append(Pending(record: record, previous: changeSet.changes.map { beforeByKey[$0.key] ?? nil }))
                storage.append(record, listener: self)
            }
            return WriteOutcome(revision: changeSet.revision, changed: true, previous: previous)
        }
        if outcome.changed && storage.isImmediate { delivery.drain() }
        return outcome
    }

    // MARK: Durability

    /// Whether `revision` is durable.
    func isDurable(_ revision: UInt64) -> Bool {
        durableRevision.load(ordering: .acquiring) >= revision
    }

    /// Calls `waiter` once `revision` is durable, or fails it if it never will be.
    /// Returns `false` without registering when `revision` is already durable.
    func whenDurable(_ revision: UInt64, _ waiter: @escaping DurabilityWaiter) -> Bool {
        if isDurable(revision) { return false }
        return state.withLock { s in
            if isDurable(revision) { return false }
            s.waiters.append((revision, waiter))
            return true
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
            }
            s.history.removeLast(undone.count)
            s.pending.removeAll { $0.record.revision > revision }
            storage.discard(self, after: revision)
            let failed = s.waiters.filter { $0.revision > revision }.map(\.waiter)
            s.waiters.removeAll { $0.revision > revision }
            // Subscriptions that began at an undone revision saw state that is gone; their
            // subscribe waiters (among `failed`) end them on their connections.
            for orphan in s.unconfirmed where orphan.after > revision { index.remove(orphan.subscription.indexID) }
            s.unconfirmed.removeAll { $0.after > revision }
            return (ready, failed)
        }
        scheduleDelivery()
        for waiter in ready { waiter(.success(())) }
        for waiter in failed { waiter(.failure(error)) }
    }

    /// Moves revisions up to `revision` from pending to delivery; returns the waiters it satisfies.
    private func confirm(_ s: inout State, through revision: UInt64) -> [DurabilityWaiter] {
        guard revision > durableRevision.load(ordering: .relaxed) else { return [] }
        var confirmed = 0
        for p in s.pending {
            guard p.record.revision <= revision else { break }
            delivery.enqueue(p.record)
            confirmed += 1
        }
        s.pending.removeFirst(confirmed)
        durableRevision.store(revision, ordering: .releasing)
        s.unconfirmed.removeAll { $0.after <= revision }
        let ready = s.waiters.filter { $0.revision <= revision }.map(\.waiter)
        s.waiters.removeAll { $0.revision <= revision }
        return ready
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
    /// revision that must be durable before they may be sent.
    ///
    /// - Throws: `compacted` when `since` cannot be served from the history.
    func subscribe(
        _ subscription: Subscription, _ request: SubscribeRequest, replyID: JSONValue, now: Int64
    ) throws(ProtocolError) -> (slot: Outbox.Slot, reply: ByteBuffer, events: Int, revision: UInt64) {
        try state.withLock { (s) throws(ProtocolError) in
            let revision = s.data.revision
            var replay: [RevisionRecord] = []
            if let since = request.since {
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
                    return (subscription.outbox.reserveSlot(), buffer, events, revision)
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
                if !isDurable(revision) { s.unconfirmed.append(subscriber) }
            }
            return (slot, buffer, events, revision)
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
        _ buffer: inout ByteBuffer, of data: KeyedState<StoredValue>, subscription: Subscription, request: SubscribeRequest
    ) {
        buffer.writeMember("{\"event\":\"snapshot\",\"sub\":", subscription.id)
        buffer.writeMember(",\"repo\":", subscription.repository.name)
        buffer.writeMember(",\"rev\":", data.revision)
        buffer.writeRaw(",\"values\":{")
        var first = true
        func member(_ key: Key, _ value: StoredValue) {
            if !first { buffer.writeByte(UInt8(ascii: ",")) }
            first = false
            buffer.writeJSONString(key)
            buffer.writeByte(UInt8(ascii: ":"))
            buffer.writeStored(value)
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
