// ObsServer — the heartbeat: proof that every event loop still runs, for a watchdog.
//
// Each round gives every loop a task; the next round starts only once all of them ran.
// Every `interval` a complete round is a beat (the daemon pings systemd's watchdog); an
// incomplete one means a loop is wedged — a handler that blocks, a livelock — and the
// pings stop until it runs again, so the service manager can restart a daemon that still
// accepts connections but no longer serves them.

import Synchronization

struct Heartbeat: Sendable {
    enum Event: Sendable, Equatable {
        /// Every loop ran its task within the last interval.
        case beat
        /// A loop has not (reported once per stall).
        case stalled
        /// Every loop runs again after a stall.
        case resumed
    }

    let loops: [IOLoop]
    let interval: Duration

    /// Reports events until the task is cancelled.
    func run(_ report: (Event) -> Void) async {
        await run(waiting: { try await Task.sleep(for: interval) }, report)
    }

    /// Reports events, a check each time `wait` returns, until it throws (cancelled: shutting
    /// down). (Tests pass their own ticks.)
    func run(waiting wait: () async throws -> Void, _ report: (Event) -> Void) async {
        var round = Round(loops: loops)
        var stalled = false
        while true {
            do { try await wait() } catch { return }
            if round.isComplete {
                if stalled { report(.resumed) }
                stalled = false
                report(.beat)
                round = Round(loops: loops)
            } else if !stalled {
                stalled = true
                report(.stalled)
            }
        }
    }

    /// One round of tasks, one per event loop.
    private struct Round {
        private let answered = Counter()
        private let expected: Int

        init(loops: [IOLoop]) {
            expected = loops.count
            for loop in loops {
                loop.execute { [answered] in answered.increment() }
            }
        }

        var isComplete: Bool { answered.value == expected }
    }

    private final class Counter: Sendable {
        private let count = Atomic<Int>(0)
        func increment() { count.add(1, ordering: .releasing) }
        var value: Int { count.load(ordering: .acquiring) }
    }
}
