// Defects found in review (issue 19), each reproduced in process: a storage failure undone
// must fail exactly the undone writes, not a later committed write waiting on another loop;
// `echo: false` must skip only its own connection's revisions, never those of a closed
// connection whose memory a new one reuses; a lagging coalescing subscription holds at most
// one entry per key it still owes; in etcd mode, a write holds its writer back while a
// loop's delivery is behind, as a local write does; and a write storage failed takes its
// lease attachment back with its value.

import ObsProtocol
import ObsStore
import ObservableKit
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct ReviewDefectTests {
    /// Two writers on two loops, the durable store failing their first revisions: the undo
    /// tells both loops; the writer on loop B writes again — a revision the store then keeps —
    /// before its loop has heard of the undo. Only the undone writes fail.
    @Test func anUndoFailsExactlyTheUndoneWritesNotALaterOneOnAnotherLoop() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage, loops: 2)
        let hub = server.hub
        let a = try TestConnection(server, loop: 0)
        let b = try TestConnection(server, loop: 1)

        try b.send(lines(#"{"id":1,"op":"set","repo":"r","key":"b","value":1}"#))
        try a.send(lines(#"{"id":1,"op":"set","repo":"r","key":"a","value":1}"#))
        #expect(try a.received().isEmpty && b.received().isEmpty, "nothing is answered before it is durable")
        let repository = try #require(hub.repositories.existing("r"))

        // Storage fails both revisions; both loops are told.
        repository.failed(after: 0, error: StorageError(.io, "injected"))
        #expect(try a.received(running: 0).map(\.errorCode) == ["internal"])

        // B writes again before its loop has handled the news; the store keeps it.
        try b.send(lines(#"{"id":2,"op":"set","repo":"r","key":"b","value":2}"#), run: false)
        server.run(1)
        storage.confirmAll()
        let replies = try b.received()
        #expect(replies.map(\.["id"]) == [.int(1), .int(2)])
        #expect(replies.first?.errorCode == "internal", "the undone write fails")
        #expect(replies.last?["ok"] == .bool(true), "a committed write was answered as failed: \(replies)")
        #expect(replies.last?["rev"] == .int(1))
        let read = try TestConnection(server)
        try read.send(lines(#"{"id":1,"op":"get","repo":"r","key":"b"}"#))
        #expect(try read.received().first?["value"] == .int(2))
    }

    /// 100 connections each write a key and close; 100 fresh connections each replay the
    /// repository with `echo: false`. None of the revisions is theirs: each gets all 100.
    @Test func echoFalseNeverTakesAClosedConnectionsRevisionsForItsOwn() throws {
        let server = try TestServer()
        for i in 0..<100 {
            let writer = try TestConnection(server)
            try writer.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k\#(i)","value":\#(i)}"#))
            #expect(try writer.received().first?["ok"] == .bool(true))
            writer.close()
        }
        var short: [Int] = []
        for _ in 0..<100 {
            let reader = try TestConnection(server)
            try reader.send(lines(#"{"id":1,"op":"subscribe","repo":"r","since":0,"echo":false}"#))
            let changes = try reader.received().filter { $0["event"] == .string("change") }.count
            if changes != 100 { short.append(changes) }
            reader.close()
        }
        #expect(short.isEmpty, "\(short.count) of 100 replays skipped revisions of closed connections: \(short.prefix(10))")
    }

    /// A coalescing subscriber whose connection never drains, while keys are created and
    /// deleted again: what its lag holds stays bounded by the keys it still owes a change of,
    /// not by the writes.
    @Test func aLaggingCoalescingSubscriptionHoldsNothingForKeysThatCameAndWent() throws {
        var limits = Limits.testing
        limits.queueBytes = 4096
        limits.queueEvents = 10
        let server = try TestServer(limits: limits)
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","coalesce":true}"#))
        #expect(try subscriber.received().first?["ok"] == .bool(true))
        try subscriber.setWritable(false)
        let writer = try TestConnection(server)
        try writer.send(lines(#"{"id":0,"op":"set","repo":"r","key":"kept","value":0}"#))
        for i in 0..<2000 {
            try writer.send(
                lines(
                    #"{"id":1,"op":"set","repo":"r","key":"t\#(i)","value":\#(i)}"#, #"{"id":2,"op":"delete","repo":"r","key":"t\#(i)"}"#,
                    #"{"id":3,"op":"set","repo":"r","key":"kept","value":\#(i)}"#))
            _ = try writer.received()
        }
        let lags = server.hub.shards[0].lags(ofRepository: "r")
        #expect(!lags.isEmpty, "the subscriber lags")
        // It owes `kept`, and the deletions of t-keys whose sets were queued before the queue
        // filled up — nothing for the t-keys that came and went while it lagged.
        for lag in lags {
            #expect(lag.received.count <= 10 && lag.current.count <= 10, "lag holds \(lag.received.count) / \(lag.current.count) keys")
        }
        // Once it drains, what it was sent adds up to the state: `kept` at its last value.
        try subscriber.setWritable(true)
        var state: [String: JSONValue] = [:]
        for event in try subscriber.received() where event["event"] == .string("change") {
            for change in event["changes"]?.arrayValue ?? [] {
                let key = try #require(change["key"]?.stringValue)
                state[key] = change["new"]
            }
        }
        #expect(state == ["kept": .int(1999)])
    }

    /// etcd mode: a write's answer comes from the shared store, later. While the subscriber's
    /// loop is behind, the writer is held after its write — as a local writer is — and goes on
    /// as that loop catches up.
    @Test func aWriterInEtcdModeIsHeldWhileTheFanOutLoopIsBehind() async throws {
        let server = try TestServer(storage: FakeSharedStorage(), loops: 2, delivery: DeliveryBudget(eventsPerTick: 1000, maxBacklog: 8))
        let hub = server.hub
        let subscriber = try TestConnection(server, loop: 1)
        // Ten subscriptions: each revision weighs ten events on the subscriber's loop.
        try subscriber.send((1...10).map { #"{"id":\#($0),"op":"subscribe","repo":"r"}"# + "\n" }.joined())
        #expect(try await subscriber.receive(running: 1, count: 10).count == 10, "subscribing reads the store first")

        let writer = try TestConnection(server, loop: 0)
        try writer.send(lines((1...3).map { #"{"id":\#($0),"op":"set","repo":"r","key":"k","value":\#($0)}"# }.joined(separator: "\n")), run: false)
        // The store answers from another thread: loop 0 runs until the first reply is in.
        let first = try await writer.receive(running: 0, count: 1)
        #expect(first.map(\.["id"]) == [.int(1)])
        #expect(hub.stats.writersHeld.load(ordering: .relaxed) == 1, "held after the write that made the backlog")
        server.run(0)
        #expect(try writer.received(running: 0).isEmpty, "nothing more while the subscriber's loop is behind")

        server.run(1)
        let rest = try await writer.receive(running: 0, count: 2, alsoRunning: 1)
        #expect(rest.map(\.["id"]) == [.int(2), .int(3)])
        #expect(try subscriber.received().filter { $0["event"] == .string("change") }.count == 30)
    }

    /// A `set` that attached its key to a lease and that storage then failed takes the
    /// attachment back with the value: the lease's end later deletes nothing — not the value
    /// the undo restored, which no lease ever held.
    @Test func aWriteStorageFailedLeavesNoLeaseAttachmentBehind() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let hub = server.hub
        let owner = try TestConnection(server)
        try owner.send(lines(#"{"id":1,"op":"grant","ttl":60}"#, #"{"id":11,"op":"grant","ttl":60}"#))
        storage.confirmAll()
        let granted = try owner.received().compactMap { $0["lease"]?.uint64Value }
        try #require(granted.count == 2)
        let (lease, other) = (granted[0], granted[1])
        try owner.send(lines(#"{"id":2,"op":"set","repo":"r","key":"k","value":1}"#))
        let repository = try #require(hub.repositories.existing("r"))
        storage.confirmAll()
        #expect(try owner.received().map(\.errorCode) == [nil])

        try owner.send(
            lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":2,"lease":\#(lease)}"#, #"{"id":31,"op":"set","repo":"r","key":"j","value":1,"lease":\#(other)}"#))
        repository.failed(after: 1, error: StorageError(.io, "injected"))
        #expect(try owner.received().map(\.errorCode) == ["internal", "internal"], "the undone writes fail")
        #expect(repository.lease(of: "k") == nil && repository.lease(of: "j") == nil, "their attachments are undone with them")
        // No key of the repository is attached to a lease any more (a restart reads the same).
        #expect(repository.attachedLeases.isEmpty, "keys still attached to \(repository.attachedLeases)")

        try owner.send(lines(#"{"id":4,"op":"revoke","lease":\#(lease)}"#))
        storage.confirmAll()
        #expect(try owner.received().map(\.errorCode) == [nil])
        #expect(repository.revision == 1, "the lease's end deleted nothing")
        try owner.send(lines(#"{"id":5,"op":"get","repo":"r","key":"k"}"#))
        #expect(try owner.received().first?["value"] == .int(1))
    }

    /// A lease's end whose deletion storage fails: the revision is undone, the keys are
    /// attached to the ended lease again, and the deletion is made again a second later.
    @Test func aLeaseEndsDeletionStorageFailedIsMadeAgain() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let owner = try TestConnection(server)
        try owner.send(lines(#"{"id":1,"op":"grant","ttl":60}"#))
        storage.confirmAll()
        let lease = try #require(try owner.received().first?["lease"]?.uint64Value)
        try owner.send(lines(#"{"id":2,"op":"set","repo":"r","key":"k","value":1,"lease":\#(lease)}"#))
        let repository = try #require(server.hub.repositories.existing("r"))
        storage.confirmAll()
        #expect(try owner.received().map(\.errorCode) == [nil])

        try owner.send(lines(#"{"id":3,"op":"revoke","lease":\#(lease)}"#))
        #expect(repository.revision == 2, "the deletion is applied, not yet durable")
        repository.failed(after: 1, error: StorageError(.io, "injected"))
        try server.leaseTable.durable(through: .max)
        // The revoke is answered with what is true: the lease has ended, its keys go later.
        let answer = try #require(try owner.received().first)
        #expect(answer.errorCode == "internal" && answer.errorMessage?.contains("lease \(lease) is revoked") == true, "\(answer)")
        #expect(repository.revision == 1 && repository.lease(of: "k") == lease, "undone: the key is back, attached to the ended lease")
        try owner.send(lines(#"{"id":31,"op":"revoke","lease":\#(lease)}"#))
        #expect(try owner.received().first?.errorCode == "not_found", "it has ended for good")

        // Made again a second later: the key is deleted, by the lease's end.
        server.advanceTime(by: .milliseconds(990))
        #expect(repository.revision == 1, "not before the second")
        server.advanceTime(by: .milliseconds(10))
        try #require(repository.revision == 2, "the deletion was not made again")
        storage.confirmAll()
        try owner.send(lines(#"{"id":4,"op":"get","repo":"r","key":"k"}"#))
        #expect(try owner.received().last?.errorCode == "not_found")
        #expect(repository.lease(of: "k") == nil)
    }
}
