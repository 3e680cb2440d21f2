// The heartbeat on real event loops (each on its own thread): beats while every loop runs,
// stalls (once) while one is wedged, resumes when it runs again. The test moves the
// heartbeat's clock itself, and lets the loops run what is queued before each tick — so a
// slow, loaded machine cannot make a loop look wedged.

import Dispatch
import ObsStore
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct HeartbeatTests {
    /// Returns once `loop` ran everything queued on it before.
    private func drained(_ loop: IOLoop) async {
        await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in loop.execute { c.resume() } }
    }

    @Test func aWedgedLoopStopsTheBeatsUntilItRunsAgain() async throws {
        let loops = try (0..<2).map { try IOLoop(index: $0) }
        let threads = loops.map { loop in DedicatedThread { loop.run() } }
        defer {
            for loop in loops { loop.stop() }
            for thread in threads { thread.join() }
        }
        let (events, reported) = AsyncStream<Heartbeat.Event>.makeStream()
        let (ticks, tick) = AsyncStream<Void>.makeStream()
        // Told each time the heartbeat waits for a tick (its round's tasks are queued by then).
        let (waits, waiting) = AsyncStream<Void>.makeStream()
        let heartbeat = Task {
            var next = ticks.makeAsyncIterator()
            await Heartbeat(loops: loops, interval: .zero).run(waiting: {
                waiting.yield()
                guard await next.next() != nil else { throw CancellationError() }
            }) { reported.yield($0) }
        }
        var next = events.makeAsyncIterator()
        var waited = waits.makeAsyncIterator()

        await waited.next()
        for loop in loops { await drained(loop) }
        tick.yield()
        #expect(await next.next() == .beat, "every loop ran its task: a beat")

        // The next round's tasks run; then loop 1 blocks.
        await waited.next()
        for loop in loops { await drained(loop) }
        let wedge = Wedge()
        await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
            loops[1].execute {
                c.resume()
                wedge.block()
            }
        }
        tick.yield()
        #expect(await next.next() == .beat, "the round that ran before the wedge is a beat")
        await waited.next()
        await drained(loops[0])
        tick.yield()
        #expect(await next.next() == .stalled, "loop 1 has not run its task: a stall")

        await waited.next()
        wedge.release()
        await drained(loops[1])
        tick.yield()
        #expect(await next.next() == .resumed)
        #expect(await next.next() == .beat)
        tick.finish()
        await heartbeat.value
    }
}

/// Blocks a loop's thread until released.
private final class Wedge: Sendable {
    private let semaphore = DispatchSemaphore(value: 0)
    func block() { semaphore.wait() }
    func release() { semaphore.signal() }
}
