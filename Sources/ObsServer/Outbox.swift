// ObsServer — one connection's outgoing queue: the single place where replies and events
// are put in the order the client must see them.
//
// - Replies are appended in request order. A reply that is not ready yet (its write is
//   not durable yet, or a subscription's first messages) holds a *slot*: everything
//   appended after it waits behind it, so a subscription's events can never overtake its
//   subscribe reply, and pipelined replies stay in order.
// - Events are appended by whichever thread delivers a revision. The queue is bounded in
//   bytes and events: a delivery that finds it full marks the connection overflowed,
//   appends the `overflow` event as the last message and ends every subscription; the
//   connection closes once that is written, or after the grace period. Writers and other
//   connections never wait for a slow reader.
// - Appends from other threads schedule one flush per event-loop tick; the connection
//   handler flushes replies at the end of each read.
// The lock is a leaf: nothing else is locked while it is held.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit

/// Limits of one connection's outgoing queue.
struct OutboxLimits: Sendable {
    var maxBytes: Int
    var maxEvents: Int
    /// How long an overflowed connection may take to read its queue before it is closed.
    var grace: TimeAmount
}

final class Outbox: Sendable {
    /// Identifies a reserved reply slot.
    struct Slot: Sendable, Equatable { fileprivate let number: UInt64 }

    /// What happened to a change event handed to `deliver`.
    enum Delivery {
        /// Queued.
        case delivered
        /// The subscription is no longer live on this connection; nothing was queued.
        case skipped
        /// Queued, and it was the only event of a `once` subscription, which has ended.
        case ended
        /// The queue was full: the connection overflowed and these subscriptions ended.
        case overflowed([Subscription])
    }

    private enum Chunk {
        case ready(ByteBuffer, events: Int)
        case pending(Slot)
    }

    private enum Phase { case open, overflowed, closed }

    private struct Live {
        let subscription: Subscription
        /// Every change this subscription selects up to here was queued.
        var completeThrough: UInt64
    }

    private struct State {
        var chunks = CircularBuffer<Chunk>()
        /// Bytes and events queued: in chunks, and written to the channel but not yet sent.
        var queuedBytes = 0
        var queuedEvents = 0
        var flushScheduled = false
        var phase = Phase.open
        var live: [UInt64: Live] = [:]
        var nextSlot: UInt64 = 0
    }

    let channel: any Channel
    let limits: OutboxLimits
    private let stats: ServerStats
    private let state = Locked(State())
    private let allocator = ByteBufferAllocator()
    /// Called on the event loop after a write completes that drained the queue below half
    /// its byte limit, or emptied it.
    private let onProgress: NIOLoopBound<(() -> Void)?>

    init(channel: any Channel, limits: OutboxLimits, stats: ServerStats, onProgress: (() -> Void)?) {
        self.channel = channel
        self.limits = limits
        self.stats = stats
        self.onProgress = NIOLoopBound(onProgress, eventLoop: channel.eventLoop)
    }

    // MARK: Replies

    /// Appends ready bytes (a reply, or events that belong to one). The caller flushes.
    func append(_ bytes: ByteBuffer, events: Int = 0) {
        state.withLock { s in
            guard s.phase == .open else { return }
            Self.push(bytes, events: events, into: &s)
        }
    }

    /// Reserves the position of a reply that will be known later.
    func reserveSlot() -> Slot {
        state.withLock { s in
            s.nextSlot += 1
            let slot = Slot(number: s.nextSlot)
            if s.phase == .open { s.chunks.append(.pending(slot)) }
            return slot
        }
    }

    /// Fills a reserved slot. Schedules a flush when this unblocks the head of the queue.
    func fill(_ slot: Slot, with bytes: ByteBuffer, events: Int = 0) {
        let schedule = state.withLock { s -> Bool in
            guard s.phase != .closed,
                let i = s.chunks.firstIndex(where: { if case .pending(slot) = $0 { return true } else { return false } })
            else { return false }
            s.chunks[i] = .ready(bytes, events: events)
            s.queuedBytes += bytes.readableBytes
            s.queuedEvents += events
            return i == s.chunks.startIndex && Self.claimFlush(&s)
        }
        if schedule { scheduleFlush() }
    }

    // MARK: Subscriptions

