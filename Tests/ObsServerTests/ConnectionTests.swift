// A connection in process, over a socket pair, on a loop the test runs: framing (split,
// pipelined and over-long lines), replies and their fields, errors that leave the connection
// usable, events between two connections, half-close, refused connections, and the replies
// of a long pipelined read sent while it is handled.
// Outgoing-queue behaviour (slots, congestion, overflow) is in OutboxTests.

import Foundation
import ObsProtocol
import ObsStore
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct ConnectionTests {
    @Test func aRequestLineIsAnsweredWithItsIdOkRevAndEpoch() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server)

        try client.send(lines(#"{"id":1,"op":"set","repo":"ui","key":"theme","value":"dark"}"#))
        let set = try #require(try client.received().only)
        #expect(set["id"] == 1 && set["ok"] == true)
        #expect(set["rev"] == 1 && set["changed"] == true)
        #expect(set["old"] == nil, "the key did not exist")

        try client.send(lines(#"{"id":"l","op":"list","repo":"ui","values":true}"#))
        let list = try #require(try client.received().only)
        #expect(list["id"] == "l" && list["ok"] == true && list["rev"] == 1)
        let epoch = try #require(list["epoch"]?.stringValue)
        #expect(epoch.count == 32 && epoch.allSatisfy(\.isHexDigit) && epoch == hub.repositories.existing("ui")?.epoch)
        #expect(list["keys"] == ["theme"] && list["values"] == ["theme": "dark"])

        try client.send(lines(#"{"id":3,"op":"set","repo":"ui","key":"theme","value":"dark"}"#))
        let again = try #require(try client.received().only)
        #expect(again["id"] == 3 && again["rev"] == 1 && again["changed"] == false && again["old"] == "dark")
    }

    @Test func aRequestSplitAcrossTwoReadsIsAnsweredOnceItsLineIsComplete() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server)

        try client.send(#"{"id":7,"op":"set","repo":"ui","ke"#)
        #expect(try client.received().isEmpty)
        #expect(hub.repositories.existing("ui") == nil, "nothing was executed")
        try client.send(#"y":"k","value":[1,2]}"# + "\n")
        let reply = try #require(try client.received().only)
        #expect(reply["id"] == 7 && reply["ok"] == true && reply["rev"] == 1)

        try client.send(lines(#"{"id":8,"op":"get","repo":"ui","key":"k"}"#))
        let get = try #require(try client.received().only)
        #expect(get["id"] == 8 && get["value"] == [1, 2] && get["rev"] == 1)
    }

    /// A read holding many pipelined requests sends their replies a quarter of them at a
    /// time (at least `EarlySend.runs.lowerBound`, at most its upper bound) while the rest are
    /// handled, not only once the whole read is (then the loop's tick sends the rest) — as
    /// long as at least half a run of requests follows: the replies of a short rest wait for
    /// the tick's send (3 × 16 + 5 requests: sent early after 16 and 32, not after 48).
    @Test func aLongPipelinedReadSendsRepliesWhileItIsHandled() throws {
        let server = try TestServer()
        let client = try TestConnection(server)
        let run = EarlySend.runs.lowerBound
        let count = 3 * run + 5
        try client.send((1...count).map { #"{"id":\#($0),"op":"ping"}"# + "\n" }.joined(), run: false)
        client.connection.ready(0x001)  // EPOLLIN: the read alone, no tick yet
        let early = try client.received(running: nil)
        #expect(early.map(\.["id"]) == (1...(2 * run)).map { .int(Int64($0)) })
        let rest = try client.received()
        #expect(rest.map(\.["id"]) == ((2 * run + 1)...count).map { .int(Int64($0)) })
    }

    /// A deeper pipeline is answered in longer runs, a quarter of the read's requests: 150
    /// requests of one length in one read go out 37 at a time — after 37, 74 and 111, not
    /// after 148 with 2 left. (Ids of one length: the run is guessed from the lengths.)
    @Test func aDeeperPipelineIsAnsweredInLongerRuns() throws {
        let server = try TestServer()
        let client = try TestConnection(server)
        let count = 150
        let id = { (i: Int) in "r" + String(repeating: "0", count: 3 - String(i).count) + String(i) }
        try client.send((1...count).map { #"{"id":"\#(id($0))","op":"ping"}"# + "\n" }.joined(), run: false)
        client.connection.ready(0x001)
        let early = try client.received(running: nil)
        #expect(early.map(\.["id"]) == (1...111).map { .string(id($0)) })
        let rest = try client.received()
        #expect(rest.map(\.["id"]) == (112...count).map { .string(id($0)) })
    }

    /// While the loop's ticks write to many connections (here a tick wrote an event to each of
    /// nine subscribers), replies go out in runs of at least `EarlySend.busyRun`: 2 × 16 + 5
    /// requests, which a quiet loop answers early after 16, are answered by the tick alone.
    @Test func aLoopBusyWritingEventsSendsRepliesInLongerRuns() throws {
        let server = try TestServer()
        let subscribers = try (0..<(EarlySend.busyTickWrites + 1)).map { _ in try TestConnection(server) }
        for subscriber in subscribers {
            try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"ui","keys":["k"]}"#))
            _ = try subscriber.received()
        }
        let writer = try TestConnection(server)
        try writer.send(lines(#"{"id":1,"op":"set","repo":"ui","key":"k","value":1}"#))
        #expect(try writer.received().map { $0["rev"] } == [1])
        for subscriber in subscribers { #expect(try subscriber.received().count == 1) }

        let count = 2 * EarlySend.runs.lowerBound + 5
        try writer.send((1...count).map { #"{"id":\#($0),"op":"ping"}"# + "\n" }.joined(), run: false)
        writer.connection.ready(0x001)
        #expect(try writer.received(running: nil).isEmpty, "no run of \(EarlySend.busyRun) with half a run after it")
        #expect(try writer.received().map(\.["id"]) == (1...count).map { .int(Int64($0)) })
    }

    /// Under `sync = relaxed` the writes handled so far are committed (written, not synced)
    /// before their replies are sent early: a reply is never sent before its write is durable.
    @Test func aLongPipelinedReadOfRelaxedWritesCommitsThenSendsEarly() throws {
        let dir = FileManager.default.temporaryDirectory.appendingPathComponent("obsd-early-\(UUID().uuidString)").path
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try DiskStorage(
            options: DiskStorage.Options(directory: dir, sync: .relaxed(interval: .seconds(3600)), historyLimit: 100, historyMaxBytes: 1 << 20, historyMaxAge: nil),
            logger: quietLogger)
        defer { storage.close() }
        storage.flush()  // this thread commits (the loop's, in these tests): the committer thread is not woken
        let server = try TestServer(storage: storage)
        let client = try TestConnection(server)
        let run = EarlySend.runs.lowerBound
        let count = 3 * run + 5
        try client.send((1...count).map { #"{"id":\#($0),"op":"set","repo":"r","key":"k","value":\#($0)}"# + "\n" }.joined(), run: false)
        client.connection.ready(0x001)  // EPOLLIN: the read alone, no tick yet
        let early = try client.received(running: nil)
        #expect(early.map(\.["rev"]) == (1...(2 * run)).map { .int(Int64($0)) })
        let committed = storage.counters?.records.load(ordering: .relaxed) ?? 0
        #expect(committed >= 2 * run, "committed before they were answered")
        let rest = try client.received()
        #expect(rest.map(\.["id"]) == ((2 * run + 1)...count).map { .int(Int64($0)) })
    }

    @Test func pipelinedRequestsInOneReadAreAnsweredInRequestOrder() throws {
        let server = try TestServer()
        let client = try TestConnection(server)

        try client.send(
            lines(
                #"{"id":1,"op":"set","repo":"r","key":"a","value":1}"#,
                #"{"id":2,"op":"get","repo":"r","key":"a"}"#,
                #"{"id":3,"op":"ping"}"#,
                #"{"id":4,"op":"delete","repo":"r","key":"a"}"#,
                #"{"id":5,"op":"get","repo":"r","key":"a"}"#,
                #"{"id":6,"op":"set","repo":"r","key":"a","value":2,"ifRev":1}"#))
        let replies = try client.received()
        try #require(replies.count == 6)
        #expect(replies.map { $0["id"] } == [1, 2, 3, 4, 5, 6])
        #expect(replies[0]["rev"] == 1 && replies[0]["changed"] == true)
        #expect(replies[1]["value"] == 1 && replies[1]["rev"] == 1)
        #expect(replies[2]["ok"] == true)
        #expect(replies[3]["rev"] == 2 && replies[3]["changed"] == true && replies[3]["old"] == 1)
        #expect(replies[4]["ok"] == false && replies[4].errorCode == "not_found")
        #expect(replies[5]["ok"] == false && replies[5].errorCode == "conflict", "the key no longer exists at revision 1")
    }

    @Test func aLineOverTheLimitGetsTooLargeAsSoonAsItCrossesAndTheConnectionStaysUsable() throws {
        var limits = Limits.testing
        limits.maxLine = 64
        let server = try TestServer(limits: limits)
        let hub = server.hub
        let client = try TestConnection(server, limits: limits)

        // A line of exactly the limit is a request.
        let padded = #"{"op":"ping","id":""# + String(repeating: "p", count: 64 - 21) + #""}"#
        try #require(padded.utf8.count == 64)
        try client.send(padded + "\n")
        #expect(try client.received().map { $0["ok"] } == [true])

        // One byte more, and no newline yet: the error comes at once.
        let long = #"{"id":1,"op":"set","repo":"r","key":"k","value":""# + String(repeating: "x", count: 40)
        try client.send(long)
        let error = try #require(try client.received().only)
        #expect(error["id"] == .null && error["ok"] == false && error.errorCode == "too_large")

        // The rest of that line is discarded up to its newline; the next line is a request.
        try client.send(String(repeating: "x", count: 500) + "\"}\n" + lines(#"{"id":2,"op":"ping"}"#))
        #expect(try client.received().map { $0["id"] } == [2])
        #expect(hub.repositories.existing("r") == nil, "nothing of the over-long request was applied")
    }

    @Test func invalidRequestsGetTheirErrorAndTheConnectionKeepsWorking() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server)

        try client.send(lines(#"{"id":1,"op":"#))
        let notJSON = try #require(try client.received().only)
        #expect(notJSON["id"] == .null && notJSON["ok"] == false && notJSON.errorCode == "bad_json")

        try client.send(lines(#"{"id":2}"#, #"{"id":3,"op":"fly"}"#, #"{"id":4,"op":"set","repo":"r","key":"k"}"#))
        let errors = try client.received()
        #expect(errors.map { $0["id"] } == [2, 3, 4])
        #expect(errors.map(\.errorCode) == ["bad_request", "unknown_op", "bad_request"])

        try client.send(lines(#"{"id":5,"op":"set","repo":"r","key":"k","value":true}"#))
        let set = try #require(try client.received().only)
        #expect(set["id"] == 5 && set["ok"] == true && set["rev"] == 1)
        #expect(hub.stats.errors.load(ordering: .relaxed) == 4)
    }

    @Test func aSetIsAnsweredAndItsEventReachesASubscriberOnAnotherChannel() throws {
        let server = try TestServer()
        let subscriber = try TestConnection(server)
        let writer = try TestConnection(server)

        try subscriber.send(lines(#"{"id":1,"op":"subscribe","repo":"ui","keys":["theme"],"initial":true}"#))
        let start = try subscriber.received()
        try #require(start.count == 2)
        #expect(start[0]["id"] == 1 && start[0]["sub"] == 1 && start[0]["rev"] == 0 && start[0]["epoch"]?.stringValue?.count == 32)
        #expect(start[1]["event"] == "snapshot" && start[1]["sub"] == 1 && start[1]["values"] == [:])

        try writer.send(lines(#"{"id":10,"op":"set","repo":"ui","key":"theme","value":"light"}"#))
        try writer.send(lines(#"{"id":11,"op":"set","repo":"ui","key":"theme","value":"dark"}"#))
        try writer.send(lines(#"{"id":12,"op":"set","repo":"ui","key":"zoom","value":2}"#))
        #expect(try writer.received().map { $0["rev"] } == [1, 2, 3], "the writer gets its replies and no event")

        let events = try subscriber.received()
        try #require(events.count == 2, "one event per revision that touches a selected key")
        #expect(events[0]["event"] == "change" && events[0]["sub"] == 1 && events[0]["repo"] == "ui" && events[0]["rev"] == 1)
        #expect(events[0]["changes"] == [["key": "theme", "new": "light"]], "a creation has no old")
        #expect(events[1]["rev"] == 2 && events[1]["changes"] == [["key": "theme", "old": "light", "new": "dark"]])
        #expect(events.allSatisfy { $0["id"] == nil }, "events carry no id")
    }

    @Test func aHalfClosedClientIsAnsweredEverythingItSentThenClosed() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server)

        // The last request ends with the stream instead of a newline.
        try client.send(
            lines(#"{"id":1,"op":"set","repo":"r","key":"k","value":1}"#, #"{"id":2,"op":"get","repo":"r","key":"k"}"#)
                + #"{"id":3,"op":"ping"}"#, run: false)
        client.shutdownInput()
        let replies = try client.received()
        #expect(replies.map { $0["id"] } == [1, 2, 3])
        #expect(replies.allSatisfy { $0["ok"] == true })
        #expect(try client.sawEndOfFile(), "end of file follows the last reply")
        #expect(!client.isActive)
        #expect(hub.stats.connections.load(ordering: .relaxed) == 0)
    }

    @Test func aHalfClosedClientsSubscriptionsEndAtOnceAndItClosesOnlyOnceItsRepliesAreWritten() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server)
        let writer = try TestConnection(server)

        try client.send(lines(#"{"id":1,"op":"subscribe","repo":"r"}"#))
        #expect(try client.received().map { $0["sub"] } == [1])
        try client.setWritable(false)
        try client.send(lines(#"{"id":2,"op":"ping"}"#), run: false)
        client.shutdownInput()
        #expect(client.isActive, "its reply is not written yet")
        #expect(hub.stats.subscriptions.load(ordering: .relaxed) == 0, "it asks for nothing more")

        try writer.send(lines(#"{"id":9,"op":"set","repo":"r","key":"k","value":1}"#))
        try client.setWritable(true)
        let replies = try client.received()
        #expect(replies.map { $0["id"] } == [2], "the reply, and no event of the ended subscription")
        #expect(try client.sawEndOfFile())
        #expect(!client.isActive)
    }

    @Test func aPeerWhoseCredentialsCannotBeReadGetsOverloadedAndIsClosed() throws {
        let server = try TestServer()
        let hub = server.hub
        let client = try TestConnection(server, peer: nil)

        let message = try #require(try client.received().only)
        #expect(message["id"] == .null && message["ok"] == false && message.errorCode == "overloaded")
        #expect(message["error"]?["message"] == "the daemon could not identify this process")
        #expect(try client.sawEndOfFile(), "the daemon shut down its side after the message")
        #expect(client.isActive, "and lingers, reading what the client sends, for a second")
        server.advanceTime(by: .seconds(1))
        #expect(!client.isActive)
        #expect(hub.stats.connections.load(ordering: .relaxed) == 0 && hub.stats.connectionsTotal.load(ordering: .relaxed) == 0)
    }

    @Test func aConnectionPastTheLimitIsRefusedWithOverloadedWhileTheOthersKeepWorking() throws {
        var limits = Limits.testing
        limits.maxConnections = 1
        let server = try TestServer(limits: limits)
        let hub = server.hub
        let first = try TestConnection(server, limits: limits)
        let second = try TestConnection(server, limits: limits)

        let refusal = try #require(try second.received().only)
        #expect(refusal["id"] == .null && refusal.errorCode == "overloaded")
        #expect(refusal["error"]?["message"] == "too many connections (limit 1)")
        #expect(try second.sawEndOfFile())
        #expect(hub.stats.connectionsRefused.load(ordering: .relaxed) == 1)

        try first.send(lines(#"{"id":1,"op":"ping"}"#))
        #expect(try first.received().map { $0["id"] } == [1])

        // Once the first leaves, a connection is admitted again.
        first.close()
        let third = try TestConnection(server, limits: limits)
        try third.send(lines(#"{"id":2,"op":"ping"}"#))
        #expect(try third.received().map { $0["ok"] } == [true])
    }
}


/// The rule alone: runs of a quarter of the read, within bounds, and half a run to follow.
@Suite(.mayBlock) struct EarlySendTests {
    /// `due` for a read of `count` requests of 20 bytes, `handled` of them handled.
    func due(_ sinceSend: Int, of handled: Int, in count: Int, tickWrites: Int = 1) -> Bool {
        EarlySend.due(sinceSend: sinceSend, handled: handled, consumed: 20 * handled, of: 20 * count, tickWrites: tickWrites)
    }

    @Test func aRunIsAQuarterOfTheReadWithinBoundsWithHalfARunToFollow() {
        #expect(!due(15, of: 15, in: 100), "never fewer than 16")
        #expect(!due(24, of: 24, in: 100) && due(25, of: 25, in: 100), "100 requests: runs of 25")
        #expect(due(25, of: 88, in: 100) && !due(25, of: 89, in: 100), "12 left is half a run of 25; 11 is less")
        #expect(due(16, of: 16, in: 40) && !due(16, of: 36, in: 40), "40 requests: runs of 16; 4 left is too few")
        #expect(!due(63, of: 63, in: 1000) && due(64, of: 64, in: 1000), "1000 requests: runs of 64, the most")
        #expect(!due(16, of: 16, in: 40, tickWrites: EarlySend.busyTickWrites + 1), "a loop writing to many connections: at least 32")
        #expect(due(32, of: 32, in: 100, tickWrites: EarlySend.busyTickWrites + 1))
    }
}
