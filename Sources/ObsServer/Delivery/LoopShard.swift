// ObsServer — one event loop's share of delivery: the subscriptions of its connections, by
// repository and key; the revisions and durability news waiting to be delivered on it; the
// replies waiting for durability (LoopShard+Durability.swift); and the connections with output
// to write. It is the only code that appends events to outboxes, and it owns a subscription's
// life on the loop: it starts one (`start`: registered with its connection's outbox and routed,
// in one step) and ends it — whoever ends one (an unsubscribe, a failed start, a closing
// connection, a revoke, its own delivery of a `once` event or an overflow) goes through it,
// which takes it out of its connection's outbox and of the routes in one step. It never calls
// a repository or the hub: how many subscriptions to a repository it routes is news it keeps
// (`RouteCount`), which the repository reads as it posts; an ended subscription to a
// placeholder repository is reported to its connection, which tells the hub. A `sync` whose events are queued is answered by its session
// (`checkSyncs`).
//
// A repository posts each revision it may show (a durable one) to every loop with subscribers
// to it: its record is copied into the loop's inbox — a buffer, no object per revision —
// under the repository's lock, so an inbox holds each repository's revisions in order (the
// loop's own posts too, the lock uncontended). Once per tick the loop takes what was posted,
// routes it through its own index to its connections' outboxes — a run of one key's
// revisions at once, each subscriber's events sent as soon as they are written
// (LoopShard+Delivery.swift) — then writes each connection with output once.
//
// Delivery is bounded two ways. A tick delivers at most `DeliveryBudget.eventsPerTick` events,
// then lets the loop serve its sockets before the next tick goes on. And what waits to be
// delivered — the backlog, counted in events (a revision weighs as many as this loop has
// subscriptions to its repository) — pushes back on writers: past `DeliveryBudget.maxBacklog`,
// a connection that writes hands over no further request until the backlog is below half of
// it (`whenDrained`). A slow reader never causes a backlog: its own queue overflows or
// coalesces.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// What one loop has done, for `stats`. Written only by its loop — a plain load and store,
/// no read-modify-write shared between threads — and read by anyone.
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

/// How much a loop delivers before it serves its sockets again, and how much may wait to be
/// delivered before writers are held back (see LoopShard).
struct DeliveryBudget: Sendable {
    /// Events one tick delivers before it lets the loop do its I/O (about 10–50 ms of work).
    var eventsPerTick = 65_536
    /// Events waiting to be delivered on one loop past which writers wait.
    var maxBacklog = 262_144
}

/// How many subscriptions to one repository one loop routes: the loop's news for that
/// repository, written only by the loop as it routes and unroutes, read by the repository as
/// it posts — a revision's weight on that loop, and whether to post there at all. Zero is
/// final: a loop's routes of a repository that empty take their count with them, and the
/// next subscription there starts a new one.
final class RouteCount: Sendable {
    let shard: LoopShard
    private let value = Atomic<Int>(0)

    fileprivate init(shard: LoopShard) { self.shard = shard }

    /// The subscriptions routed now (relaxed: a post that reads a count just ended finds no
    /// routes on the loop and is dropped there).
    var count: Int { value.load(ordering: .relaxed) }
    fileprivate func add(_ n: Int) { value.add(n, ordering: .relaxed) }
}

/// A reply that waits for several repositories' states (a `revoke` that deleted keys in
/// several): how many are still pending, and whether one failed (its error was sent).
final class WaitGroup {
    var remaining: Int
    var failed = false
    init(remaining: Int) { self.remaining = remaining }
}

final class LoopShard: @unchecked Sendable {
    // @unchecked Sendable: `inbox` is behind a lock (`Locked`), and `backlog` and `counters`
    // are atomics; every other stored property is read and written only on `loop` — by its
    // connections, sessions and `tick` — which the entry points assert in debug builds.

    let loop: IOLoop
    var index: Int { loop.index }
    let counters = LoopCounters()
    let budget: DeliveryBudget
    /// What the loop's `beforeTick` does — storage commits the loop's writes, and what it
    /// reports is delivered — when the storage mode made that cheap enough to do in the middle
    /// of a read too (`sync = relaxed`: no `fdatasync` per group); nil otherwise. Set once,
    /// where the server is assembled (`Hub.init`), before the loop runs. See `commitEarly`.
    var earlyCommit: (() -> Void)?

    private struct Inbox {
        /// Revisions posted from other threads; each tagged with its repository's id.
        var revisions = RecordBatch<UInt64>()
        var weights = 0
        var news: [DurabilityNews] = []
        var scheduled = false
        /// Writers' loops waiting for the backlog to go down (see `whenDrained`).
        var drainWaiters: [@Sendable () -> Void] = []
    }

