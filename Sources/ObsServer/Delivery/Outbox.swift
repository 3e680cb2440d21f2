// ObsServer — one connection's outgoing queue: the single place where replies and events are
// put in the order the client must see them. A plain queue on its connection's loop; the
// connection drains it into the socket, once per tick.
//
// - Replies are appended in request order. A reply that is not ready yet (its state is not
//   durable yet, or the shared store has not answered) holds a *slot*: everything appended
//   after it waits behind it, so a subscription's events never overtake its subscribe reply
//   and pipelined replies stay in order. A slot counts as `slotBytes` toward the limit.
// - Events are appended by the loop's shard as it delivers revisions: the subscription's own
//   head, then the revision's body, encoded once for every subscriber. When the queue is at
//   its limit the connection overflows: the `overflow` event is its last message, every
//   subscription ends, and the connection closes once that is written or after the grace
//   period. Writers and other connections never wait for a slow reader.
// - What the socket has not taken counts against the limit: bytes leave the queue only when
//   the kernel accepts them.
// - A large subscription start is a *stream* (OutboxStream.swift): it holds its place like a
//   slot, and its pieces are produced into the ready bytes only while fewer than
//   `streamWindow` of them wait for the socket.

import ObsCore
import ObsProtocol
import ObsValues
import ObservableKit

/// Limits of one connection's outgoing queue.
struct OutboxLimits: Sendable {
    var maxBytes: Int
    var maxEvents: Int
    /// Nanoseconds an overflowed connection may take to read its queue before it is closed.
    var grace: UInt64
}

final class Outbox {
    /// Identifies a reserved reply slot.
    struct Slot: Equatable { fileprivate let number: UInt64 }

    /// What happened to a change event handed to `deliver`.
    enum Delivery {
        /// Queued.
        case delivered
        /// Nothing queued: the subscription is not live here, the revision is its own
        /// connection's (`echo: false`), or it was folded into a coalescing lag.
        case skipped
        /// Queued, and it was the only event of a `once` subscription, which has ended: the
        /// reference this outbox held, for the caller to keep until it has unrouted it (routes
        /// hold subscriptions unretained; this may be the last reference).
        case ended(Subscription)
        /// The queue was full: the connection overflowed and these subscriptions ended.
        case overflowed([Subscription])
    }

    private enum Chunk {
        case bytes([UInt8], events: Int)
        case pending(Slot)
        case stream(OutboxStream)
    }

    /// A stream's next pieces are produced while fewer ready bytes than this wait.
    static let streamWindow = 1 << 20

    private enum Phase { case open, overflowed, closed }

    /// What a pending slot counts toward the byte limit (a reply's typical size).
    static let slotBytes = 64

    /// The connection this queue belongs to (the origin of its writes, for `echo: false`).
    let connection: ConnectionID
    let limits: OutboxLimits
    private let stats: ServerStats
    /// This connection's live subscriptions, for `stats`.
    let tally = SubscriptionTally()

    /// Bytes that may be sent now: everything before the first pending slot.
    private var ready = ByteQueue()
    /// Where events in `ready` end (stream positions), to count what a partial send left.
    private var eventEnds: [(end: Int, count: Int)] = []
    private var eventEndsHead = 0
    /// Behind the first pending slot: slots and the bytes between them.
    private var blocked: [Chunk] = []
    /// Bytes and events queued (not yet taken by the socket); slots count `slotBytes`.
    private(set) var queuedBytes = 0
    private(set) var queuedEvents = 0
    private var phase = Phase.open
    /// This connection's live subscriptions, by id (Outbox+Subscriptions.swift).
    var live: [UInt64: Subscription] = [:]
    /// Coalescing subscriptions with changes folded while the queue was full (Coalescing.swift).
    var lagging: [Subscription] = []
    private var nextSlot: UInt64 = 0
    /// The newest revision of a repository delivered on this loop (a coalesced event's `rev`).
    let latestRevision: (Repository) -> UInt64

    init(limits: OutboxLimits, stats: ServerStats, connection: ConnectionID = .next(), latestRevision: @escaping (Repository) -> UInt64) {
        self.limits = limits
        self.stats = stats
        self.connection = connection
        self.latestRevision = latestRevision
    }

    // MARK: Replies

    /// Appends ready bytes (a reply, or a subscription's first messages).
    func append(_ bytes: UnsafeRawBufferPointer, events: Int = 0) {
        guard phase == .open else { return }
        appendToOpenEnd(events: events) { $0.writeBytes(bytes) }
    }

    /// Appends a reply encoded by `write` straight into the queue.
    func appendReply(_ write: (inout ByteQueue) -> Void) {
        guard phase == .open else { return }
        appendToOpenEnd(events: 0, write)
    }

    /// Reserves the position of a reply that will be known later.
    func reserveSlot() -> Slot {
        nextSlot += 1
        let slot = Slot(number: nextSlot)
        guard phase == .open else { return slot }
        blocked.append(.pending(slot))
        queuedBytes += Self.slotBytes
        return slot
    }

