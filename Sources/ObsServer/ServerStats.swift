// ObsServer — the daemon's counters (`stats`): atomics any thread adds to, and the two that
// are also limits (connections, repositories), reserved in one step.

import Synchronization

/// The daemon's counters, shown by `stats`.
final class ServerStats: Sendable {
    let connections = Atomic<Int>(0)
    let connectionsTotal = Atomic<Int>(0)
    let connectionsRefused = Atomic<Int>(0)
    let subscriptions = Atomic<Int>(0)
    let overflows = Atomic<Int>(0)
    /// Times a writer's connection was held until a loop's delivery backlog went down.
    let writersHeld = Atomic<Int>(0)
    let errors = Atomic<Int>(0)
    let denied = Atomic<Int>(0)
    /// Repositories with revision > 0.
    let repositories = Atomic<Int>(0)

    /// Counts one more repository if that stays within `limit`; whether it did.
    func reserveRepository(limit: Int) -> Bool { Self.reserve(repositories, limit: limit) }

    /// Counts one more connection if that stays within `limit`; whether it did.
    func reserveConnection(limit: Int) -> Bool { Self.reserve(connections, limit: limit) }

    /// Adds one to `counter` unless it has reached `limit` — in one step, so concurrent callers
    /// cannot pass the limit together.
    private static func reserve(_ counter: borrowing Atomic<Int>, limit: Int) -> Bool {
        var current = counter.load(ordering: .relaxed)
        while current < limit {
            let (exchanged, original) = counter.compareExchange(expected: current, desired: current + 1, ordering: .relaxed)
            if exchanged { return true }
            current = original
        }
        return false
    }
}
