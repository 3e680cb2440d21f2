// A loop whose fan-out falls behind the writes holds its writers back, and a tick delivers
// a bounded number of events: two embedded loops, the subscriber on one, the writer on the
// other, and the test decides when each loop runs — so the subscriber's loop can fall
// behind exactly as far as the test wants, with nothing timed.

import NIOCore
import NIOEmbedded
import ObsProtocol
import Synchronization
import Testing

@testable import ObsServer

@Suite struct DeliveryBacklogTests {
    /// 20 sets of one key, in one read.
    private static let twentySets = (1...20).map { #"{"id":\#($0),"op":"set","repo":"r","key":"k","value":\#($0)}"# }

    @Test func aWriterIsHeldWhileTheFanOutLoopIsBehindAndResumesWhenItCatchesUp() throws {
        let writerLoop = EmbeddedEventLoop()
        let fanOutLoop = EmbeddedEventLoop()
        let hub = try makeHub(loop: writerLoop, otherLoops: [fanOutLoop], delivery: DeliveryBudget(eventsPerTick: 4, maxBacklog: 8))
        let subscriber = try TestConnection(hub: hub, loop: fanOutLoop)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        #expect(try subscriber.received().first?["ok"] == .bool(true))

        let writer = try TestConnection(hub: hub, loop: writerLoop)
        try writer.send(Self.twentySets.map { $0 + "\n" }.joined())
        // The fan-out loop has not run: eight revisions wait for it, and the writer is held
        // after the write that reached the limit.
        var replies = try writer.received()
        #expect(replies.map(\.["id"]) == (1...8).map { .int(Int64($0)) })
        #expect(hub.stats.writersHeld.load(ordering: .relaxed) == 1)
        #expect(hub.backloggedShard != nil)
        writerLoop.run()
        #expect(try writer.received().isEmpty)

        // The fan-out loop catches up (in ticks of four events), which lets the writer go on
        // until it is eight revisions ahead again; and so on to the last write.
        var events: [JSONValue] = []
        for _ in 0..<5 {
            fanOutLoop.run()
            events += try subscriber.received()
            writerLoop.run()
            replies += try writer.received()
        }
        #expect(replies.map(\.["id"]) == (1...20).map { .int(Int64($0)) })
        #expect(replies.allSatisfy { $0["ok"] == .bool(true) })
        #expect(events.map(\.["rev"]) == (1...20).map { .int(Int64($0)) })
        #expect(events.map { $0["changes"]?.arrayValue?.first?["new"] } == (1...20).map { .int(Int64($0)) })
        #expect(hub.backloggedShard == nil)
        #expect(hub.stats.writersHeld.load(ordering: .relaxed) == 2)
    }

    @Test func aTickDeliversAtMostItsBudgetThenLetsTheLoopServeItsConnections() throws {
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(loop: loop, delivery: DeliveryBudget(eventsPerTick: 4, maxBacklog: 1000))
        let subscriber = try TestConnection(hub: hub, loop: loop)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        _ = try subscriber.received()
        let writer = try TestConnection(hub: hub, loop: loop)
        // Ten sets in one read, which asks for one tick; a probe queued behind that tick
        // counts what the subscriber was sent by then — before any tick the first one asks for.
        try writer.send(Self.twentySets.prefix(10).map { $0 + "\n" }.joined(), tick: false)
        let sentByFirstTick = Mutex<Int?>(nil)
        let probe = NIOLoopBound(subscriber, eventLoop: loop)
        loop.execute { sentByFirstTick.withLock { $0 = try? probe.value.received().count } }
        loop.run()
        #expect(sentByFirstTick.withLock { $0 } == 4)
        #expect(try subscriber.received().map(\.["rev"]) == (5...10).map { .int(Int64($0)) })
        #expect(try writer.received().count == 10)
    }
}
