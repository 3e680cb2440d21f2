// ObsServer — one connection's outgoing queue: the single place where replies and events
// are put in the order the client must see them. It lives on the connection's event loop
// and takes no lock.
//
// - Replies are appended in request order. A reply that is not ready yet (its state is not
//   durable yet) holds a *slot*: everything appended after it waits behind it, so a
//   subscription's events never overtake its subscribe reply, and pipelined replies stay
//   in order. A slot counts as `slotBytes` toward the queue limit until it is filled.
// - Events are appended by the loop's shard as it delivers revisions: the subscription's
//   own head, then the revision's body, encoded once for every subscriber. When the queue
//   is at its limit the connection overflows: the `overflow` event is its last message,
//   every subscription ends, and it closes once that is written or after the grace period.
//   Writers and other connections never wait for a slow reader.
// - The shard writes each connection with output once per loop tick: ready bytes are handed
//   to the channel while it is writable (NIO buffers up to its write watermark), the rest
//   waits here and counts against the limit. Handing bytes over drains the queue; what the
//   socket layer then holds past its watermark counts against the limit too, until the
//   channel is writable again.

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

final class Outbox {
    /// Identifies a reserved reply slot.
    struct Slot: Equatable { fileprivate let number: UInt64 }

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

    /// What a pending slot counts toward the byte limit (a reply's typical size).
    static let slotBytes = 64

    let shard: LoopShard
    /// The connection this queue belongs to (the origin of its writes, for `echo: false`).
    let connection = ConnectionID.next()
    let limits: OutboxLimits
    private let stats: ServerStats
    /// This connection's live subscriptions, for `stats`.
    let tally = SubscriptionTally()
    /// Where bytes are written: the connection handler's context (nil once it is removed).
    var context: ChannelHandlerContext?
    /// Called when the queue drains below half its byte limit, or becomes empty.
    var onProgress: (() -> Void)?
    /// Set by the shard while the outbox is on its list of connections to write.
    var isDirty = false

    /// Chunks before `tail`: sealed ready bytes and pending slots.
    private var chunks = CircularBuffer<Chunk>()
    /// Chunks taken off the head so far, and the position (counted from the first chunk
    /// ever) after the slot filled last: where the next fill looks first.
    private var removedChunks = 0
    private var fillHint = 0
    /// The open end of the queue, where replies and events are appended.
    private var tail: ByteBuffer
    private var tailEvents = 0
    /// Bytes and events queued here (not yet handed to the channel); slots count `slotBytes`.
    private(set) var queuedBytes = 0
    /// Bytes handed over that the socket layer still held past its write watermark at the
    /// last flush (0 while it is writable).
    private var socketBacklog = 0
    private(set) var queuedEvents = 0
    private var phase = Phase.open
    /// The close that ends an overflowed connection's grace period (cancelled if it closes first).
    private var graceClose: Scheduled<Void>?
    private(set) var live: [UInt64: Subscription] = [:]
    /// Coalescing subscriptions with changes folded while the queue was full (Coalescing.swift).
    var lagging: [Subscription] = []
    private var nextSlot: UInt64 = 0
    private let allocator: ByteBufferAllocator

    init(shard: LoopShard, limits: OutboxLimits, stats: ServerStats, allocator: ByteBufferAllocator) {
        self.shard = shard
        self.limits = limits
        self.stats = stats
        self.allocator = allocator
        self.tail = allocator.buffer(capacity: 0)
    }

    // MARK: Replies

    /// Appends ready bytes (a reply, or events that belong to one). The caller marks the
    /// outbox dirty (or flushes).
    func append(_ bytes: ByteBuffer, events: Int = 0) {
        guard phase == .open else { return }
        appendToTail(bytes, events: events)
    }

    /// Appends a reply encoded by `write` straight into the queue.
    func appendReply(_ write: (inout ByteBuffer) -> Void) {
        guard phase == .open else { return }
        let before = tail.readableBytes
        write(&tail)
        queuedBytes += tail.readableBytes - before
    }

    /// Reserves the position of a reply that will be known later.
    func reserveSlot() -> Slot {
        nextSlot += 1
        let slot = Slot(number: nextSlot)
        guard phase == .open else { return slot }
        sealTail()
        chunks.append(.pending(slot))
        queuedBytes += Self.slotBytes
        return slot
    }

    /// Fills a reserved slot. Slots are filled mostly in order, so the search starts after
    /// the slot filled last and ends at once: releasing n pipelined replies costs O(n).
    func fill(_ slot: Slot, with bytes: ByteBuffer, events: Int = 0) {
        guard phase != .closed else { return }
        let hint = min(chunks.count, max(0, fillHint - removedChunks))
        guard let offset = offset(of: slot, in: hint..<chunks.count) ?? offset(of: slot, in: 0..<hint) else { return }
        chunks[chunks.index(chunks.startIndex, offsetBy: offset)] = .ready(bytes, events: events)
        fillHint = removedChunks + offset + 1
        queuedBytes += bytes.readableBytes - Self.slotBytes
        queuedEvents += events
    }

