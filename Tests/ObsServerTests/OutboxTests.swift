// A connection's outgoing queue (Outbox), directly and through the connection handler on
// EmbeddedChannels: reply slots keep order, events wait while the socket takes nothing and
// go out in order, the queue limits overflow a slow subscriber (after the grace period if
// it reads nothing), and a client that does not read its replies is not read either until
// its queue drains. Time moves only by `advanceTime`; the socket's writability is the
// EmbeddedChannel's `isWritable`, announced to the pipeline as NIO does.

import NIOCore
import NIOEmbedded
import ObsProtocol
import ObsStore
import Synchronization
import Testing

@testable import ObsServer

/// A handler that only gives the outbox a context to write through.
private final class Sink: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
}

/// A subscriber to every key of repository `r`, and a writer, on the hub's loop.
private func subscriberAndWriter(_ limits: Limits) throws -> (Hub, EmbeddedEventLoop, subscriber: TestConnection, writer: TestConnection) {
    let loop = EmbeddedEventLoop()
    let hub = try makeHub(limits: limits, loop: loop)
    let subscriber = try TestConnection(hub: hub, loop: loop, limits: limits)
    let writer = try TestConnection(hub: hub, loop: loop, limits: limits)
    try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
    try #require(try subscriber.received().map { $0["sub"] } == [1])
    return (hub, loop, subscriber, writer)
}

@Suite struct OutboxTests {
    @Test func aReplyWaitingInItsSlotHoldsBackWhatIsQueuedAfterIt() throws {
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(loop: loop)
        let channel = EmbeddedChannel(handler: Sink(), loop: loop)
        defer { _ = try? channel.finish(acceptAlreadyClosed: true) }
        let outbox = Outbox(
            shard: hub.shards[0], limits: OutboxLimits(maxBytes: 1 << 20, maxEvents: 1000, grace: .seconds(30)), stats: hub.stats,
            allocator: channel.allocator)
        outbox.context = try channel.pipeline.syncOperations.context(handlerType: Sink.self)
        func written() throws -> String {
            var text = ""
            while let buffer = try channel.readOutbound(as: ByteBuffer.self) { text += String(buffer: buffer) }
            return text
        }

        outbox.append(ByteBuffer(string: "a\n"))
        let slot = outbox.reserveSlot()
        outbox.append(ByteBuffer(string: "c\n"))
        #expect(outbox.queuedBytes == 4 + Outbox.slotBytes, "a slot counts as a typical reply")
        #expect(outbox.flush() == 2)
        #expect(try written() == "a\n", "what follows the slot waits for it")
        #expect(outbox.flush() == 0 && !outbox.isEmpty)

        outbox.fill(slot, with: ByteBuffer(string: "b\n"))
        outbox.flush()
        #expect(try written() == "b\nc\n")
        #expect(outbox.isEmpty && outbox.queuedBytes == 0)
    }

