// Conformance under concurrency and for the contract's smaller rules: a subscription's
// reply precedes its events and a `since` replay meets the live stream exactly while
// another connection writes; no event follows an `unsubscribe` reply; write replies
// carry the repository revision; `null` values; `hello.maxLine`; byte-ordered `repos`;
// batches with no-op and forced operations.

import ObsProtocol
import Testing
import TestSupport

extension JSONObject {
    var asValue: JSONValue { .object(self) }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct OrderingConformanceTests {
    /// Sends sets of key `k<i % 7>` = i for each i in `range`, without reading the replies.
    func burst(_ w: WireConnection, repo: String, _ range: ClosedRange<Int>) throws {
        var text = ""
        for i in range { text += #"{"id":\#(i),"op":"set","repo":"\#(repo)","key":"k\#(i % 7)","value":\#(i)}"# + "\n" }
        try w.sendRaw(Array(text.utf8))
    }

    func drainReplies(_ w: WireConnection, _ range: ClosedRange<Int>) throws {
        for i in range {
            let reply = try w.receive()
            #expect(reply.ok && reply["id"] == .int(Int64(i)), "write \(i): \(reply)")
        }
    }

    @Test func repliesPrecedeEventsAndReplayMeetsLiveWhileAnotherConnectionWrites() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let w = try d.connect()
        let s = try d.connect()
        let total = 3000
        // The subscriptions go out between two halves of the writes, so that they usually
        // begin while the daemon is still applying writes on its other event loop.
        try burst(w, repo: "r", 1...200)
        try drainReplies(w, 1...200)  // history for the `since: 100` replay
        try burst(w, repo: "r", 201...1500)
        try s.request(["id": "live", "op": "subscribe", "repo": "r"])
        try s.request(["id": "replay", "op": "subscribe", "repo": "r", "since": 100])
        try burst(w, repo: "r", 1501...total)

        var subs: [UInt64: (name: String, start: UInt64)] = [:]
        var last: [String: UInt64] = [:]
        var synced = false
        while last["live"] != UInt64(total) || last["replay"] != UInt64(total) || !synced {
            let m = try s.receive()
            if let id = m["id"] {
                let name = try #require(id.stringValue)
                let sub = try #require(m["sub"]?.uint64Value), rev = try #require(m["rev"]?.uint64Value)
                subs[sub] = (name, rev)
                last[name] = name == "live" ? rev : 100
                continue
            }
            let sub = try #require(m["sub"]?.uint64Value)
            let (name, start) = try #require(subs[sub], "an event of sub \(sub) before its subscribe reply: \(m)")
            let rev = try #require(m["rev"]?.uint64Value)
            if m["event"] == "synced" {
                #expect(name == "replay" && rev == start && last[name] == start, "synced at \(rev) after \(last[name] ?? 0), reply rev \(start)")
                synced = true
                continue
            }
            #expect(m["event"] == "change")
            #expect(rev == last[name]! + 1, "\(name): revision \(rev) after \(last[name]!)")
            if name == "replay" { #expect((rev <= start) != synced, "replayed changes up to the reply's rev, then synced, then live") }
            last[name] = rev
        }
        #expect(synced)
        try drainReplies(w, 201...total)
    }

    @Test func noEventOfASubscriptionFollowsItsUnsubscribeReply() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let w = try d.connect()
        let s = try d.connect()
        let sub = try #require(try s.call(["op": "subscribe", "repo": "r", "keys": ["k1"]])["sub"])
        let total = 700
        try burst(w, repo: "r", 1...total)
        _ = try s.receive()  // the writes have started reaching the subscriber
        try s.request(["id": "bye", "op": "unsubscribe", "sub": sub])
        while true {
            let m = try s.receive()
            if m["id"] == "bye" { break }
            #expect(m["sub"] == sub)
        }
        try drainReplies(w, 1...total)
        try s.request(["id": "end", "op": "ping"])
        while true {
            let m = try s.receive()
            if m["id"] == "end" { break }
            Issue.record("a message after the unsubscribe reply: \(m)")
        }
    }

    @Test func writeRepliesCarryTheRepositoryRevisionAndTheOldValue() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        _ = try c.call(["op": "set", "repo": "r", "key": "a", "value": 1])
        _ = try c.call(["op": "set", "repo": "r", "key": "b", "value": 1])
        let equal: JSONValue = ["ok": true, "rev": 2, "changed": false, "old": 1]
        #expect(try c.call(["op": "set", "repo": "r", "key": "a", "value": 1]).withoutID.asValue == equal, "rev is the repository's (2), not the key's (1)")
        let forced: JSONValue = ["ok": true, "rev": 3, "changed": true, "old": 1]
        #expect(try c.call(["op": "set", "repo": "r", "key": "a", "value": 1, "force": true]).withoutID.asValue == forced)
        #expect(try c.call(["op": "delete", "repo": "r", "key": "zz", "ifRev": 9]).errorCode == "conflict")
        #expect(try c.call(["id": 5, "op": "ping", "unknown": [1, ["x": 2]]]).ok, "unknown fields are ignored")
    }

    @Test func nullIsAValue() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "set", "repo": "r", "key": "n", "value": .null]).ok)
        #expect(try c.call(["op": "get", "repo": "r", "key": "n"])["value"] == .null)
        let sub = try c.call(["op": "subscribe", "repo": "r", "keys": ["n"], "initial": true])
        #expect(try c.receive()["values"] == ["n": .null])
        let deleted = try c.call(["op": "delete", "repo": "r", "key": "n"])
        #expect(deleted["changed"] == true && deleted["old"] == .null, "old is present, and null")
        let event = try c.receive()
        #expect(event["sub"] == sub["sub"] && event["changes"] == [["key": "n", "old": .null]], "no new: the key is gone")
    }

    @Test func helloReportsTheConfiguredLineLimitAndReposSortByBytes() async throws {
        let d = try await TestDaemon.start(["--max-line", "1024"], inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "hello", "protocol": 1])["maxLine"] == 1024)
        for repo in ["b", "B", "a", "_"] { _ = try c.call(["op": "set", "repo": .string(repo), "key": "k", "value": 1]) }
        let names = try c.call(["op": "repos"])["repos"]?.arrayValue?.compactMap { $0.objectValue?["name"]?.stringValue }
        #expect(names == ["B", "_", "a", "b"])
    }

    @Test func batchesLeaveNoOpsOutAndCountForcedOnes() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        _ = try c.call(["op": "set", "repo": "r", "key": "a", "value": 1])
        _ = try c.call(["op": "subscribe", "repo": "r"])
        let mixed = try c.call(["op": "batch", "repo": "r", "ops": [["op": "set", "key": "a", "value": 1], ["op": "set", "key": "b", "value": 2, "ifRev": 0]]])
        #expect(mixed["rev"] == 2 && mixed["changed"] == true)
        #expect(try c.receive()["changes"] == [["key": "b", "new": 2]], "the equal set is left out of the event")
        let forced = try c.call(["op": "batch", "repo": "r", "ops": [["op": "set", "key": "a", "value": 1, "force": true]]])
        #expect(forced["rev"] == 3 && forced["changed"] == true)
        let event = try c.receive()
        #expect(event["rev"] == 3 && event["changes"] == [["key": "a", "old": 1, "new": 1]])
    }
}
