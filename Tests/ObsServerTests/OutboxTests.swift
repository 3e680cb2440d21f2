// A connection's outgoing queue (Outbox), directly over a socket pair and through a real
// connection: reply slots keep order, events wait while the socket takes nothing and go out
// in order, the queue limits overflow a slow subscriber (after the grace period if it reads
// nothing), and a client that does not read its replies is not read either until its queue
// drains. Time moves only by `advanceTime`; a socket "takes nothing" once the client stops
// reading and its small buffers are full (`TestConnection.setWritable`).

import ObsProtocol
import ObsStore
import Testing
import TestSupport

@testable import ObsServer

#if canImport(Glibc)
import Glibc
#endif

/// A subscriber to every key of repository `r`, and a writer.
private func subscriberAndWriter(_ limits: Limits) throws -> (TestServer, subscriber: TestConnection, writer: TestConnection) {
    let server = try TestServer(limits: limits)
    let subscriber = try TestConnection(server)
    let writer = try TestConnection(server)
    try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
    try #require(try subscriber.received().map { $0["sub"] } == [1])
    return (server, subscriber, writer)
}

@Suite(.mayBlock) struct OutboxTests {
    @Test func aReplyWaitingInItsSlotHoldsBackWhatIsQueuedAfterIt() throws {
        var pair: [Int32] = [0, 0]
        try #require(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0, &pair) == 0)
        defer { close(pair[0]); close(pair[1]) }
        let outbox = Outbox(limits: OutboxLimits(maxBytes: 1 << 20, maxEvents: 1000, grace: 0), stats: ServerStats(), latestRevision: { _ in 0 })
        func written() -> String {
            var buffer = [UInt8](repeating: 0, count: 1024)
            let n = buffer.withUnsafeMutableBytes { read(pair[0], $0.baseAddress!, $0.count) }
            return n > 0 ? String(decoding: buffer[..<n], as: UTF8.self) : ""
        }
        func append(_ text: String) { Array(text.utf8).withUnsafeBytes { outbox.append($0) } }

        append("a\n")
        let slot = outbox.reserveSlot()
        append("c\n")
        #expect(outbox.queuedBytes == 4 + Outbox.slotBytes, "a slot counts as a typical reply")
        guard case .drained(2) = outbox.flush(to: pair[1]) else { Issue.record("the head was not sent"); return }
        #expect(written() == "a\n", "what follows the slot waits for it")
        #expect(!outbox.isEmpty)

        outbox.fill(slot, with: Array("b\n".utf8))
        _ = outbox.flush(to: pair[1])
        #expect(written() == "b\nc\n")
        #expect(outbox.isEmpty && outbox.queuedBytes == 0)
    }

