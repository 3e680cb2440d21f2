// A subscriber sees one repository's revisions in order whichever loops wrote them: its own
// loop's and another's, posted to its loop's inbox in between. Two loops, the test deciding
// when each runs, and one event delivered per tick, so that revisions of both loops wait to
// be delivered at once. (A batch of the loop's own posts, delivered before the inbox, was
// tried: written without the check that other loops' revisions wait, this test failed.)

import ObsProtocol
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct LoopInboxTests {
    private static func set(_ value: Int) -> String {
        #"{"id":\#(value),"op":"set","repo":"r","key":"k","value":\#(value)}"# + "\n"
    }

    @Test func oneRepositoryWrittenFromTwoLoopsReachesASubscriberInRevisionOrder() throws {
        let server = try TestServer(loops: 2, delivery: DeliveryBudget(eventsPerTick: 1, maxBacklog: 1000))
        let subscriber = try TestConnection(server, loop: 1)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        #expect(try subscriber.received().first?["ok"] == .bool(true))
        let local = try TestConnection(server, loop: 1)  // the subscriber's loop
        let remote = try TestConnection(server, loop: 0)
        let loop1 = server.loops[1].io

        // Revision 1 from loop 0 waits in loop 1's inbox; revision 2, made on loop 1, comes
        // after it.
        try remote.send(Self.set(1), run: false)
        server.run(0)
        try local.send(Self.set(2), run: false)
        loop1.runOnce(maxWait: 0)
        server.run(1)

        // Revisions 3–5 made on loop 1; its tick delivers one. Revision 6 from loop 0 waits
        // behind the other two, and 7, made on loop 1, behind it.
        try local.send(Self.set(3) + Self.set(4) + Self.set(5), run: false)
        loop1.runOnce(maxWait: 0)
        try remote.send(Self.set(6), run: false)
        server.run(0)
        try local.send(Self.set(7), run: false)
        loop1.runOnce(maxWait: 0)
        server.run()

        let events = try subscriber.received().filter { $0["event"] == .string("change") }
        #expect(events.map(\.["rev"]) == (1...7).map { .int(Int64($0)) })
        #expect(events.map { $0["changes"]?.arrayValue?.first?["new"] } == (1...7).map { .int(Int64($0)) })
        #expect(try local.received().map(\.["ok"]) == Array(repeating: .bool(true), count: 5))
        #expect(try remote.received().map(\.["ok"]) == Array(repeating: .bool(true), count: 2))
    }
}