    /// Where `slot` is among the chunks at `offsets` from the head.
    private func offset(of slot: Slot, in offsets: Range<Int>) -> Int? {
        var index = chunks.index(chunks.startIndex, offsetBy: offsets.lowerBound)
        for offset in offsets {
            if case .pending(slot) = chunks[index] { return offset }
            index = chunks.index(after: index)
        }
        return nil
    }

    // MARK: Subscriptions

    /// Makes a subscription live on this connection. Returns `false` if the connection is
    /// no longer open.
    func register(_ subscription: Subscription) -> Bool {
        guard phase == .open else { return false }
        live[subscription.id] = subscription
        count(subscriptions: 1)
        return true
    }

    /// Ends a live subscription; returns it, or `nil` if it is not live (unknown, ended
    /// by `once`, or by overflow). No event of it is queued after this returns.
    func unregister(_ id: UInt64) -> Subscription? {
        guard let subscription = live.removeValue(forKey: id) else { return nil }
        count(subscriptions: -1)
        return subscription
    }

    /// Ends every live subscription (the connection stays open for its replies); returns them.
    func unregisterAll() -> [Subscription] {
        let ended = Array(live.values)
        count(subscriptions: -ended.count)
        live.removeAll()
        return ended
    }

    /// The number of live subscriptions.
    var liveCount: Int { live.count }

    /// The live subscriptions.
    var liveSubscriptions: [Subscription] { Array(live.values) }

    /// Ends a live subscription and queues `notice` (its last message) in the same step, so
    /// no event of it follows. Returns it, or nil if it was not live.
    func revoke(_ id: UInt64, notice: ByteBuffer) -> Subscription? {
        guard phase == .open, let subscription = live.removeValue(forKey: id) else { return nil }
        count(subscriptions: -1)
        appendToTail(notice, events: 1)
        return subscription
    }

    // MARK: Events

    /// Whether the queue is at its limit: a new event overflows the connection (or, for a
    /// coalescing subscription, is folded into its lag).
    var isFull: Bool { heldBytes >= limits.maxBytes || queuedEvents >= limits.maxEvents }

    /// Queues the change event of `record` for `subscription`, folds it into the
    /// subscription's lag (coalescing), skips it (`echo: false`), or overflows.
    func deliver(_ record: Revision, selected: SelectedChanges, to subscription: Subscription) -> Delivery {
        guard phase == .open, live[subscription.id] != nil else { return .skipped }
        if subscription.coalesce, subscription.lag != nil || isFull {
            fold(record, selected: selected, into: subscription)
            return .skipped
        }
        guard subscription.wants(record) else {
            subscription.completeThrough = record.revision  // nothing to send: nothing missed
            return .skipped
        }
        if isFull { return .overflowed(overflow()) }
        let before = tail.readableBytes
        tail.writeRaw(subscription.head)
        if subscription.writers, let writer = record.record.writer { EventEncoder.writeBy(&tail, writer) }
        record.writeEventBody(&tail, selected: selected)
        queuedBytes += tail.readableBytes - before
        queuedEvents += 1
        tailEvents += 1
        if subscription.once {
            live[subscription.id] = nil
            count(subscriptions: -1)
            return .ended
        }
        subscription.completeThrough = record.revision
        return .delivered
    }

    /// Marks the connection overflowed: queues the `overflow` event, ends every
    /// subscription, and closes the connection after the grace period if it is still open.
    private func overflow() -> [Subscription] {
        phase = .overflowed
        let revs = live.map { (sub: $0.key, rev: $0.value.completeThrough) }.sorted { $0.sub < $1.sub }
        var buffer = allocator.buffer(capacity: 32 + 24 * revs.count)
        EventEncoder.writeOverflow(&buffer, revs: revs)
        appendToTail(buffer, events: 1)
        let victims = Array(live.values)
        count(subscriptions: -victims.count)
        stats.overflows.add(1, ordering: .relaxed)
        live.removeAll()
        if let channel = context?.channel {
            graceClose = channel.eventLoop.scheduleTask(in: limits.grace) { channel.close(promise: nil) }
        }
        return victims
    }

    // MARK: Writing

    /// Whether the queue holds at least its byte limit (the handler stops reading requests).
    var isCongested: Bool { heldBytes >= limits.maxBytes }

    /// What counts against the byte limit: the queue, and what the socket layer holds once it
    /// holds more than its write watermark.
    var heldBytes: Int { queuedBytes + socketBacklog }

    /// Whether requests should still be processed.
    var isOpen: Bool { phase == .open }

    /// Whether nothing is queued or reserved here (the channel may still be writing).
    var isEmpty: Bool { chunks.isEmpty && tail.readableBytes == 0 }

