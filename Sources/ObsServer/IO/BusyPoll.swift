// ObsServer — how long an event loop keeps polling for work before it sleeps: an adaptive
// window, the way KVM's halt polling sizes its own.
//
// An event loop that runs out of work blocks in `epoll_wait`, and the next request has to
// wake it. On the machines obsd is measured on (KVM guests) that wake-up is the largest cost
// of a request answered one at a time: busbench's writes at one in flight took 20–22 µs of
// daemon CPU each, most of it the scheduler putting the thread to sleep and waking it, and
// the round trip waited for it. Polling (`epoll_wait` with no timeout) for a few tens of
// microseconds before blocking catches the next request of a client that answers quickly,
// with no sleep: the same scenario then took 18 µs of CPU per write at 2.7 × the rate.
//
// A poll that finds nothing is CPU spent for nothing, so the window adapts to what the
// waits turn out to be. After each wait, the time from the start of polling to readiness
// decides: work that came within the window keeps it; work that came later, but within the
// limit (`server.busy-poll`), grows it (doubling, from 10 µs) so that the next wait of that
// length is polled through; a wait longer than the limit — a quiet client, an idle daemon —
// halves it, down to no polling at all. An idle daemon therefore does not poll: its loops
// block as they always did, and a burst of requests spaced farther apart than the limit
// never makes them poll.

/// The adaptive polling window of one event loop (loop-confined).
struct BusyPoll {
    /// The longest window, in nanoseconds; 0: never poll.
    let limit: UInt64
    /// How long the next wait polls before it blocks, in nanoseconds.
    private(set) var window: UInt64 = 0

    /// The first window a growing one takes.
    static let initialWindow: UInt64 = 10_000

    init(limit: UInt64) {
        self.limit = limit
    }

    /// A wait ended: `idle` nanoseconds passed from its start to its end, which was work
    /// (`woken`) or its timeout.
    mutating func waited(_ idle: UInt64, woken: Bool) {
        guard limit > 0 else { return }
        if idle > limit {
            window /= 2
            if window < Self.initialWindow { window = 0 }
        } else if woken, idle > window {
            window = min(limit, max(Self.initialWindow, window * 2))
        }
    }
}
