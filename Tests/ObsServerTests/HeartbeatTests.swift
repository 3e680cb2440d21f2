// The heartbeat on real event loops (each on its own thread): beats while every loop runs,
// stalls (once) while one is wedged, resumes when it runs again.

import Dispatch
import ObsStore
import Testing

@testable import ObsServer

@Suite struct HeartbeatTests {
    @Test func aWedgedLoopStopsTheBeatsUntilItRunsAgain() async throws {
        let loops = try (0..<2).map { try IOLoop(index: $0) }
        let threads = loops.map { loop in DedicatedThread { loop.run() } }
        defer {
            for loop in loops { loop.stop() }
            for thread in threads { thread.join() }
        }
        let (events, continuation) = AsyncStream<Heartbeat.Event>.makeStream()
        let heartbeat = Task { await Heartbeat(loops: loops, interval: .milliseconds(20)).run { continuation.yield($0) } }
        var next = events.makeAsyncIterator()
        #expect(await next.next() == .beat, "every loop runs: a beat")

        let wedge = DispatchSemaphore(value: 0)
        loops[1].execute { wedge.wait() }
        // The round already under way may still complete; then the beats stop.
        var event = await next.next()
        while event == .beat { event = await next.next() }
        #expect(event == .stalled)

        wedge.signal()
        #expect(await next.next() == .resumed)
        #expect(await next.next() == .beat)
        heartbeat.cancel()
        await heartbeat.value
    }
}