    /// Fills a reserved slot; what it held back becomes ready as far as the next pending slot.
    func fill(_ slot: Slot, with bytes: [UInt8], events: Int = 0) {
        guard phase != .closed, let index = blocked.firstIndex(where: { if case .pending(slot) = $0 { true } else { false } }) else { return }
        blocked[index] = .bytes(bytes, events: events)
        queuedBytes += bytes.count - Self.slotBytes
        queuedEvents += events
        releaseBlocked()
    }

    /// Fills a reserved slot with a stream: its pieces are produced as the socket takes them.
    func fill(_ slot: Slot, with stream: OutboxStream) {
        guard phase != .closed, let index = blocked.firstIndex(where: { if case .pending(slot) = $0 { true } else { false } }) else { return }
        blocked[index] = .stream(stream)
        queuedBytes -= Self.slotBytes
        queuedEvents += stream.events
        releaseBlocked()
    }

    /// Appends a stream (a large subscription start) at the open end.
    func append(_ stream: OutboxStream) {
        guard phase == .open else { return }
        blocked.append(.stream(stream))
        queuedEvents += stream.events
        releaseBlocked()
    }

    /// Moves the chunks before the first pending slot into `ready`; of a stream at the head,
    /// as many pieces as the window takes (the stream stays at the head until it is done).
    private func releaseBlocked() {
        var released = 0
        release: for chunk in blocked {
            switch chunk {
            case .bytes(let bytes, let events):
                bytes.withUnsafeBytes { ready.writeBytes($0) }
                if events > 0 { eventEnds.append((ready.appended, events)) }
            case .pending:
                break release
            case .stream(let stream):
                while ready.count < Self.streamWindow, let piece = stream.next() {
                    piece.withUnsafeBytes { ready.writeBytes($0) }
                    queuedBytes += piece.count
                }
                guard ready.count < Self.streamWindow else { break release }
                // Done: its events end here.
                if stream.events > 0 { eventEnds.append((ready.appended, stream.events)) }
            }
            released += 1
        }
        if released > 0 { blocked.removeFirst(released) }
    }

    /// Appends at the open end: `ready` when nothing is blocked, else after the last slot.
    private func appendToOpenEnd(events: Int, _ write: (inout ByteQueue) -> Void) {
        if blocked.isEmpty {
            let before = ready.count
            write(&ready)
            queuedBytes += ready.count - before
            if events > 0 { eventEnds.append((ready.appended, events)) }
        } else {
            var queue = ByteQueue()
            write(&queue)
            queuedBytes += queue.count
            var bytes: [UInt8] = []
            var count = 0
            if case .bytes(let last, let n) = blocked[blocked.count - 1] {
                (bytes, count) = (last, n)
                blocked.removeLast()
            }
            queue.withUnsentBytes { bytes.append(contentsOf: $0) }
            blocked.append(.bytes(bytes, events: count + events))
        }
        queuedEvents += events
    }

    // MARK: Events

    /// Whether the queue is at its limit: a new event overflows the connection (or, for a
    /// coalescing subscription, is folded into its lag).
    var isFull: Bool { queuedBytes >= limits.maxBytes || queuedEvents >= limits.maxEvents }

    /// Queues the change event of `revision` for `subscription`, folds it into the
    /// subscription's lag (coalescing), skips it (`echo: false`), or overflows.
    func deliver(_ revision: RevisionView, selected: SelectedChanges, to subscription: Subscription) -> Delivery {
        guard phase == .open, subscription.isLive else { return .skipped }
        if subscription.coalesce, subscription.lag != nil || isFull {
            fold(revision, selected: selected, into: subscription)
            return .skipped
        }
        guard subscription.wants(revision) else {
            subscription.completeThrough = revision.revision  // nothing to send: nothing missed
            return .skipped
        }
        if isFull { return .overflowed(overflow()) }
        if blocked.isEmpty {
            // The common case, written in place: no closure, nothing retained.
            let before = ready.count
            subscription.writeHead(&ready)
            if subscription.writers, let writer = revision.info.writer { EventEncoder.writeBy(&ready, writer) }
            revision.writeBody(&ready, selected: selected)
            queuedBytes += ready.count - before
            queuedEvents += 1
            eventEnds.append((ready.appended, 1))
        } else {
            appendToOpenEnd(events: 1) { sink in
                subscription.writeHead(&sink)
                if subscription.writers, let writer = revision.info.writer { EventEncoder.writeBy(&sink, writer) }
                revision.writeBody(&sink, selected: selected)
            }
        }
        if subscription.once {
            let ended = live.removeValue(forKey: subscription.id)
            subscription.isLive = false
            count(subscriptions: -1)
            return ended.map { .ended($0) } ?? .delivered
        }
        subscription.completeThrough = revision.revision
        return .delivered
    }