    /// Makes a subscription live on this connection, complete through `revision`.
    /// Returns `false` if the connection is no longer open.
    func register(_ subscription: Subscription, completeThrough revision: UInt64) -> Bool {
        state.withLock { s in
            guard s.phase == .open else { return false }
            s.live[subscription.id] = Live(subscription: subscription, completeThrough: revision)
            stats.subscriptions.add(1, ordering: .relaxed)
            return true
        }
    }

    /// Ends a live subscription; returns it, or `nil` if it is not live (unknown, ended
    /// by `once`, or by overflow). No event of it is queued after this returns.
    func unregister(_ id: UInt64) -> Subscription? {
        state.withLock { s in
            guard let live = s.live.removeValue(forKey: id) else { return nil }
            stats.subscriptions.subtract(1, ordering: .relaxed)
            return live.subscription
        }
    }

    /// The number of live subscriptions.
    var liveCount: Int { state.withLock { $0.live.count } }

    /// The live subscriptions.
    var liveSubscriptions: [Subscription] { state.withLock { $0.live.values.map(\.subscription) } }

    /// Ends every live subscription (the connection stays open for its replies); returns them.
    func unregisterAll() -> [Subscription] {
        state.withLock { s in
            let ended = s.live.values.map(\.subscription)
            stats.subscriptions.subtract(ended.count, ordering: .relaxed)
            s.live.removeAll()
            return ended
        }
    }

    /// Ends a live subscription and queues `notice` (its last message) in the same step, so
    /// no event of it follows. Returns it, or nil if it was not live.
    func revoke(_ id: UInt64, notice: ByteBuffer) -> Subscription? {
        let (ended, schedule) = state.withLock { s -> (Subscription?, Bool) in
            guard s.phase == .open, let live = s.live.removeValue(forKey: id) else { return (nil, false) }
            stats.subscriptions.subtract(1, ordering: .relaxed)
            Self.push(notice, events: 1, into: &s)
            return (live.subscription, Self.claimFlush(&s))
        }
        if schedule { scheduleFlush() }
        return ended
    }

    // MARK: Events

    /// Queues the change event of `record` for `subscription`, or overflows.
    func deliver(_ record: RevisionRecord, selected: SelectedChanges, to subscription: Subscription) -> Delivery {
        var schedule = false
        let outcome = state.withLock { s -> Delivery in
            guard s.phase == .open, s.live[subscription.id] != nil else { return .skipped }
            if s.queuedBytes >= limits.maxBytes || s.queuedEvents >= limits.maxEvents {
                let victims = overflow(&s)
                schedule = Self.claimFlush(&s)
                return .overflowed(victims)
            }
            Self.append(into: &s, allocator: allocator, capacity: record.body.count + 48) { buffer in
                record.writeEvent(&buffer, sub: subscription.id, selected: selected)
            }
            schedule = Self.claimFlush(&s)
            if subscription.once {
                s.live[subscription.id] = nil
                stats.subscriptions.subtract(1, ordering: .relaxed)
                return .ended
            }
            s.live[subscription.id]!.completeThrough = record.revision
            return .delivered
        }
        if schedule { scheduleFlush() }
        if case .overflowed = outcome {
            channel.eventLoop.scheduleTask(in: limits.grace) { [channel] in channel.close(promise: nil) }
        }
        return outcome
    }

    /// Marks the connection overflowed: queues the `overflow` event, ends every subscription.
    private func overflow(_ s: inout State) -> [Subscription] {
        s.phase = .overflowed
        let revs = s.live.map { (sub: $0.key, rev: $0.value.completeThrough) }.sorted { $0.sub < $1.sub }
        var buffer = allocator.buffer(capacity: 32 + 24 * revs.count)
        EventEncoder.writeOverflow(&buffer, revs: revs)
        s.chunks.append(.ready(buffer, events: 1))
        s.queuedBytes += buffer.readableBytes
        s.queuedEvents += 1
        let victims = s.live.values.map(\.subscription)
        stats.subscriptions.subtract(victims.count, ordering: .relaxed)
        stats.overflows.add(1, ordering: .relaxed)
        s.live.removeAll()
        return victims
    }

    // MARK: Flushing

    /// Whether the queue holds at least its byte limit (the handler stops reading requests).
    var isCongested: Bool { state.withLock { $0.queuedBytes >= limits.maxBytes } }

    /// Whether requests should still be processed.
    var isOpen: Bool { state.withLock { $0.phase == .open } }

