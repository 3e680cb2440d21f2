// A loop whose fan-out falls behind the writes holds its writers back, and a tick delivers a
// bounded number of events: two loops, the subscriber on one, the writer on the other, and
// the test decides when each loop runs — so the subscriber's loop can fall behind exactly as
// far as the test wants, with nothing timed.

import ObsProtocol
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct DeliveryBacklogTests {
    /// 20 sets of one key, in one read.
    private static let twentySets = (1...20).map { #"{"id":\#($0),"op":"set","repo":"r","key":"k","value":\#($0)}"# }

    @Test func aWriterIsHeldWhileTheFanOutLoopIsBehindAndResumesWhenItCatchesUp() throws {
        let server = try TestServer(loops: 2, delivery: DeliveryBudget(eventsPerTick: 4, maxBacklog: 8))
        let hub = server.hub
        let subscriber = try TestConnection(server, loop: 1)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        #expect(try subscriber.received().first?["ok"] == .bool(true))

        let writer = try TestConnection(server, loop: 0)
        try writer.send(Self.twentySets.map { $0 + "\n" }.joined(), run: false)
        server.run(0)
        // The fan-out loop has not run: eight revisions wait for it, and the writer is held
        // after the write that reached the limit.
        var replies = try writer.received(running: 0)
        #expect(replies.map(\.["id"]) == (1...8).map { .int(Int64($0)) })
        #expect(hub.stats.writersHeld.load(ordering: .relaxed) == 1)
        #expect(hub.backloggedShard != nil)
        server.run(0)
        #expect(try writer.received(running: 0).isEmpty)

        // The fan-out loop catches up (in ticks of four events), which lets the writer go on
        // until it is eight revisions ahead again; and so on to the last write.
        var events: [JSONValue] = []
        for _ in 0..<5 {
            server.run(1)
            events += try subscriber.received(running: 1)
            server.run(0)
            replies += try writer.received(running: 0)
        }
        #expect(replies.map(\.["id"]) == (1...20).map { .int(Int64($0)) })
        #expect(replies.allSatisfy { $0["ok"] == .bool(true) })
        #expect(events.map(\.["rev"]) == (1...20).map { .int(Int64($0)) })
        #expect(events.map { $0["changes"]?.arrayValue?.first?["new"] } == (1...20).map { .int(Int64($0)) })
        #expect(hub.backloggedShard == nil)
        #expect(hub.stats.writersHeld.load(ordering: .relaxed) == 2)
    }

    @Test func aTickDeliversAtMostItsBudgetThenLetsTheLoopServeItsConnections() throws {
        let server = try TestServer(delivery: DeliveryBudget(eventsPerTick: 4, maxBacklog: 1000))
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        _ = try subscriber.received()
        let writer = try TestConnection(server)
        // Ten sets in one read; one iteration of the loop reads and handles them and runs one
        // tick, which delivers four events; the next iteration the next four.
        try writer.send(Self.twentySets.prefix(10).map { $0 + "\n" }.joined(), run: false)
        let loop = server.loops[0].io
        loop.runOnce()
        #expect(try subscriber.received(running: nil).count == 4)
        loop.runOnce()
        #expect(try subscriber.received(running: nil).map(\.["rev"]) == (5...8).map { .int(Int64($0)) })
        #expect(try subscriber.received().map(\.["rev"]) == (9...10).map { .int(Int64($0)) })
        #expect(try writer.received().count == 10)
    }
}
