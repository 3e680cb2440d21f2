// The adaptive busy-poll window of an event loop: how waits grow and shrink it, and that a
// real loop polling after a burst still sleeps and wakes, and stops polling once its waits
// are longer than the limit.

import Dispatch
import Glibc
import ObsStore
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct BusyPollTests {
    @Test func waitsWithinTheLimitGrowTheWindowAndLongerOnesShrinkItToNothing() {
        var poll = BusyPoll(limit: 50_000)
        #expect(poll.window == 0, "a loop starts by sleeping")
        // Each wait (ns from the start of polling, whether work ended it) and the window after it.
        let steps: [(idle: UInt64, woken: Bool, window: UInt64, why: Comment)] = [
            (5_000, true, BusyPoll.initialWindow, "work came within the limit: poll from now on"),
            (3_000, true, 10_000, "work came within the window: it stays"),
            (15_000, true, 20_000, "doubles"),
            (35_000, true, 40_000, "doubles"),
            (45_000, true, 50_000, "never past the limit"),
            (49_000, false, 50_000, "a timer within the limit changes nothing"),
            (2_000_000, true, 25_000, "a wait past the limit halves it"),
            (2_000_000, false, 12_500, "a timer past it too"),
            (2_000_000, true, 0, "below the first window: no polling"),
            (60_000, true, 0, "work after more than the limit does not start polling"),
        ]
        for step in steps {
            poll.waited(step.idle, woken: step.woken)
            #expect(poll.window == step.window, step.why)
        }
    }

    @Test func aZeroLimitNeverPolls() {
        var poll = BusyPoll(limit: 0)
        for idle: UInt64 in [1, 1_000, 10_000, 1_000_000] { poll.waited(idle, woken: true) }
        #expect(poll.window == 0)
    }

    @Test(.timeLimit(.minutes(1)))
    func aPollingLoopStillSleepsAndWakesAndStopsPollingWhenWorkComesSeldom() async throws {
        let limit: UInt64 = 500_000  // 0.5 ms
        let loop = try IOLoop(index: 0, busyPoll: limit)
        let thread = DedicatedThread { loop.run() }
        defer {
            loop.stop()
            thread.join()
        }
        // A burst of tasks from another thread, back to back: the loop's window grows.
        for _ in 0..<200 { await withCheckedContinuation { c in loop.execute { c.resume() } } }
        // Then work every 2 ms, four times the limit: 100 wake-ups. A loop that kept polling
        // for the limit before each would spend 50 ms of CPU polling; adapting, it sleeps.
        let cpu: (start: Int64, end: Int64) = await withCheckedContinuation { c in
            loop.execute {
                let start = Self.threadCPUNanoseconds()
                var left = 100
                func next() {
                    left -= 1
                    guard left > 0 else { return c.resume(returning: (start, Self.threadCPUNanoseconds())) }
                    _ = loop.schedule(in: 2_000_000, next)
                }
                _ = loop.schedule(in: 2_000_000, next)
            }
        }
        let spent = cpu.end - cpu.start
        #expect(spent < 20_000_000, "the loop spent \(spent / 1000) µs of CPU on 100 wake-ups 2 ms apart")
        // After a quiet moment it still wakes for work posted from another thread.
        try await Task.sleep(for: .milliseconds(20))
        await withCheckedContinuation { c in loop.execute { c.resume() } }
    }

    static func threadCPUNanoseconds() -> Int64 {
        var time = timespec()
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &time)
        return Int64(time.tv_sec) * 1_000_000_000 + Int64(time.tv_nsec)
    }
}
