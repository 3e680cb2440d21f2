// ObsClient — what a connection may hold of events its application has not consumed yet.
//
// Each subscription's stream counts the events it was handed and not consumed; the
// connection's `FlowControl` adds them up. Two bounds apply:
//
// - At `highWater` unconsumed events the handler stops reading the socket, so a slow
//   consumer is handled by the daemon — its overflow rule (or, for a coalescing
//   subscription, coalescing) — rather than by client memory. It reads again at `lowWater`.
// - But it never stops reading while a request waits for its reply: a consumer that awaits
//   a call inside its event loop must get the reply, which is behind the unread events. So
//   while replies are awaited, events go on arriving; at `limit` the handler ends the
//   subscription holding the most unconsumed events as the daemon's overflow would, for that
//   subscription alone: its stream ends, after the events it holds, with
//   `overflowed(resumeAfter:)` (the revision of the last one), the client unsubscribes it
//   and drops what still arrives for it. The connection and its calls go on; a `Watch`
//   resumes with `since`. Memory stays bounded whatever the application does.

import NIOCore
import ObservableKit
import Synchronization

/// What a subscription's stream carries: its events, and — for a subscription that asked
/// for `progress` (a `Watch`'s) — the revisions the daemon says it is complete through, in
/// their place among the events; and where the reply to a `sync` of it arrived (a mirror's
/// `sync`, see WatchMonitor.swift). `Subscription`'s public iterator hands out the events only.
enum SubscriptionItem: Sendable {
    case event(SubscriptionEvent)
    /// Every selected change through this revision has been delivered (a `progress` event).
    case progress(UInt64)
    /// The reply to the `sync` marked `mark` arrived here: every event of the subscription
    /// through `revision` precedes it.
    case syncMark(mark: UInt64, revision: UInt64)
}

/// One subscription's event stream, as the handler feeds it.
///
/// Keeps its own count of events yielded but not yet consumed, so that when the stream
/// ends with events left unread (the consumer stopped iterating, or the stream was cut off),
/// they stop counting against the connection's bounds.
final class SubscriptionStream: Sendable {
    let continuation: AsyncThrowingStream<SubscriptionItem, any Error>.Continuation
    let once: Bool
    /// Whether the subscription asked for `progress` events (they are handed on as items).
    let progress: Bool
    private let flow: FlowControl
    private let unconsumed = Atomic<Int>(0)
    /// Sends `unsubscribe` when the consumer cancels; set once the daemon assigned the number.
    private let onCancel = Locked<(@Sendable () -> Void)?>(nil)

    init(continuation: AsyncThrowingStream<SubscriptionItem, any Error>.Continuation, once: Bool, progress: Bool = false, flow: FlowControl) {
        self.continuation = continuation
        self.once = once
        self.progress = progress
        self.flow = flow
        continuation.onTermination = { [weak self] termination in
            self?.terminated(termination)
        }
    }

    /// The events handed to the stream and not consumed yet.
    var unconsumedCount: Int { unconsumed.load(ordering: .relaxed) }

    func yield(_ item: SubscriptionItem) {
        unconsumed.add(1, ordering: .relaxed)
        flow.produced()
        if case .terminated = continuation.yield(item) { consumed() }
    }

    /// Called by the iterator for every event it hands out.
    func consumed() {
        var current = unconsumed.load(ordering: .relaxed)
        while current > 0 {
            let (exchanged, original) = unconsumed.compareExchange(
                expected: current, desired: current - 1, ordering: .relaxed)
            if exchanged {
                flow.consumed(1)
                return
            }
            current = original
        }
    }

    func setOnCancel(_ action: @escaping @Sendable () -> Void) {
        onCancel.withLock { $0 = action }
    }

    private func terminated(_ termination: AsyncThrowingStream<SubscriptionItem, any Error>.Continuation.Termination) {
        let left = unconsumed.exchange(0, ordering: .relaxed)
        if left > 0 { flow.consumed(left) }
        if case .cancelled = termination, let action = onCancel.withLock({ $0 }) { action() }
    }
}

/// Counts a connection's events delivered to streams but not yet consumed, and says when
/// to hold reads back and when to cut a subscription off (see the file header).
final class FlowControl: Sendable {
    /// The bounds, in unconsumed events.
    struct Limits: Sendable {
        /// Reads are held back from here while no reply is awaited…
        var highWater: Int
        /// …until the application has consumed down to here.
        var lowWater: Int
        /// While replies are awaited, a subscription is cut off from here.
        var limit: Int

        /// The limit is above what a daemon with default limits queues for one connection
        /// (100,000 events) plus the pause point: a consumer that awaits a call inside its
        /// event loop gets the reply before its subscription could be cut off.
        static let standard = Limits(highWater: 8192, lowWater: 1024, limit: 131_072)
    }

    let limits: Limits
    private let buffered = Atomic<Int>(0)
    private let paused = Atomic<Bool>(false)
    private let channel: Locked<(any Channel)?> = Locked(nil)

    init(limits: Limits = .standard) {
        self.limits = limits
    }

    func attach(_ channel: any Channel) { self.channel.withLock { $0 = channel } }

    func produced() { buffered.add(1, ordering: .relaxed) }

    /// Called when `count` events were consumed (or dropped unread); resumes reading when drained.
    func consumed(_ count: Int) {
        let left = buffered.subtract(count, ordering: .relaxed).newValue
        if left <= limits.lowWater, paused.exchange(false, ordering: .acquiringAndReleasing) {
            channel.withLock { $0 }?.read()
        }
    }

    /// Whether the handler should hold back its next read.
    func shouldPause() -> Bool {
        guard buffered.load(ordering: .relaxed) >= limits.highWater else { return false }
        paused.store(true, ordering: .releasing)
        // Re-check: the consumer may have drained in between and missed the flag.
        if buffered.load(ordering: .relaxed) <= limits.lowWater, paused.exchange(false, ordering: .acquiringAndReleasing) {
            return false
        }
        return true
    }

    /// The events handed to live subscriptions' streams and not consumed yet.
    var bufferedCount: Int { buffered.load(ordering: .relaxed) }

    /// Whether the connection holds so many unconsumed events that a subscription must be cut off.
    var isOverLimit: Bool { buffered.load(ordering: .relaxed) >= limits.limit }
}
