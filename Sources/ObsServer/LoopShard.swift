// ObsServer — one event loop's share of the daemon: the subscriptions of its connections,
// by repository and key; the revisions and durability news waiting to be delivered on it;
// the replies waiting for durability; and the connections with output to write.
//
// Delivery takes no lock per event. A repository posts each revision it may show (a
// durable one) to the inbox of every loop with subscribers to it — under its own lock, so
// an inbox holds each repository's revisions in revision order — and once per loop tick the
// loop takes its inbox, routes each revision through its own index to its own connections'
// outboxes, and writes each connection once. The inbox lock is taken once per revision per
// loop, never per subscriber; nothing crosses threads per event.
//
// Delivery is bounded two ways. A tick delivers at most `DeliveryBudget.eventsPerTick`
// events, then lets the loop serve its connections (and the watchdog's heartbeat) before
// the next tick goes on. And what waits to be delivered — the backlog, counted in events
// (a revision weighs as many as this loop has subscriptions to its repository) — pushes
// back on writers: past `DeliveryBudget.maxBacklog`, a connection that writes hands over
// no further request until the backlog is below half of it (`whenDrained`). A slow reader
// never causes a backlog — its own queue overflows (or coalesces) — so only a loop whose
// fan-out costs more than the writes arrive slows the writers.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// What one loop has done, for `stats`. Written only by its loop — so a plain load and
/// store count, no read-modify-write shared between threads — and read by anyone.
final class LoopCounters: Sendable {
    let requests = Atomic<Int>(0)
    let writes = Atomic<Int>(0)
    let eventsOut = Atomic<Int>(0)
    let bytesOut = Atomic<Int>(0)

    func countRequest() { Self.bump(requests, 1) }
    func countWrite() { Self.bump(writes, 1) }
    func count(events: Int) { Self.bump(eventsOut, events) }
    func count(bytes: Int) { Self.bump(bytesOut, bytes) }

    private static func bump(_ counter: borrowing Atomic<Int>, _ n: Int) {
        counter.store(counter.load(ordering: .relaxed) &+ n, ordering: .relaxed)
    }
}

/// How much a loop delivers before it serves its connections again, and how much may wait
/// to be delivered before writers are held back (see LoopShard).
struct DeliveryBudget: Sendable {
    /// Events one tick delivers before it lets the loop do its I/O (about 10–50 ms of work).
    var eventsPerTick = 65_536
    /// Events waiting to be delivered on one loop past which writers wait.
    var maxBacklog = 262_144
}

final class LoopShard: @unchecked Sendable {
    // @unchecked Sendable: `inbox` is behind a lock, `backlog` and `counters` are atomics,
    // `budget` is immutable, and `hub` is set once by the hub's initializer, before the shard
    // is published to any other thread; every other stored property is read and written only
    // on `eventLoop` — by the loop's connection handlers and sessions, and by `tick`, which
    // the loop runs — so no two threads ever touch them. Entry points assert it in debug builds.

    /// News for this loop, posted from any thread.
    enum Item: Sendable {
        /// A durable revision of a repository this loop has `weight` subscriptions to.
        case revision(Revision, Repository, weight: Int)
        /// Every state of the repository up to this sequence is durable.
        case durable(Repository, through: StateSequence)
        /// These states of the repository were undone.
        case failed(Repository, undone: ClosedRange<StateSequence>, StorageError)
        /// Storage's news for a repository whose home this shard is (see `Repository.durable`).
        case confirm(Repository, through: UInt64)
        case undo(Repository, after: UInt64, StorageError)
    }

    let eventLoop: any EventLoop
    /// This shard's place among the hub's.
    let index: Int
    let counters = LoopCounters()
    /// The hub this shard belongs to (which owns it).
    weak var hub: Hub?
    private let inbox = Locked<Inbox>(Inbox())
    /// Events posted and not yet delivered (an upper bound: each revision counts as many as
    /// its repository's subscriptions here). Written under the inbox lock and by the loop.
    private let backlog = Atomic<Int>(0)
    let budget: DeliveryBudget

    private struct Inbox {
        var items: [Item] = []
        var scheduled = false
        /// Writers' loops waiting for the backlog to go down (see `whenDrained`).
        var drainWaiters: [@Sendable () -> Void] = []
    }

    // Loop-confined from here on.

    /// A class, so that delivering a revision reads it in place (a struct would be copied
    /// out of the dictionary, retaining each of its index's tables, once per revision).
    private final class RepositoryRoutes {
        let repository: Repository
        var routes = KeyedRoutes<Subscription>()
        /// The newest revision delivered to this loop.
        var revision: UInt64 = 0

        init(repository: Repository) { self.repository = repository }
    }

