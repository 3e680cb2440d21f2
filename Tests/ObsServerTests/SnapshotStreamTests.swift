// A large subscription start in process: a snapshot past `Session.streamAbove` is encoded a
// piece at a time as the client reads it — the connection's queue never holds much more than
// the stream's window — arrives byte for byte as one snapshot event at the revision the reply
// names, with the values of that revision whatever is written while it streams, and what
// follows it (a later change, the reply to a later request) comes after it; held while its
// state is not durable, it streams once it is; its reader of the repository closes when it
// is sent or its connection closes. Large replays being sent at once are bounded daemon-wide
// (`limits.max-start-bytes`), one alone always allowed, a catch-up never refused.

import ObsProtocol
import ObsStore
import ObservableKit
import Testing
import TestSupport

@testable import ObsServer

/// Writes `count` keys of `r` (`k00000`…) with values of about 1 KiB, in batches.
private func fill(_ server: TestServer, count: Int, firstID: Int = 1) throws -> TestConnection {
    let writer = try TestConnection(server)
    let value = "\"" + String(repeating: "v", count: 1000) + "\""
    var id = firstID
    for start in stride(from: 0, to: count, by: 500) {
        let ops = (start..<min(count, start + 500)).map { i in
            #"{"op":"set","key":"k\#(String(i).leftPadded(to: 5))","value":\#(value)}"#
        }
        try writer.send(lines(#"{"id":\#(id),"op":"batch","repo":"r","ops":[\#(ops.joined(separator: ","))]}"#))
        id += 1
    }
    return writer
}

extension String {
    fileprivate func leftPadded(to width: Int) -> String { String(repeating: "0", count: max(0, width - count)) + self }
}

@Suite(.mayBlock) struct SnapshotStreamTests {
    @Test func aLargeSnapshotStreamsInPiecesAndWhatFollowsComesAfterIt() throws {
        let server = try TestServer()
        let writer = try fill(server, count: 6000)
        #expect(try writer.received().allSatisfy { $0["ok"] == .bool(true) })

        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","initial":true}"#, #"{"id":2,"op":"ping"}"#))
        // ~6 MB of snapshot: the queue holds a window of it, not all of it.
        let queued = subscriber.connection.outbox.queuedBytes
        #expect(queued <= Outbox.streamWindow + OutboxStream.pieceBytes + 4096, "the whole snapshot was queued: \(queued) bytes")
        #expect(queued > 0)
        // A change made now comes after the snapshot.
        try writer.send(lines(#"{"id":99,"op":"set","repo":"r","key":"k00000","value":"new"}"#))

        let messages = try subscriber.received()
        try #require(messages.count == 4, "\(messages.count) messages")
        #expect(messages[0]["id"] == .int(1) && messages[0]["rev"] == .int(12))
        #expect(messages[1]["event"] == "snapshot" && messages[1]["rev"] == .int(12))
        let values = try #require(messages[1]["values"]?.objectValue)
        #expect(values.count == 6000)
        #expect(values["k05999"] == .string(String(repeating: "v", count: 1000)))
        #expect(messages[2]["id"] == .int(2), "the reply to a later request waits behind the snapshot")
        #expect(messages[3]["event"] == "change" && messages[3]["rev"] == .int(13))
        #expect(subscriber.connection.outbox.isEmpty)
    }

    @Test func aLargeSnapshotOfAStateNotYetDurableStreamsOnceItIs() throws {
        let server = try TestServer(storage: ManualStorage())
        let writer = try fill(server, count: 6000)
        let repository = try #require(server.hub.repositories.existing("r"))
        repository.durable(through: 11)
        #expect(try writer.received().count == 11)
        // Revision 12 (the last batch) is not durable when the subscription starts from it.
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","initial":true}"#))
        #expect(try subscriber.received().isEmpty, "nothing before its state is durable")

        repository.durable(through: 12)
        let messages = try subscriber.received()
        try #require(messages.count == 2)
        #expect(messages[0]["rev"] == .int(12))
        #expect(messages[1]["event"] == "snapshot" && messages[1]["values"]?.objectValue?.count == 6000)
    }

    @Test func aLargeReplayStreamsAndEndsWithSynced() throws {
        let server = try TestServer()
        let writer = try fill(server, count: 6000)
        _ = try writer.received()
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","since":0}"#))
        #expect(subscriber.connection.outbox.queuedBytes <= Outbox.streamWindow + OutboxStream.pieceBytes + 4096)
        let messages = try subscriber.received()
        try #require(messages.count == 1 + 12 + 1)
        #expect(messages[1...12].map(\.["rev"]) == (1...12).map { .int(Int64($0)) })
        #expect(messages[13]["event"] == "synced" && messages[13]["rev"] == .int(12))
    }

    @Test func aLargeSnapshotHasTheValuesOfItsRevisionAndClosesItsReader() throws {
        let server = try TestServer()
        let writer = try fill(server, count: 6000)
        _ = try writer.received()
        let repository = try #require(server.hub.repositories.existing("r"))
        let subscriber = try TestConnection(server)
        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"r","initial":true}"#))
        #expect(repository.openReaders == 1, "more than fits in one piece: read as the client reads")
        // Written while it streams: the last key (sent last) and one deleted.
        try writer.send(lines(#"{"id":98,"op":"set","repo":"r","key":"k05999","value":"new"}"#, #"{"id":99,"op":"delete","repo":"r","key":"k05998"}"#))
        let messages = try subscriber.received()
        try #require(messages.count == 4)
        let values = try #require(messages[1]["values"]?.objectValue)
        #expect(values.count == 6000 && values["k05999"] == .string(String(repeating: "v", count: 1000)) && values["k05998"] != nil)
        #expect(messages[2]["rev"] == .int(13) && messages[3]["rev"] == .int(14), "the writes come after it, as changes")
        #expect(repository.openReaders == 0)

        // A client that closes before reading it closes its reader too.
        let gone = try TestConnection(server)
        try gone.send(lines(#"{"id":1,"op":"subscribe","repo":"r","initial":true}"#))
        #expect(repository.openReaders == 1)
        gone.close()
        #expect(repository.openReaders == 0)
    }

    @Test func largeReplaysBeingSentTogetherAreBoundedDaemonWide() throws {
        var limits = Limits.testing
        limits.maxStartBytes = 1 << 20  // less than one ~6 MB replay
        let server = try TestServer(limits: limits)
        let writer = try fill(server, count: 6000)
        _ = try writer.received()
        let budget = server.hub.startBudget
        let subscribe = #"{"id":1,"op":"subscribe","repo":"r","since":0}"#

        // Alone, a replay larger than the whole budget streams; its client does not read yet.
        let first = try TestConnection(server)
        try first.send(lines(subscribe))
        #expect(budget.bytes > 6_000_000)

        // Another one meanwhile is refused, and nothing of it is subscribed.
        let second = try TestConnection(server)
        try second.send(lines(subscribe))
        let refused = try second.received()
        try #require(refused.count == 1)
        #expect(refused[0]["ok"] == .bool(false) && refused[0]["error"]?["code"] == "overloaded")
        #expect(second.outbox.liveCount == 0)
        try writer.send(lines(#"{"id":99,"op":"set","repo":"r","key":"k00001","value":1}"#))
        #expect(try second.received().isEmpty, "no event for a refused subscription")

        // A resume with catchup is never refused: a resume never fails.
        let resumed = try TestConnection(server)
        try resumed.send(lines(#"{"id":1,"op":"subscribe","repo":"r","since":0,"catchup":true}"#))
        let caughtUp = try resumed.received()
        #expect(caughtUp.first?["catchup"] == "replay" && caughtUp.count == 1 + 13 + 1)

        // Once the first is read, what it took is given back, and the second may start.
        let messages = try first.received()
        #expect(messages.count == 1 + 13 + 1)
        #expect(budget.bytes == 0)
        try second.send(lines(#"{"id":2,"op":"subscribe","repo":"r","since":0}"#))
        #expect(budget.bytes > 0)
        let started = try second.received()
        #expect(started.count == 1 + 13 + 1 && started[0]["ok"] == .bool(true))
        #expect(budget.bytes == 0)

        // A client that closes before reading its start gives it back too.
        let third = try TestConnection(server)
        try third.send(lines(subscribe))
        #expect(budget.bytes > 0)
        third.close()
        #expect(budget.bytes == 0)
    }
}
