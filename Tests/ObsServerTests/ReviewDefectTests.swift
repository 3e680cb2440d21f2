// Defects found in review (issue 19), each reproduced in process: a storage failure undone on
// one loop must fail exactly the undone writes, not a later committed write waiting on
// another loop; `echo: false` must skip only its own connection's revisions, never those of a
// closed connection whose memory a new one reuses; and a lagging coalescing subscription must
// hold at most one entry per key it still owes, whatever the number of writes.

import NIOCore
import NIOEmbedded
import ObsProtocol
import ObsStore
import ObservableKit
import Testing

@testable import ObsServer

@Suite struct ReviewDefectTests {
    /// Two writers on two loops, the durable store failing their first revisions: the undo
    /// runs on the repository's home loop (A's, the last writer's) and tells both loops; the
    /// writer on loop B writes again — a revision the store then keeps — before its loop has
    /// heard of the undo. Only the undone writes fail.
    @Test func anUndoFailsExactlyTheUndoneWritesNotALaterOneOnAnotherLoop() throws {
        let loopA = EmbeddedEventLoop()
        let loopB = EmbeddedEventLoop()
        let hub = try makeHub(storage: ManualStorage(), loop: loopA, otherLoops: [loopB])
        let a = try TestConnection(hub: hub, loop: loopA)
        let b = try TestConnection(hub: hub, loop: loopB)

        try b.send(lines(#"{"id":1,"op":"set","repo":"r","key":"b","value":1}"#))
        try a.send(lines(#"{"id":1,"op":"set","repo":"r","key":"a","value":1}"#))
        #expect(try a.received().isEmpty && b.received().isEmpty, "nothing is answered before it is durable")
        let repository = try #require(hub.existing("r"))

        // Storage fails both revisions; loop A (home) undoes them and tells A and B.
        repository.failed(after: 0, error: StorageError(.io, "injected"))
        loopA.run()
        #expect(try a.received().map(\.errorCode) == ["internal"])

        // B writes again before its loop has run; the store keeps it.
        try b.send(lines(#"{"id":2,"op":"set","repo":"r","key":"b","value":2}"#), tick: false)
        repository.durable(through: 1)
        loopA.run()
        loopB.run()
        let replies = try b.received()
        #expect(replies.map(\.["id"]) == [.int(1), .int(2)])
        #expect(replies.first?.errorCode == "internal", "the undone write fails")
        #expect(replies.last?["ok"] == .bool(true), "a committed write was answered as failed: \(replies)")
        #expect(replies.last?["rev"] == .int(1))
        let read = try TestConnection(hub: hub, loop: loopA)
        try read.send(lines(#"{"id":1,"op":"get","repo":"r","key":"b"}"#))
        #expect(try read.received().first?["value"] == .int(2))
    }

    /// 100 connections each write a key and close; 100 fresh connections each replay the
    /// repository with `echo: false`. None of the revisions is theirs: each gets all 100.
    @Test func echoFalseNeverTakesAClosedConnectionsRevisionsForItsOwn() throws {
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(loop: loop)
        for i in 0..<100 {
            let writer = try TestConnection(hub: hub, loop: loop)
            try writer.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k\#(i)","value":\#(i)}"#))
            #expect(try writer.received().first?["ok"] == .bool(true))
            try writer.channel.close().wait()
            loop.run()
        }
        var short: [Int] = []
        for _ in 0..<100 {
            let reader = try TestConnection(hub: hub, loop: loop)
            try reader.send(lines(#"{"id":1,"op":"subscribe","repo":"r","since":0,"echo":false}"#))
            let changes = try reader.received().filter { $0["event"] == .string("change") }.count
            if changes != 100 { short.append(changes) }
            try reader.channel.close().wait()
            loop.run()
        }
        #expect(short.isEmpty, "\(short.count) of 100 replays skipped revisions of closed connections: \(short.prefix(10))")
    }

    /// A coalescing subscriber whose connection never drains, while keys are created and
    /// deleted again: what its lag holds stays bounded by the keys it still owes a change of
    /// (none here: every key ends as it was for the subscriber), not by the writes.
    @Test func aLaggingCoalescingSubscriptionHoldsNothingForKeysThatCameAndWent() throws {
        var limits = Limits.testing
        limits.queueBytes = 4096
        limits.queueEvents = 10
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(limits: limits, loop: loop)
        let subscriber = try TestConnection(hub: hub, loop: loop, limits: limits)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","coalesce":true}"#))
        #expect(try subscriber.received().first?["ok"] == .bool(true))
        subscriber.setWritable(false)
        let writer = try TestConnection(hub: hub, loop: loop, limits: limits)
        try writer.send(lines(#"{"id":0,"op":"set","repo":"r","key":"kept","value":0}"#))
        for i in 0..<2000 {
            try writer.send(
                lines(
                    #"{"id":1,"op":"set","repo":"r","key":"t\#(i)","value":\#(i)}"#, #"{"id":2,"op":"delete","repo":"r","key":"t\#(i)"}"#,
                    #"{"id":3,"op":"set","repo":"r","key":"kept","value":\#(i)}"#))
            _ = try writer.received()
        }
        let lags = hub.shards[0].lags(ofRepository: "r")
        #expect(!lags.isEmpty, "the subscriber lags")
        // It owes `kept`, and the deletion of the one t-key whose set was queued before the
        // queue filled up — nothing for the 1,999 t-keys that came and went while it lagged.
        for lag in lags {
            #expect(lag.received.count <= 2 && lag.current.count <= 2, "lag holds \(lag.received.count) / \(lag.current.count) keys")
        }
        // Once it drains, what it was sent adds up to the state: `kept` at its last value.
        subscriber.setWritable(true)
        var state: [String: JSONValue] = [:]
        for event in try subscriber.received() where event["event"] == .string("change") {
            for change in event["changes"]?.arrayValue ?? [] {
                let key = try #require(change["key"]?.stringValue)
                state[key] = change["new"]
            }
        }
        #expect(state == ["kept": .int(1999)])
    }
}