    /// A reply (or a subscription's first messages) waiting for a state to be durable.
    struct Waiter {
        let sequence: StateSequence
        let outbox: Outbox
        let slot: Outbox.Slot
        let bytes: ByteBuffer
        let events: Int
        let id: JSONValue
        /// Ends with the reply if the state is undone.
        let subscription: Subscription?
    }

    private var routes: [ObjectIdentifier: RepositoryRoutes] = [:]
    private var waiters: [ObjectIdentifier: CircularBuffer<Waiter>] = [:]
    private var dirty: [Outbox] = []
    private var tickScheduled = false
    /// Taken from the inbox and not yet handled (the last tick ran out of its budget).
    private var taken = CircularBuffer<Item>()

    init(eventLoop: any EventLoop, index: Int, budget: DeliveryBudget = DeliveryBudget()) {
        self.eventLoop = eventLoop
        self.index = index
        self.budget = budget
    }

    // MARK: Posting (any thread)

    /// Queues news for this loop; it is handled in the loop's next tick.
    func post(_ item: Item) {
        let wasScheduled = inbox.withLock { box -> Bool in
            if case .revision(_, _, let weight) = item { backlog.wrappingAdd(weight, ordering: .relaxed) }
            box.items.append(item)
            defer { box.scheduled = true }
            return box.scheduled
        }
        guard !wasScheduled else { return }
        if eventLoop.inEventLoop {
            requestTick()
        } else {
            eventLoop.execute { self.tick() }
        }
    }

    // MARK: Backlog (any thread)

    /// Whether the backlog is at its limit: writers should wait (`whenDrained`).
    var isBacklogged: Bool { backlog.load(ordering: .relaxed) >= budget.maxBacklog }

    /// Calls `resume` (on whatever thread; it must hop to its own loop) once the backlog is
    /// below half its limit — at once if it already is.
    func whenDrained(_ resume: @escaping @Sendable () -> Void) {
        let now = inbox.withLock { box -> Bool in
            if backlog.load(ordering: .relaxed) < budget.maxBacklog / 2 { return true }
            box.drainWaiters.append(resume)
            return false
        }
        if now { resume() }
    }

    // MARK: Subscriptions (on the loop)

    /// Makes `subscription` receive the revisions of its repository that its selection
    /// picks. Called with the repository's lock held (see `Repository.subscribe`), so no
    /// revision can slip between its snapshot and its first event.
    func route(_ subscription: Subscription, for selection: Selection) {
        eventLoop.assertInEventLoop()
        let id = ObjectIdentifier(subscription.repository)
        let entry = routes[id] ?? RepositoryRoutes(repository: subscription.repository)
        routes[id] = entry
        entry.routes.insert(subscription, for: selection, id: subscription.routeID)
    }

    /// Stops routing to `subscription`. Idempotent.
    func unroute(_ subscription: Subscription) {
        eventLoop.assertInEventLoop()
        let id = ObjectIdentifier(subscription.repository)
        guard let entry = routes[id], entry.routes.remove(subscription.routeID) != nil else { return }
        if entry.routes.count == 0 { routes[id] = nil }
        subscription.repository.subscriberLeft(self)
        hub?.subscriptionEnded(subscription.repository)
    }

    /// The newest revision of `repository` delivered to this loop (0: none yet). Every
    /// revision of a repository this loop has subscribers to is delivered here, in order.
    func latestRevision(of repository: Repository) -> UInt64 {
        routes[ObjectIdentifier(repository)]?.revision ?? 0
    }

    /// The lags of this loop's lagging coalescing subscriptions to repository `name`: what
    /// each still owes its client (in-process tests check their bound).
    func lags(ofRepository name: String) -> [Lag] {
        eventLoop.assertInEventLoop()
        var lags: [Lag] = []
        for entry in routes.values where entry.repository.name == name {
            entry.routes.forEachRegistration { subscription in if let lag = subscription.lag { lags.append(lag) } }
        }
        return lags
    }

    // MARK: Durability waits (on the loop)

    /// Holds a reply in its outbox slot until its state is durable; `Repository.awaitDurable`
    /// said it is pending, and registered this loop for the news.
    func wait(_ waiter: Waiter, on repository: Repository) {
        eventLoop.assertInEventLoop()
        waiters[ObjectIdentifier(repository), default: CircularBuffer()].append(waiter)
    }

    // MARK: Output (on the loop)

    /// Writes `outbox` at the end of this tick (once, however often it is asked).
    func markDirty(_ outbox: Outbox) {
        eventLoop.assertInEventLoop()
        if outbox.isDirty { return }
        outbox.isDirty = true
        dirty.append(outbox)
        requestTick()
    }

    private func requestTick() {
        if tickScheduled { return }
        tickScheduled = true
        eventLoop.execute { self.tick() }
    }