    @Test func aReplyWaitingForDurabilityHoldsBackTheRepliesPipelinedAfterIt() throws {
        let server = try TestServer(storage: ManualStorage())
        let hub = server.hub
        let client = try TestConnection(server)

        try client.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k","value":1}"#, #"{"id":2,"op":"ping"}"#))
        #expect(try client.received().isEmpty, "the ping's reply waits behind the write's")
        try #require(hub.repositories.existing("r")).durable(through: 1)
        let replies = try client.received()
        #expect(replies.map { $0["id"] } == [1, 2])
        #expect(replies.first?["rev"] == 1)

        // A revision storage cannot keep: its reply becomes `internal`, and the next follows.
        try client.send(lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":2}"#, #"{"id":4,"op":"ping"}"#))
        #expect(try client.received().isEmpty)
        try #require(hub.repositories.existing("r")).failed(after: 1, error: StorageError(.full, "test: disk full"))
        let after = try client.received()
        #expect(after.map { $0["id"] } == [3, 4])
        #expect(after.first?.errorCode == "internal" && after.last?["ok"] == true)
    }

    @Test func reposWaitsUntilTheStatesItReportsAreDurable() throws {
        let server = try TestServer(storage: ManualStorage())
        let writer = try TestConnection(server)
        let reader = try TestConnection(server)
        try writer.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k","value":1}"#))
        try reader.send(lines(#"{"id":1,"op":"repos"}"#))
        #expect(try reader.received().isEmpty, "it would report revision 1, not durable yet")
        let repository = try #require(server.hub.repositories.existing("r"))
        repository.durable(through: 1)
        #expect(try reader.received().first?["repos"] == [["name": "r", "rev": 1, "keys": 1, "epoch": .string(repository.epoch)]])

        // A revision storage cannot keep is never reported: the reply is the storage's error.
        try writer.send(lines(#"{"id":2,"op":"set","repo":"r","key":"j","value":2}"#))
        try reader.send(lines(#"{"id":2,"op":"repos"}"#))
        #expect(try reader.received().isEmpty)
        repository.failed(after: 1, error: StorageError(.full, "test: disk full"))
        #expect(try reader.received().first?.errorCode == "internal")
        try reader.send(lines(#"{"id":3,"op":"repos"}"#))
        #expect(try reader.received().first?["repos"]?.arrayValue?.first?["rev"] == 1)
    }

    @Test func eventsWaitWhileTheSocketTakesNothingAndGoOutInOrderWhenItDoes() throws {
        let (_, subscriber, writer) = try subscriberAndWriter(.testing)
        try subscriber.setWritable(false)
        for n in 1...5 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k","value":\#(n)}"#)) }
        #expect(try writer.received().count == 5)
        #expect(subscriber.outbox.queuedEvents == 5, "the daemon holds every event the socket did not take")

        try subscriber.setWritable(true)
        let events = try subscriber.received()
        #expect(events.map { $0["rev"] } == [1, 2, 3, 4, 5])
        #expect(events.map { $0["changes"]?.arrayValue?.first?["new"] } == [1, 2, 3, 4, 5])
        #expect(events.allSatisfy { $0["event"] == "change" && $0["sub"] == 1 })
    }

    @Test func aSubscriberThatReadsNothingOverflowsAtTheEventLimitAndIsClosedAfterTheGrace() throws {
        var limits = Limits.testing
        limits.queueEvents = 3
        limits.overflowGrace = .seconds(5)
        let (server, subscriber, writer) = try subscriberAndWriter(limits)
        let hub = server.hub
        try subscriber.setWritable(false)
        for n in 1...5 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k","value":\#(n)}"#)) }
        #expect(try writer.received().map { $0["ok"] } == Array(repeating: true, count: 5), "the writer never waits")

        #expect(hub.stats.overflows.load(ordering: .relaxed) == 1)
        #expect(hub.stats.subscriptions.load(ordering: .relaxed) == 0, "the overflow ended the subscription")
        // Nothing more is read: what arrives is not handled.
        let requests = hub.shards[0].counters.requests.load(ordering: .relaxed)
        try subscriber.send(lines(#"{"id":9,"op":"ping"}"#))
        #expect(hub.shards[0].counters.requests.load(ordering: .relaxed) == requests)
        server.advanceTime(by: .seconds(4))
        #expect(subscriber.isActive, "within the grace period")
        server.advanceTime(by: .seconds(1))
        #expect(!subscriber.isActive, "closed at the end of the grace period")
        #expect(try subscriber.received().filter { $0["id"] != nil }.isEmpty, "no reply to the request sent after the overflow")
    }

    @Test func aSubscriberPastTheByteLimitGetsItsQueueThenOverflowLastThenEndOfFile() throws {
        var limits = Limits.testing
        limits.queueBytes = 1024
        let (server, subscriber, writer) = try subscriberAndWriter(limits)
        let hub = server.hub
        try subscriber.setWritable(false)
        let value = String(repeating: "v", count: 200)
        for n in 1...10 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k\#(n)","value":"\#(value)"}"#)) }
        #expect(try writer.received().count == 10)
        #expect(hub.stats.overflows.load(ordering: .relaxed) == 1)

        // Requests after the overflow are not handled.
        try subscriber.send(lines(#"{"id":2,"op":"ping"}"#))
        try subscriber.setWritable(true)
        let messages = try subscriber.received()
        let events = messages.dropLast()
        let delivered = UInt64(events.count)
        try #require(delivered >= 1 && delivered < 10, "some events fit, the queue limit stopped the rest")
        #expect(events.map { $0["rev"]?.uint64Value ?? 0 } == Array(1...delivered), "in order, none skipped")
        let overflow = try #require(messages.last)
        #expect(overflow["event"] == "overflow")
        #expect(overflow["revs"]?.objectValue?.count == 1)
        #expect(overflow["revs"]?["1"]?.uint64Value == delivered, "resume with since: the last revision queued")
        #expect(!messages.contains { $0["id"] != nil }, "no reply to the request sent after the overflow")
        #expect(try subscriber.sawEndOfFile(), "closed once the overflow event is written")
        #expect(!subscriber.isActive)
    }

    @Test func aClientThatDoesNotReadItsRepliesIsNotReadUntilItsQueueDrains() throws {
        var limits = Limits.testing
        limits.queueBytes = 1024
        let server = try TestServer(limits: limits)
        let client = try TestConnection(server, limits: limits)
        let counters = server.hub.shards[0].counters

        try client.setWritable(false)
        let handledBefore = counters.requests.load(ordering: .relaxed)
        let pings = (1...100).map { #"{"id":\#($0),"op":"ping"}"# + "\n" }.joined()
        try client.send(pings)
        let handled = counters.requests.load(ordering: .relaxed) - handledBefore
        #expect(handled > 0 && handled < 100, "handling stops part-way through the read once the queue is at its limit")
        try client.send(lines(#"{"id":101,"op":"ping"}"#))
        #expect(counters.requests.load(ordering: .relaxed) - handledBefore == handled, "nothing more is read while congested")

        try client.setWritable(true)
        #expect(counters.requests.load(ordering: .relaxed) - handledBefore == 101, "the held requests are handled as the queue drains")
        #expect(try client.received().map { $0["id"]?.int64Value ?? -1 } == Array(1...101))
    }
}