    /// Appends an event encoded by `write` (a coalesced change; Coalescing.swift).
    func appendEvent(_ write: (inout ByteQueue) -> Void) {
        appendToOpenEnd(events: 1, write)
    }

    /// Marks the connection overflowed: queues the `overflow` event, ends every subscription.
    /// The connection closes once that is written, or after the grace period.
    private func overflow() -> [Subscription] {
        phase = .overflowed
        let revs = OverflowEvent(revisions: live.mapValues(\.completeThrough))
        let victims = Array(live.values)
        for subscription in victims { subscription.isLive = false }
        count(subscriptions: -victims.count)
        live.removeAll()
        lagging.removeAll()
        stats.overflows.add(1, ordering: .relaxed)
        appendToOpenEnd(events: 1) { revs.encode(into: &$0) }
        return victims
    }

    // MARK: Writing

    /// Whether the queue holds at least its byte limit (the connection stops reading requests).
    var isCongested: Bool { queuedBytes >= limits.maxBytes }

    /// Whether requests should still be handled.
    var isOpen: Bool { phase == .open }
    var isOverflowed: Bool { phase == .overflowed }

    /// Whether nothing is queued or reserved here.
    var isEmpty: Bool { ready.isEmpty && blocked.isEmpty }
    /// Whether bytes are ready to be sent.
    var hasReady: Bool { !ready.isEmpty }
    /// Whether replies wait in slots (for durability, or a decision made elsewhere).
    var holdsSlots: Bool { !blocked.isEmpty }

    /// What a flush did.
    enum Flushed {
        /// Everything ready is sent (`bytes` of it now); nothing or only held-back replies remain.
        case drained(bytes: Int)
        /// The socket took `bytes` and no more: wait until it is writable.
        case partial(bytes: Int)
        /// The socket failed (the peer is gone).
        case failed(Int32)
    }

    /// Sends what is ready — and, once the queue has room again, the coalesced events of
    /// lagging subscriptions.
    func flush(to fd: Int32) -> Flushed {
        guard phase != .closed else { return .drained(bytes: 0) }
        var total = 0
        var lagReleased = false
        while true {
            switch send(to: fd) {
            case .all(let n): total += n
            case .some(let n): return .partial(bytes: total + n)
            case .failed(let e): return .failed(e)
            }
            // A stream at the head: its next pieces, until the socket is full or it is done.
            if case .stream = blocked.first {
                releaseBlocked()
                if !ready.isEmpty { continue }
            }
            guard !lagReleased, !lagging.isEmpty, phase == .open, queuedBytes < limits.maxBytes / 2, queuedEvents < limits.maxEvents / 2 else { break }
            lagReleased = true
            releaseLag()
        }
        return .drained(bytes: total)
    }

    /// Lends the queue `memory` (empty) to write a run of events into, if nothing is queued or
    /// reserved here; whether it did. `sendLent` sends them and gives it back.
    func borrow(_ memory: inout ByteQueue) -> Bool {
        guard phase == .open, ready.isEmpty, blocked.isEmpty else { return false }
        ready.exchangeMemory(with: &memory)
        return true
    }

    /// Sends what is ready (after `borrow`); returns the lent memory if all of it went, else
    /// keeps it (the rest waits there) and gives `memory` its own, empty. The bytes sent.
    func sendLent(to fd: Int32, returning memory: inout ByteQueue) -> Int {
        let sent: Int
        switch send(to: fd) {
        case .all(let n), .some(let n): sent = n
        case .failed: sent = 0  // the connection's flush at the tick's end fails and closes it
        }
        if ready.isEmpty { ready.exchangeMemory(with: &memory) }
        return sent
    }

    private func send(to fd: Int32) -> ByteQueue.Sent {
        let before = ready.appended - ready.count
        let sent = ready.send(to: fd)
        let n: Int
        switch sent {
        case .all(let k), .some(let k): n = k
        case .failed: n = 0
        }
        if n > 0 {
            queuedBytes -= n
            let position = before + n
            while eventEndsHead < eventEnds.count, eventEnds[eventEndsHead].end <= position {
                queuedEvents -= eventEnds[eventEndsHead].count
                eventEndsHead += 1
            }
            if eventEndsHead == eventEnds.count {
                eventEnds.removeAll(keepingCapacity: true)
                eventEndsHead = 0
            }
        }
        return sent
    }

    /// Closes the queue; returns the subscriptions that were still live.
    func close() -> [Subscription] {
        phase = .closed
        lagging.removeAll()
        blocked.removeAll()
        ready.clear()
        eventEnds.removeAll()
        eventEndsHead = 0
        queuedBytes = 0
        queuedEvents = 0
        return unregisterAll()
    }

    func count(subscriptions n: Int) {
        stats.subscriptions.add(n, ordering: .relaxed)
        tally.add(n)
    }
}

@available(*, unavailable)
extension Outbox: Sendable {}