    // MARK: The tick

    /// Handles what was posted — up to the budget of events, the rest in the next tick —
    /// then writes every connection that has output. Runs as a task of the loop, after the
    /// loop has handled the reads of its current iteration.
    private func tick() {
        eventLoop.assertInEventLoop()
        tickScheduled = false
        var delivered = 0
        var weighed = 0
        // News handled here may post more for this loop (a confirmation tells the waiting
        // loops, this one among them): a few rounds take it in this tick.
        rounds: for _ in 0..<3 {
            if taken.isEmpty {
                let items = inbox.withLock { box -> [Item] in
                    box.scheduled = false
                    var items: [Item] = []
                    swap(&items, &box.items)
                    return items
                }
                if items.isEmpty { break }
                taken.append(contentsOf: items)
            }
            while let item = taken.popFirst() {
                switch item {
                case .revision(let record, let repository, let weight):
                    delivered += deliver(record, of: repository)
                    weighed += weight
                case .durable(let repository, let sequence): release(repository, through: sequence)
                case .failed(let repository, let undone, let error): fail(repository, undone: undone, error)
                case .confirm(let repository, let revision): repository.confirm(through: revision)
                case .undo(let repository, let revision, let error): repository.undo(after: revision, error: error)
                }
                if delivered >= budget.eventsPerTick { break rounds }
            }
        }
        if delivered > 0 { counters.count(events: delivered) }
        if weighed > 0 { settle(weighed) }
        let outboxes = dirty
        dirty.removeAll(keepingCapacity: true)
        var written = 0
        for outbox in outboxes {
            outbox.isDirty = false
            written += outbox.flush()
        }
        if written > 0 { counters.count(bytes: written) }
        // Out of budget: the rest after the loop has served its connections.
        if !taken.isEmpty { requestTick() }
    }

    /// Takes `weight` delivered events off the backlog; wakes the writers waiting for it if
    /// it is now below half its limit.
    private func settle(_ weight: Int) {
        let waiters = inbox.withLock { box -> [@Sendable () -> Void] in
            let left = backlog.wrappingSubtract(weight, ordering: .relaxed).newValue
            guard left < budget.maxBacklog / 2, !box.drainWaiters.isEmpty else { return [] }
            var waiters: [@Sendable () -> Void] = []
            swap(&waiters, &box.drainWaiters)
            return waiters
        }
        for resume in waiters { resume() }
    }

    /// Routes one revision to this loop's subscribers of its repository; the number of
    /// events queued.
    private func deliver(_ record: Revision, of repository: Repository) -> Int {
        guard let entry = routes[ObjectIdentifier(repository)] else { return 0 }
        entry.revision = record.revision
        var delivered = 0
        var ended: [Subscription] = []
        entry.routes.route(record.keys) { _, subscription, selected in
            guard record.revision > subscription.after else { return }
            let outbox = subscription.outbox
            switch outbox.deliver(record, selected: selected, to: subscription) {
            case .delivered:
                delivered += 1
            case .skipped:
                return
            case .ended:
                delivered += 1
                ended.append(subscription)
            case .overflowed(let victims):
                ended.append(contentsOf: victims)
            }
            markDirty(outbox)
        }
        for subscription in ended { unroute(subscription) }
        return delivered
    }

    /// Sends the waiting replies whose states are now durable, in order.
    private func release(_ repository: Repository, through sequence: StateSequence) {
        let id = ObjectIdentifier(repository)
        guard var queue = waiters.removeValue(forKey: id) else { return }
        while let first = queue.first, first.sequence <= sequence {
            queue.removeFirst()
            first.outbox.fill(first.slot, with: first.bytes, events: first.events)
            markDirty(first.outbox)
        }
        if !queue.isEmpty { waiters[id] = queue }
    }

    /// Replaces the waiting replies whose states were undone by the error; a subscription
    /// that began on undone state ends with it (it saw values that are gone).
    private func fail(_ repository: Repository, undone: ClosedRange<StateSequence>, _ error: StorageError) {
        let id = ObjectIdentifier(repository)
        guard var queue = waiters.removeValue(forKey: id) else { return }
        var kept = CircularBuffer<Waiter>()
        while let waiter = queue.popFirst() {
            guard undone.contains(waiter.sequence) else {
                kept.append(waiter)
                continue
            }
            if let subscription = waiter.subscription, waiter.outbox.unregister(subscription.id) != nil {
                unroute(subscription)
            }
            waiter.outbox.fill(waiter.slot, with: Session.storageFailure(id: waiter.id, error, repo: repository.name))
            markDirty(waiter.outbox)
        }
        if !kept.isEmpty { waiters[id] = kept }
    }
}