    @Test func aReplyWaitingForDurabilityHoldsBackTheRepliesPipelinedAfterIt() throws {
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(storage: ManualStorage(), loop: loop)
        let client = try TestConnection(hub: hub, loop: loop)

        try client.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k","value":1}"#, #"{"id":2,"op":"ping"}"#))
        #expect(try client.received().isEmpty, "the ping's reply waits behind the write's")
        try #require(hub.existing("r")).durable(through: 1)
        loop.run()
        let replies = try client.received()
        #expect(replies.map { $0["id"] } == [1, 2])
        #expect(replies.first?["rev"] == 1)

        // A revision storage cannot keep: its reply becomes `internal`, and the next follows.
        try client.send(lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":2}"#, #"{"id":4,"op":"ping"}"#))
        #expect(try client.received().isEmpty)
        try #require(hub.existing("r")).failed(after: 1, error: StorageError(.full, "test: disk full"))
        loop.run()
        let after = try client.received()
        #expect(after.map { $0["id"] } == [3, 4])
        #expect(after.first?.errorCode == "internal" && after.last?["ok"] == true)
    }

    @Test func eventsWaitWhileTheSocketTakesNothingAndGoOutInOrderWhenItDoes() throws {
        let (_, _, subscriber, writer) = try subscriberAndWriter(.testing)
        subscriber.setWritable(false)
        for n in 1...5 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k","value":\#(n)}"#)) }
        #expect(try writer.received().count == 5)
        #expect(try subscriber.received().isEmpty)

        subscriber.setWritable(true)
        let events = try subscriber.received()
        #expect(events.map { $0["rev"] } == [1, 2, 3, 4, 5])
        #expect(events.map { $0["changes"]?.arrayValue?.first?["new"] } == [1, 2, 3, 4, 5])
        #expect(events.allSatisfy { $0["event"] == "change" && $0["sub"] == 1 })
    }

    @Test func aSubscriberThatReadsNothingOverflowsAtTheEventLimitAndIsClosedAfterTheGrace() throws {
        var limits = Limits.testing
        limits.queueEvents = 3
        limits.overflowGrace = .seconds(5)
        let (hub, loop, subscriber, writer) = try subscriberAndWriter(limits)
        subscriber.setWritable(false)
        for n in 1...5 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k","value":\#(n)}"#)) }
        #expect(try writer.received().map { $0["ok"] } == Array(repeating: true, count: 5), "the writer never waits")

        #expect(hub.stats.overflows.load(ordering: .relaxed) == 1)
        #expect(hub.stats.subscriptions.load(ordering: .relaxed) == 0, "the overflow ended the subscription")
        // Nothing more is read: no read is asked of the socket, and what arrives is not handled.
        let reads = subscriber.reads.count
        subscriber.requestRead()
        #expect(subscriber.reads.count == reads)
        let requests = hub.shards[0].counters.requests.load(ordering: .relaxed)
        try subscriber.send(lines(#"{"id":9,"op":"ping"}"#))
        #expect(hub.shards[0].counters.requests.load(ordering: .relaxed) == requests)
        loop.advanceTime(by: .seconds(4))
        #expect(subscriber.isActive, "within the grace period")
        loop.advanceTime(by: .seconds(1))
        #expect(!subscriber.isActive, "closed at the end of the grace period")
        #expect(try subscriber.received().isEmpty)
    }

    @Test func aSubscriberPastTheByteLimitGetsItsQueueThenOverflowLastThenEndOfFile() throws {
        var limits = Limits.testing
        limits.queueBytes = 1024
        let (hub, _, subscriber, writer) = try subscriberAndWriter(limits)
        subscriber.setWritable(false)
        let value = String(repeating: "v", count: 200)
        for n in 1...10 { try writer.send(lines(#"{"id":\#(n),"op":"set","repo":"r","key":"k\#(n)","value":"\#(value)"}"#)) }
        #expect(try writer.received().count == 10)
        #expect(hub.stats.overflows.load(ordering: .relaxed) == 1)

        // Requests after the overflow are not handled.
        try subscriber.send(lines(#"{"id":2,"op":"ping"}"#))
        subscriber.setWritable(true)
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
        #expect(!subscriber.isActive, "closed once the overflow event is written")
    }

    @Test func aClientThatDoesNotReadItsRepliesIsNotReadUntilItsQueueDrains() throws {
        var limits = Limits.testing
        limits.queueBytes = 1024
        let loop = EmbeddedEventLoop()
        let hub = try makeHub(limits: limits, loop: loop)
        let client = try TestConnection(hub: hub, loop: loop, limits: limits)
        let counters = hub.shards[0].counters
        let readsAtStart = client.reads.count

        client.requestRead()
        #expect(client.reads.count == readsAtStart + 1, "reads pass while the queue has room")
        client.setWritable(false)
        let pings = (1...100).map { #"{"id":\#($0),"op":"ping"}"# + "\n" }.joined()
        try client.send(pings)
        let handled = counters.requests.load(ordering: .relaxed)
        #expect(handled > 0 && handled < 100, "handling stops part-way through the read once the queue is at its limit")
        client.requestRead()
        client.requestRead()
        #expect(client.reads.count == readsAtStart + 1, "no read while congested")
        #expect(try client.received().isEmpty)

        client.setWritable(true)
        #expect(counters.requests.load(ordering: .relaxed) == 100, "the held requests are handled as the queue drains")
        #expect(try client.received().map { $0["id"]?.int64Value ?? -1 } == Array(1...100))
        #expect(client.reads.count == readsAtStart + 2, "the read asked for while congested is issued once")
    }
}