    private let inbox = Locked(Inbox())
    /// Events posted and not yet delivered (an upper bound: each revision counts as many as
    /// its repository's subscriptions here).
    private let backlog = Atomic<Int>(0)

    // Loop-confined from here on.

    /// A repository's subscriptions on this loop, read in place by delivery.
    final class RepositoryRoutes {
        let repository: Repository
        /// Unmanaged: a routed subscription is always held strongly elsewhere — by its outbox
        /// while it is live, and by whoever ends it until it is unrouted — so routing a
        /// revision to a thousand subscribers retains and releases none of them.
        /// In place, through addressors (a stored property was copied out per revision: 4 % of
        /// the time at fan-out 1); so nothing may change it while a revision is routed.
        var routes: KeyedRoutes<Unmanaged<Subscription>> {
            unsafeAddress { UnsafePointer(storage) }
            unsafeMutableAddress { storage }
        }
        private let storage: UnsafeMutablePointer<KeyedRoutes<Unmanaged<Subscription>>>
        /// The newest revision delivered to this loop.
        var revision: UInt64 = 0
        var isRouting = false  // asserted in route/unroute (`deliver` unroutes after routing)
        /// `routes`' size, as the repository reads it.
        let count: RouteCount

        init(repository: Repository, shard: LoopShard) {
            self.repository = repository
            self.count = RouteCount(shard: shard)
            storage = .allocate(capacity: 1)
            storage.initialize(to: KeyedRoutes())
        }

        deinit {
            storage.deinitialize(count: 1)
            storage.deallocate()
        }
    }

    /// A reply (or a subscription's first messages) waiting for a state to be durable.
    struct Waiter {
        let sequence: StateSequence
        let connection: Connection
        let slot: Outbox.Slot
        let bytes: [UInt8]
        let events: Int
        let id: JSONValue
        /// Ends with the reply if the state is undone.
        let subscription: Subscription?
        /// A reply that waits for several repositories: sent when the last is durable.
        var group: WaitGroup? = nil
        /// A large subscription start, sent as a stream instead of `bytes`.
        var stream: OutboxStream? = nil
        /// The reply if the state is undone (nil: the plain storage failure).
        var failure: (@Sendable (StorageError) -> [UInt8])? = nil
    }

    var routes: [UInt64: RepositoryRoutes] = [:]
    /// Replies waiting for durability, by line (LoopShard+Durability.swift).
    var waiters: [UInt64: [Waiter]] = [:]
    /// Taken from the inbox and not yet delivered (the last tick ran out of its budget), and
    /// what they weigh in the backlog.
    private(set) var taken = RecordBatch<UInt64>()
    private var takenWeight = 0
    private var dirty: [Connection] = []
    private var writing: [Connection] = []  // `write`'s, kept for its capacity
    /// `deliver`'s scratch: the events one revision queued, the subscriptions it ended
    /// (LoopShard+Delivery.swift).
    var routedCount = 0
    var routedEnded: [Subscription] = []
    /// Memory lent to one connection after another for a run's events (`deliverRun`), and
    /// the bytes sent from it this tick.
    var runMemory = ByteQueue()
    var runBytesSent = 0
    /// Runs routed as one since the loop began (in-process tests look).
    private(set) var runsRouted = 0
    /// Events recent ticks delivered (the last tick's, or less than an eighth fewer than the
    /// figure before it): a large fan-out's ticks want long runs of writes (a connection sends
    /// replies early only while ticks are light: Connection.sendEarly).
    private(set) var recentTickEvents = 0
    /// How many connections recent ticks wrote to (the most, decaying like `recentTickEvents`).
    private(set) var recentTickWrites = 0
    static let manyWrites = 32  // past this many connections, a tick may write the newest first
    /// Connections whose session waits for a `sync` (Session+Sync.swift): checked after each
    /// tick's delivery.
    private var syncing: [Connection] = []
    /// Subscriptions that asked for `progress`, and the timer that sends them (while any).
    var progressing: [ObserverID: Subscription] = [:]
    var progressTimer: TimerID?

    init(loop: IOLoop, budget: DeliveryBudget = DeliveryBudget()) {
        self.loop = loop
        self.budget = budget
        loop.onTick = { [unowned self] in self.tick() }
    }

    // MARK: Posting (any thread)

    /// Queues a durable revision of `repository` (which has `weight` subscriptions here).
    /// Called under the repository's lock, so this loop sees its revisions in order — one
    /// queue, whichever thread posts (the lock is uncontended when the loop posts to itself).
    func post(_ revision: RevisionView, of repository: Repository, weight: Int) {
        backlog.wrappingAdd(weight, ordering: .relaxed)
        let schedule = inbox.withLock { box -> Bool in
            box.revisions.append(revision, tag: repository.id)
            box.weights += weight
            defer { box.scheduled = true }
            return !box.scheduled
        }
        if schedule { scheduleTick() }
    }