    /// Hands ready bytes to the channel, from the head of the queue up to the first pending
    /// slot, while the channel is writable — and, once the queue has room again, the
    /// coalesced events of lagging subscriptions; returns the number of bytes handed over.
    @discardableResult
    func flush() -> Int {
        guard phase != .closed, let context else { return 0 }
        let wasCongested = heldBytes >= limits.maxBytes / 2
        if socketBacklog > 0, context.channel.isWritable { socketBacklog = 0 }  // below its watermark again
        var handed = handOver(context)
        if !lagging.isEmpty, phase == .open, heldBytes < limits.maxBytes / 2, queuedEvents < limits.maxEvents / 2 {
            releaseLag()
            handed += handOver(context)
        }
        guard handed > 0 else {
            // The socket drained what it held: a connection held for it may go on.
            if wasCongested, heldBytes < limits.maxBytes / 2 { onProgress?() }
            return 0
        }
        context.flush()
        if !context.channel.isWritable {
            // The socket took less than it was handed: what waits there counts until it drains.
            socketBacklog = (try? context.channel.syncOptions?.getOption(ChannelOptions.bufferedWritableBytes)) ?? 0
        }
        if phase == .overflowed, isEmpty {
            // The overflow event is handed over: close once the socket has taken it.
            let channel = context.channel
            let promise = context.eventLoop.makePromise(of: Void.self)
            promise.futureResult.whenComplete { _ in channel.close(promise: nil) }
            context.writeAndFlush(NIOAny(allocator.buffer(capacity: 0)), promise: promise)
        } else if (wasCongested && heldBytes < limits.maxBytes / 2) || isEmpty {
            onProgress?()
        }
        return handed
    }

    /// Writes ready chunks (and the tail, when nothing is before it) to the channel while it
    /// is writable; the number of bytes written.
    private func handOver(_ context: ChannelHandlerContext) -> Int {
        let channel = context.channel
        var handed = 0
        var events = 0
        while let first = chunks.first, case .ready(let buffer, let n) = first, channel.isWritable {
            chunks.removeFirst()
            removedChunks += 1
            handed += buffer.readableBytes
            events += n
            context.write(NIOAny(buffer), promise: nil)
        }
        if chunks.isEmpty, tail.readableBytes > 0, channel.isWritable {
            handed += tail.readableBytes
            events += tailEvents
            context.write(NIOAny(tail), promise: nil)
            tail = freshTail()
            tailEvents = 0
        }
        queuedBytes -= handed
        queuedEvents -= events
        return handed
    }

    /// Calls `body` once everything queued has been written to the socket, or the
    /// connection has closed (for a half-closed client's last replies, and shutdown).
    func whenWritten(_ body: @escaping () -> Void) {
        guard let context, phase != .closed else { return body() }
        flush()
        guard isEmpty else { return }  // the next progress calls back again
        let promise = context.eventLoop.makePromise(of: Void.self)
        promise.futureResult.assumeIsolated().whenComplete { _ in body() }
        // An empty write completes once everything before it is written.
        context.writeAndFlush(NIOAny(allocator.buffer(capacity: 0)), promise: promise)
    }

    /// Closes the queue; returns the subscriptions that were still live.
    func close() -> [Subscription] {
        phase = .closed
        graceClose?.cancel()  // it would keep the channel for the rest of the grace period
        graceClose = nil
        lagging.removeAll()
        chunks.removeAll()
        tail.clear()
        queuedBytes = 0
        socketBacklog = 0
        queuedEvents = 0
        return unregisterAll()
    }

    // MARK: Helpers

    private func count(subscriptions n: Int) {
        stats.subscriptions.add(n, ordering: .relaxed)
        tally.add(n)
    }

    /// Appends an event encoded by `write` to the tail (Coalescing.swift).
    func appendEvent(_ write: (inout ByteBuffer) -> Void) {
        let before = tail.readableBytes
        write(&tail)
        queuedBytes += tail.readableBytes - before
        queuedEvents += 1
        tailEvents += 1
    }

    /// Moves the tail into the sealed chunks (before a slot), if it holds anything.
    private func sealTail() {
        guard tail.readableBytes > 0 else { return }
        chunks.append(.ready(tail, events: tailEvents))
        tail = freshTail()
        tailEvents = 0
    }

    /// A new tail, sized like the last one was (within 1–64 KiB), so it rarely grows.
    private func freshTail() -> ByteBuffer {
        allocator.buffer(capacity: min(64 * 1024, max(1024, tail.readableBytes)))
    }

    /// Appends bytes: copied into the tail, or — a large reply or snapshot — queued as they
    /// are, after the tail, with no copy.
    private func appendToTail(_ bytes: ByteBuffer, events: Int) {
        queuedBytes += bytes.readableBytes
        queuedEvents += events
        if bytes.readableBytes >= 64 * 1024 {
            sealTail()
            chunks.append(.ready(bytes, events: events))
            return
        }
        var bytes = bytes
        tail.writeBuffer(&bytes)
        tailEvents += events
    }
}

@available(*, unavailable)
extension Outbox: Sendable {}