    /// Whether nothing is queued, reserved or on its way to the socket.
    var isIdle: Bool { state.withLock { $0.chunks.isEmpty && $0.queuedBytes == 0 } }

    /// Flushes later in this event-loop tick (once, however often it is asked).
    func requestFlush() {
        if state.withLock({ Self.claimFlush(&$0) }) { scheduleFlush() }
    }

    /// Writes every ready chunk at the head of the queue. Must run on the event loop.
    func flush() {
        channel.eventLoop.assertInEventLoop()
        let (ready, bytes, events) = state.withLock { s -> ([ByteBuffer], Int, Int) in
            s.flushScheduled = false
            var ready: [ByteBuffer] = []
            var bytes = 0
            var events = 0
            while let first = s.chunks.first, case .ready(let buffer, let n) = first {
                s.chunks.removeFirst()
                ready.append(buffer)
                bytes += buffer.readableBytes
                events += n
            }
            return (ready, bytes, events)
        }
        guard let last = ready.last else { return }
        for buffer in ready.dropLast() { channel.write(buffer, promise: nil) }
        stats.bytesOut.add(bytes, ordering: .relaxed)
        channel.writeAndFlush(last).whenComplete { [self] _ in
            self.written(bytes: bytes, events: events)
        }
    }

    /// Accounts for bytes that left the process (or were dropped by a closed channel).
    private func written(bytes: Int, events: Int) {
        let (progress, finished) = state.withLock { s -> (Bool, Bool) in
            let wasCongested = s.queuedBytes >= limits.maxBytes / 2
            s.queuedBytes -= bytes
            s.queuedEvents -= events
            let drained = wasCongested && s.queuedBytes < limits.maxBytes / 2
            let empty = s.queuedBytes == 0 && s.chunks.isEmpty
            return (drained || empty, s.phase == .overflowed && empty)
        }
        if finished { channel.close(promise: nil) }
        if progress { onProgress.value?() }
    }

    /// Closes the queue; returns the subscriptions that were still live.
    func close() -> [Subscription] {
        state.withLock { s in
            s.phase = .closed
            s.chunks.removeAll()
            let remaining = s.live.values.map(\.subscription)
            stats.subscriptions.subtract(remaining.count, ordering: .relaxed)
            s.live.removeAll()
            return remaining
        }
    }

    // MARK: Helpers

    /// Queues encoded bytes: small ones are copied into the tail chunk, larger ones become
    /// a chunk of their own.
    private static func push(_ bytes: ByteBuffer, events: Int, into s: inout State) {
        if bytes.readableBytes < 4096, appendToTail(&s, events: events, { tail in tail.writeImmutableBuffer(bytes) }) { return }
        s.queuedBytes += bytes.readableBytes
        s.queuedEvents += events
        s.chunks.append(.ready(bytes, events: events))
    }

    /// Encodes one event straight into the tail chunk when it has room (no buffer of its
    /// own per event and subscriber: this runs once per delivered event), else into a new chunk.
    private static func append(
        into s: inout State, allocator: ByteBufferAllocator, capacity: Int, _ write: (inout ByteBuffer) -> Void
    ) {
        if appendToTail(&s, events: 1, write) { return }
        var buffer = allocator.buffer(capacity: capacity)
        write(&buffer)
        s.queuedBytes += buffer.readableBytes
        s.queuedEvents += 1
        s.chunks.append(.ready(buffer, events: 1))
    }

    /// Writes into the tail chunk, in place, if it is ready and under 64 KiB; `false`
    /// (nothing written) otherwise.
    private static func appendToTail(_ s: inout State, events: Int, _ write: (inout ByteBuffer) -> Void) -> Bool {
        guard let last = s.chunks.indices.last, case .ready(var tail, let n) = s.chunks[last], tail.readableBytes < 64 * 1024
        else { return false }
        s.chunks[last] = .ready(ByteBuffer(), events: 0)  // `tail` is now the only reference: no copy
        let before = tail.readableBytes
        write(&tail)
        s.queuedBytes += tail.readableBytes - before
        s.queuedEvents += events
        s.chunks[last] = .ready(tail, events: n + events)
        return true
    }

    /// Marks a flush as scheduled; `true` if the caller must schedule it.
    private static func claimFlush(_ s: inout State) -> Bool {
        if s.flushScheduled { return false }
        s.flushScheduled = true
        return true
    }

    private func scheduleFlush() {
        channel.eventLoop.execute { [self] in self.flush() }
    }
}
