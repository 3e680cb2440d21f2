// ObsServer — the subscriptions live on one connection's outbox: registered, ended one by
// one or all at once, revoked with a last message in the same step (so no event of theirs
// follows it). Delivery asks `Subscription.isLive` before it queues anything. Their number is
// the outbox's `SubscriptionTally`, which `stats` reads from any thread.

import Synchronization

/// A connection's live subscriptions, counted on its loop, read by `stats` anywhere.
final class SubscriptionTally: Sendable {
    private let count = Atomic<Int>(0)
    func add(_ n: Int) { count.add(n, ordering: .relaxed) }
    var value: Int { count.load(ordering: .relaxed) }
}

extension Outbox {
    /// Makes a subscription live on this connection; `false` if the connection is no longer open.
    func register(_ subscription: Subscription) -> Bool {
        guard isOpen else { return false }
        live[subscription.id] = subscription
        subscription.isLive = true
        count(subscriptions: 1)
        return true
    }

    /// Ends a live subscription; returns it, or `nil` if it is not live (unknown, ended by
    /// `once`, or by overflow). No event of it is queued after this returns.
    func unregister(_ id: UInt64) -> Subscription? {
        guard let subscription = live.removeValue(forKey: id) else { return nil }
        subscription.isLive = false
        count(subscriptions: -1)
        return subscription
    }

    /// Ends every live subscription (the connection stays open for its replies); returns them.
    func unregisterAll() -> [Subscription] {
        let ended = Array(live.values)
        for subscription in ended { subscription.isLive = false }
        count(subscriptions: -ended.count)
        live.removeAll()
        return ended
    }

    var liveCount: Int { live.count }
    var liveSubscriptions: [Subscription] { Array(live.values) }

    /// Ends a live subscription and queues `notice` (its last message) in the same step, so no
    /// event of it follows. Returns it, or nil if it was not live.
    func revoke(_ id: UInt64, notice: [UInt8]) -> Subscription? {
        guard isOpen, let subscription = live.removeValue(forKey: id) else { return nil }
        subscription.isLive = false
        count(subscriptions: -1)
        notice.withUnsafeBytes { append($0, events: 1) }
        return subscription
    }
}
