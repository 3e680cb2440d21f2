// A run of one key's revisions to many subscribers is routed once, each subscriber's events
// written together into memory the loop lends and sent at once (LoopShard+Delivery.swift).
// Every subscription still sees every revision it selects, in order: with a second
// subscription on the same connection, a `once`, `echo: false`, a reader whose socket is
// full, and revisions of another key between the runs.

import ObsProtocol
import ObsValues
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct RunDeliveryTests {
    /// Revision n's value: long enough that a run's events are more than the socket takes at once.
    private static func value(_ n: Int64) -> String { "\(n):" + String(repeating: "x", count: 300) }

    private static func sets(_ revisions: ClosedRange<Int>, key: String) -> String {
        revisions.map { #"{"id":\#($0),"op":"set","repo":"r","key":"\#(key)","value":"\#(value(Int64($0)))"}"# + "\n" }.joined()
    }

    /// The revisions of subscription `sub`'s change events, in the order they came (-1 for an
    /// event whose value is not its revision's).
    private static func changes(_ messages: [JSONValue], sub: Int) -> [Int64] {
        messages.filter { $0["event"] == .string("change") && $0["sub"] == .int(Int64(sub)) }.compactMap {
            guard case .int(let rev) = $0["rev"], $0["changes"]?.arrayValue?.first?["new"] == .string(value(rev)) else { return -1 }
            return rev
        }
    }

    @Test func aRunReachesEverySubscriptionInOrder() throws {
        let server = try TestServer()
        var plain: [TestConnection] = []
        for _ in 0..<8 {
            let subscriber = try TestConnection(server)
            try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","keys":["k"]}"#))
            #expect(try subscriber.received().first?["sub"] == .int(1))
            plain.append(subscriber)
        }
        // Two subscriptions on one connection: the key, and the whole repository.
        let both = try TestConnection(server)
        try both.send(lines(#"{"id":1,"op":"subscribe","repo":"r","keys":["k"]}"#, #"{"id":2,"op":"subscribe","repo":"r"}"#))
        #expect(try both.received().map(\.["ok"]) == [.bool(true), .bool(true)])
        let once = try TestConnection(server)
        try once.send(lines(#"{"id":1,"op":"subscribe","repo":"r","keys":["k"],"once":true}"#))
        _ = try once.received()
        // A reader that stops reading: its socket fills, and what it does not take waits.
        let slow = try TestConnection(server)
        try slow.send(lines(#"{"id":1,"op":"subscribe","repo":"r","keys":["k"]}"#))
        _ = try slow.received()
        try slow.setWritable(false)
        // The writer watches the key too, without its own writes.
        let writer = try TestConnection(server)
        try writer.send(lines(#"{"id":0,"op":"subscribe","repo":"r","keys":["k"],"echo":false}"#))
        _ = try writer.received()

        // One read: a run of 30 revisions of `k`, one of `j`, a run of 30 of `k` again.
        let runsBefore = server.loops[0].shard.runsRouted
        try writer.send(Self.sets(1...30, key: "k") + Self.sets(31...31, key: "j") + Self.sets(32...61, key: "k"))
        #expect(server.loops[0].shard.runsRouted - runsBefore == 2, "both runs of `k` were routed as runs")

        let ofK = (1...61).filter { $0 != 31 }.map(Int64.init)
        for subscriber in plain {
            #expect(Self.changes(try subscriber.received(), sub: 1) == ofK)
        }
        let seen = try both.received()
        #expect(Self.changes(seen, sub: 1) == ofK)
        #expect(Self.changes(seen, sub: 2) == (1...61).map(Int64.init))
        #expect(Self.changes(try once.received(), sub: 1) == [1])
        let replies = try writer.received()
        #expect(replies.filter { $0["event"] != nil }.isEmpty, "no echo of its own writes")
        #expect(replies.map(\.["id"]) == (1...61).map { .int(Int64($0)) })
        #expect(slow.outbox.queuedBytes > 0, "the full socket left events in the slow reader's queue")
        try slow.setWritable(true)
        #expect(Self.changes(try slow.received(), sub: 1) == ofK)
    }

    @Test func queuesExchangeMemoryButKeepTheirStreamPositions() {
        var lender = ByteQueue()
        var borrower = ByteQueue()
        Array("lent".utf8).withUnsafeBytes { lender.writeBytes($0) }
        lender.clear()
        Array("own bytes".utf8).withUnsafeBytes { borrower.writeBytes($0) }
        borrower.clear()
        borrower.exchangeMemory(with: &lender)
        Array("event".utf8).withUnsafeBytes { borrower.writeBytes($0) }
        let (borrowed, lent) = (borrower.appended, lender.appended)
        let unsent = borrower.withUnsentBytes { Array($0) }
        let lenderEmpty = lender.isEmpty
        #expect(borrowed == 14 && lent == 4)
        #expect(unsent == Array("event".utf8))
        #expect(lenderEmpty)
    }

    @Test func revisionsOfAlternatingKeysAreRoutedOneAtATime() throws {
        let server = try TestServer()
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        _ = try subscriber.received()
        let writer = try TestConnection(server)
        try writer.send((1...20).map { Self.sets($0...$0, key: $0 % 2 == 0 ? "k" : "j") }.joined())
        #expect(server.loops[0].shard.runsRouted == 0)
        #expect(Self.changes(try subscriber.received(), sub: 1) == (1...20).map(Int64.init))
    }
}