    /// Queues durability news; handled in the loop's next tick.
    func post(_ news: DurabilityNews) {
        let schedule = inbox.withLock { box -> Bool in
            box.news.append(news)
            defer { box.scheduled = true }
            return !box.scheduled
        }
        if schedule { scheduleTick() }
    }

    private func scheduleTick() {
        if loop.inLoop {
            loop.requestTick()
        } else {
            loop.execute { [self] in loop.requestTick() }
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

    /// Starts `subscription`: registers it with its connection's outbox and routes it here —
    /// unless the connection is closing. Returns this loop's count of subscriptions to its
    /// repository, for the repository to post by; nil if it did not start. Called with the
    /// repository's lock held (see `Repository.subscribe`), so no revision can slip between
    /// its start and its first event.
    func start(_ subscription: Subscription) -> RouteCount? {
        loop.assertInLoop()
        assert(subscription.connection.shard === self, "a subscription starts on its connection's loop")
        guard subscription.connection.outbox.register(subscription) else { return nil }
        let id = subscription.repository.id
        let entry = routes[id] ?? RepositoryRoutes(repository: subscription.repository, shard: self)
        assert(!entry.isRouting, "a subscription routed while a revision is routed")
        routes[id] = entry
        entry.routes.insert(.passUnretained(subscription), for: subscription.selection, id: subscription.routeID)
        entry.count.add(1)
        if subscription.progress {
            subscription.lastProgress = loop.now
            progressing[subscription.routeID] = subscription
            if progressTimer == nil { scheduleProgress() }
        }
        return entry.count
    }

    /// Ends subscription `id` of `outbox`'s connection: no event of it follows, and its route
    /// goes with it. The one way a subscription ends — an unsubscribe, a start that failed,
    /// a storage failure under its start — besides `end(allOf:closing:)`, `revoke` and this
    /// shard's delivery. Nil if it was not live.
    @discardableResult
    func end(_ id: UInt64, of outbox: Outbox) -> Subscription? {
        guard let subscription = outbox.unregister(id) else { return nil }
        unroute(subscription)
        return subscription
    }

    /// Ends every live subscription of `outbox`'s connection: `closing`, the connection closes
    /// (its queue goes too); otherwise it stays open for its replies.
    func end(allOf outbox: Outbox, closing: Bool) {
        for subscription in closing ? outbox.close() : outbox.unregisterAll() { unroute(subscription) }
    }

    /// Ends subscription `id` with `notice` as its last message (a `revoked` event). Nil if it
    /// was not live.
    func revoke(_ id: UInt64, notice: [UInt8], of outbox: Outbox) -> Subscription? {
        guard let subscription = outbox.revoke(id, notice: notice) else { return nil }
        unroute(subscription)
        return subscription
    }

    /// Stops routing to `subscription`. Idempotent. The shard's own (its delivery unroutes the
    /// `once` subscriptions a revision ended); every other end goes through `end` or `revoke`.
    /// One to a repository nobody wrote is reported to its connection, for the hub (a
    /// placeholder nobody uses any more goes).
    func unroute(_ subscription: Subscription) {
        loop.assertInLoop()
        let id = subscription.repository.id
        guard let entry = routes[id] else { return }
        assert(!entry.isRouting, "a subscription unrouted while a revision is routed")
        guard entry.routes.remove(subscription.routeID) != nil else { return }
        entry.count.add(-1)
        if entry.routes.count == 0 { routes[id] = nil }
        if subscription.progress { progressing[subscription.routeID] = nil }
        if !subscription.repository.isPermanent { subscription.connection.subscriptionEnded(subscription) }
    }

    /// Checks `connection`'s pending `sync` after each tick's delivery until it is answered.
    func awaitSync(_ connection: Connection) {
        loop.assertInLoop()
        syncing.append(connection)
        loop.requestTick()
    }

    /// Answers the pending `sync`s whose events are now queued (or storage undid `undone` of
    /// `line`: those it covers fail).
    func checkSyncs(failed: (line: any DurableLine, undone: ClosedRange<StateSequence>, error: StorageError)? = nil) {
        guard !syncing.isEmpty else { return }
        // Answering a sync runs its connection's later requests, and one of them may be a
        // `sync` that waits in turn (`awaitSync` adds to `syncing`): the list is taken out
        // while its syncs are answered, not filtered in place (that access overlapped the
        // append, and the daemon trapped).
        let waiting = syncing
        syncing = []
        var still: [Connection] = []
        for connection in waiting {
            guard let session = connection.session else { continue }
            if let failed { session.failSync(failed.line, undone: failed.undone, failed.error) }
            if !session.answerSync() { still.append(connection) }
        }
        syncing = still + syncing
    }

    /// The newest revision of `repository` delivered to this loop (0: none yet).
    func latestRevision(of repository: Repository) -> UInt64 {
        routes[repository.id]?.revision ?? 0
    }

    /// The lags of this loop's lagging coalescing subscriptions to repository `name`: what
    /// each still owes its client (in-process tests check their bound).
    func lags(ofRepository name: String) -> [Lag] {
        var lags: [Lag] = []
        for entry in routes.values where entry.repository.name == name {
            entry.routes.forEachRegistration { subscription in if let lag = subscription.takeUnretainedValue().lag { lags.append(lag) } }
        }
        return lags
    }

    // MARK: Output (on the loop)

    /// Writes `connection` at the end of this tick (once, however often it is asked).
    func markDirty(_ connection: Connection) {
        if connection.isDirty { return }
        connection.isDirty = true
        dirty.append(connection)
        loop.requestTick()
    }

    // MARK: The tick

    /// Handles what was posted — news first (a subscription that began on undone state ends
    /// before anything more is delivered to it), then revisions up to the budget of events,
    /// the rest in the next tick — then writes every connection that has output.
    func tick() {
        loop.assertInLoop()
        handle(takeInbox())
        var written = 0
        var delivered = 0
        var n = 0
        while n < taken.count, delivered < budget.eventsPerTick {
            guard let entry = routes[taken.entry(n).tag] else {  // no subscriptions here (any more)
                n += 1
                continue
            }
            let run = runLength(from: n, of: entry, limit: budget.eventsPerTick - delivered)
            if run > 1 {
                written += write(newestFirst: false)  // the replies so far go out before the run
                delivered += deliverRun(n..<n + run, to: entry)
                runsRouted += 1
                n += run
            } else {
                delivered += taken.withEntry(n) { deliver($1, to: entry) }
                n += 1
            }
        }
        taken.removeFirst(n)
        if delivered > 0 { counters.count(events: delivered) }
        checkSyncs()
        recentTickEvents = max(delivered, recentTickEvents - recentTickEvents / 8)
        if taken.isEmpty, takenWeight > 0 {
            settle(takenWeight)
            takenWeight = 0
        }
        recentTickWrites = max(dirty.count, recentTickWrites - recentTickWrites / 8)
        // A tick taking about a revision to many subscribers writes them first, then the
        // writers whose replies were ready when it began (as Redis does): 1 write in flight to
        // 100 subscribers, p99 282 → 137 µs. Else replies first, so writers send again sooner
        // (10 subscribers, 1 in flight: p99 35 → 42 µs otherwise; 100, 64 in flight: −25 %).
        written += write(newestFirst: dirty.count > Self.manyWrites && delivered <= dirty.count)
        written += runBytesSent
        runBytesSent = 0
        if written > 0 { counters.count(bytes: written) }
        // Out of budget, or more posted meanwhile: the rest after the loop has served its sockets.
        if !taken.isEmpty || inbox.withLock({ !$0.revisions.isEmpty || !$0.news.isEmpty }) { loop.requestTick() }
    }

    /// Takes the news alone (the revisions wait for the tick).
    func takeNews() -> [DurabilityNews] {
        inbox.withLock { box -> [DurabilityNews] in
            var news: [DurabilityNews] = []
            swap(&news, &box.news)
            return news
        }
    }

    /// Takes the news and — once everything taken before is delivered — the revisions.
    private func takeInbox() -> [DurabilityNews] {
        let canTake = taken.isEmpty
        return inbox.withLock { box -> [DurabilityNews] in
            box.scheduled = false
            var news: [DurabilityNews] = []
            swap(&news, &box.news)
            if canTake, !box.revisions.isEmpty {
                taken.swapWith(&box.revisions)
                takenWeight = box.weights
                box.weights = 0
            }
            return news
        }
    }

    /// Writes every connection with output, oldest first or newest first; the bytes sent.
    func write(newestFirst: Bool) -> Int {
        guard !dirty.isEmpty else { return 0 }
        swap(&dirty, &writing)  // a flush may mark connections dirty again: they wait for the next
        defer { writing.removeAll(keepingCapacity: true) }
        var written = 0
        let count = writing.count
        for i in 0..<count {
            let connection = writing[newestFirst ? count - 1 - i : i]
            connection.isDirty = false
            written += connection.flush()
        }
        return written
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
}
