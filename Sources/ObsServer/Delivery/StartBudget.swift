// ObsServer — the daemon-wide budget of large subscription starts: the bytes of snapshots and
// `since` replays copied for streaming (OutboxStream.swift) and not yet sent. One large start
// costs its copy; a hundred clients subscribing with `initial` to a large repository at once
// would cost a hundred. Past `limits.max-start-bytes` another large start is refused with
// `overloaded` (retry later) — but one alone always may stream, however large: the limit
// bounds how many run together, not how large a repository may be.

import Synchronization

final class StartBudget: Sendable {
    private let held = Atomic<Int>(0)

    /// The bytes held now.
    var bytes: Int { held.load(ordering: .relaxed) }

    /// Takes `bytes` if they fit under `limit` with those already held, or if none are held;
    /// whether it did.
    func take(_ bytes: Int, limit: Int) -> Bool {
        var current = held.load(ordering: .relaxed)
        while true {
            guard current == 0 || current + bytes <= limit else { return false }
            let (exchanged, original) = held.compareExchange(expected: current, desired: current + bytes, ordering: .relaxed)
            if exchanged { return true }
            current = original
        }
    }

    /// Gives back what `take` took.
    func give(_ bytes: Int) {
        held.subtract(bytes, ordering: .relaxed)
    }
}
