// ObsServer — one repository as the daemon serves it.
//
// The in-process `ObservableKit` parts, composed with the daemon's concerns: the keyed
// state and its write rules, the index of subscriptions, ordered delivery of each
// revision's pre-encoded event outside the lock, the bounded history for `since`, and
// storage. Subscribing happens under the same lock as writing, so a subscription's
// snapshot or replay and its live events meet at exactly one revision: no gap, no overlap.

import NIOCore
import ObsProtocol
import ObservableKit

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

final class Repository: Sendable {
    let name: String

    private struct State: Sendable {
        var data: KeyedState<StoredValue>
        var history: History
    }

    private let state: Locked<State>
    private let index = KeyedObserverIndex<Subscriber>()
    private let delivery: SerialDeliveryQueue<RevisionRecord>
    private let storage: any Storage

    init(name: String, loaded: LoadedRepository? = nil, historyLimit: Int, storage: any Storage, hub: Hub) {
        self.name = name
        self.storage = storage
        var history = History(capacity: historyLimit)
        for record in loaded?.history ?? [] { history.append(record) }
        self.state = Locked(State(data: loaded?.state ?? KeyedState(), history: history))
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

    func get(_ key: Key) -> Entry<StoredValue>? {
        state.withLock { $0.data[key] }
    }

    /// The keys (optionally with a prefix) in byte order, with their values, at the current revision.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: StoredValue)]) {
        state.withLock { s in
            let keys = s.data.keys(prefix: prefix)
            return (s.data.revision, keys.map { ($0, s.data[$0]!.value) })
        }
    }

    // MARK: Writing

    /// Applies `ops` atomically; delivers the resulting revision (if any) to subscribers.
    func write(_ ops: [WriteOp<StoredValue>]) throws(WriteError) -> WriteOutcome {
        let outcome = try state.withLock { (s) throws(WriteError) -> WriteOutcome in
            let previous = ops.count == 1 ? s.data[ops[0].key]?.value : nil
            guard let changeSet = try s.data.apply(ops) else {
                return WriteOutcome(revision: s.data.revision, changed: false, previous: previous)
            }
            let record = RevisionRecord(repo: name, changeSet: changeSet)
            s.history.append(record)
            storage.append(record)
            delivery.enqueue(record)
            return WriteOutcome(revision: changeSet.revision, changed: true, previous: previous)
        }
        if outcome.changed { delivery.drain() }
        return outcome
    }

    // MARK: Subscribing

    /// Registers `subscription` and reserves its reply in its outbox, with the snapshot
    /// or replay the request asks for. Returns the slot and the bytes to fill it with.
    ///
    /// - Throws: `compacted` when `since` cannot be served from the history.
    func subscribe(
        _ subscription: Subscription, _ request: SubscribeRequest, replyID: JSONValue
    ) throws(ProtocolError) -> (slot: Outbox.Slot, reply: ByteBuffer, events: Int) {
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
                guard let records = s.history.records(after: since, current: revision) else {
                    let oldest = s.history.oldestRevision.map { "starts at revision \($0)" } ?? "is empty"
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
                    return (subscription.outbox.reserveSlot(), buffer, events)
                }
            }
            if request.since != nil {
                EventEncoder.writeSynced(&buffer, sub: subscription.id, repo: name, rev: revision)
                events += 1
            }
            let slot = subscription.outbox.reserveSlot()
            if subscription.outbox.register(subscription, completeThrough: revision) {
                index.insert(Subscriber(subscription: subscription, after: revision), for: request.selection, id: subscription.indexID)
            }
            return (slot, buffer, events)
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
