// End-to-end: the subscribe options beyond one event per revision (PROTOCOL.md, "Beyond one
// event per revision"): `writers` (who wrote each revision, live and replayed after a
// restart), `echo: false` (no events for the connection's own writes, `overflow.revs` still
// right) and `coalesce` (state instead of every value while the connection lags; never an
// overflow; keys that changed back left out; keys in byte order).

import Foundation
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The credentials this test process connects with, as `by` shows them.
let ownWriter: JSONValue = ["uid": .int(Int64(getuid())), "gid": .int(Int64(getgid())), "pid": .int(Int64(getpid()))]

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct SubscribeOptionsTests {
    @Test func writersNameWhoWroteEachRevisionLiveAndInAReplayAfterARestart() async throws {
        let d = try await TestDaemon.start()
        let watcher = try d.connect()
        let sub = try watcher.call(["op": "subscribe", "repo": "w", "writers": true])
        #expect(sub.ok)
        let plain = try watcher.call(["op": "subscribe", "repo": "w"])["sub"]
        let writer = try d.connect()
        _ = try writer.call(["op": "set", "repo": "w", "key": "a", "value": 1])
        var seen: [UInt64: JSONObject] = [:]
        for _ in 0..<2 {
            let event = try watcher.receive()
            seen[event["sub"]?.uint64Value ?? 0] = event
        }
        #expect(seen[sub["sub"]?.uint64Value ?? 0]?["by"] == ownWriter, "\(seen)")
        #expect(seen[plain?.uint64Value ?? 0]?["by"] == nil, "only subscriptions that ask get by")

        d.kill9()
        try await d.launch()
        let resumed = try d.connect()
        #expect(try resumed.call(["op": "subscribe", "repo": "w", "since": 0, "writers": true]).ok)
        let replayed = try resumed.receive()
        #expect(replayed["rev"] == 1 && replayed["by"] == ownWriter, "the writer is stored with the revision: \(replayed)")
        #expect(try resumed.receive()["event"] == "synced")
    }

    @Test func echoFalseHidesOwnWritesButNotOthers() async throws {
        let d = try await TestDaemon.start()
        let me = try d.connect()
        let other = try d.connect()
        let sub = try me.call(["op": "subscribe", "repo": "e", "echo": false])["sub"]
        _ = try me.call(["op": "set", "repo": "e", "key": "k", "value": "mine"])  // 1
        _ = try other.call(["op": "set", "repo": "e", "key": "k", "value": "theirs"])  // 2
        _ = try me.call(["op": "set", "repo": "e", "key": "k", "value": "mine again"])  // 3
        _ = try other.call(["op": "set", "repo": "e", "key": "j", "value": 1])  // 4
        let first = try me.receive()
        #expect(first["sub"] == sub && first["rev"] == 2, "\(first)")
        #expect(first["changes"] == [["key": "k", "old": "mine", "new": "theirs"]])
        #expect(try me.receive()["rev"] == 4, "revision 3 was this connection's own")
        // A replay with echo: false on the same connection leaves its own writes out too.
        #expect(try me.call(["op": "subscribe", "repo": "e", "since": 0, "echo": false]).ok)
        #expect(try [me.receive()["rev"], me.receive()["rev"], me.receive()["event"]] == [2, 4, "synced"])
    }

    @Test func overflowRevsStayRightUnderEchoFalse() async throws {
        let d = try await TestDaemon.start(["--queue-bytes", "65536"], inMemory: true)
        let slow = try WireConnection(path: d.socketPath, receiveBuffer: 4096)
        let sub = try #require(try slow.call(["op": "subscribe", "repo": "o", "echo": false])["sub"]?.uint64Value)
        // Its own write is never sent; the writes of another then overflow the connection.
        _ = try slow.call(["op": "set", "repo": "o", "key": "own", "value": 0])  // 1
        let writer = try d.connect()
        let big = JSONValue.string(String(repeating: "x", count: 4000))
        for i in 0..<200 { _ = try writer.call(["op": "set", "repo": "o", "key": .string("k\(i % 5)"), "value": [.int(Int64(i)), big]]) }
        let messages = try slow.receiveUntilClosed()
        let last = try #require(messages.last)
        #expect(last["event"] == "overflow")
        let delivered = messages.dropLast().compactMap { $0["rev"]?.uint64Value }
        #expect(delivered.first == 2 && delivered == Array(2...UInt64(delivered.count + 1)), "gap-free from 2, the own revision 1 skipped")
        let resume = last["revs"]?.objectValue?[String(sub)]?.uint64Value
        #expect(resume == delivered.last, "revs names the last revision the subscription has, own writes included")
    }

    @Test func aCoalescingSubscriberThatDoesNotReadIsNeverCutOffAndEndsWithTheState() async throws {
        let d = try await TestDaemon.start(["--queue-bytes", "65536", "--overflow-grace", "1"], inMemory: true)
        let lazy = try WireConnection(path: d.socketPath, receiveBuffer: 4096)
        let sub = try lazy.call(["op": "subscribe", "repo": "c", "coalesce": true, "writers": true, "initial": true])["sub"]
        #expect(sub != nil)
        let writer = try d.connect()
        let padding = String(repeating: "p", count: 500)
        let writes = 3000
        // Far past the queue limit, and for longer than the overflow grace; pipelined, so the
        // writer is never waiting on the lazy reader.
        let started = ContinuousClock.now
        for i in 0..<writes {
            try writer.request(["op": "set", "repo": "c", "key": .string("k\(i % 20)"), "value": .string("\(i) \(padding)")])
            if i % 100 == 99 {
                for _ in 0..<100 { #expect(try writer.receive().ok) }
            }
        }
        let writing = ContinuousClock.now - started
        try await Task.sleep(for: .milliseconds(1500))  // past the grace: a normal subscriber would be gone by now
        let final = try writer.call(["op": "list", "repo": "c", "values": true])
        let finalRev = try #require(final["rev"]?.uint64Value)
        #expect(finalRev == UInt64(writes))

        // Now it reads: a snapshot, events with strictly increasing rev, never an overflow;
        // applying them gives exactly the state.
        var state: [String: JSONValue] = [:]
        var revs: [UInt64] = []
        var coalesced = 0
        #expect(try lazy.receive()["event"] == "snapshot")
        while revs.last != finalRev {
            let event = try lazy.receive()
            #expect(event["event"] == "change", "\(event)")
            guard let rev = event["rev"]?.uint64Value else { break }
            #expect(rev > (revs.last ?? 0), "strictly increasing")
            revs.append(rev)
            if let from = event["from"]?.uint64Value {
                coalesced += 1
                #expect(from <= rev)
            }
            #expect(event["by"] == ownWriter)
            let keys = (event["changes"]?.arrayValue ?? []).compactMap { $0.objectValue?["key"]?.stringValue }
            #expect(keys == keys.sorted { $0.utf8.lexicographicallyPrecedes($1.utf8) }, "byte order")
            for change in event["changes"]?.arrayValue ?? [] {
                guard let c = change.objectValue, let key = c["key"]?.stringValue else { continue }
                state[key] = c["new"]
            }
        }
        let expected = (final["values"]?.objectValue?.members ?? []).reduce(into: [String: JSONValue]()) { $0[$1.name] = $1.value }
        #expect(state == expected, "the subscriber holds the state")
        #expect(revs.count < writes, "fewer events than writes (\(revs.count))")
        #expect(coalesced >= 1)
        #expect(try lazy.call(["op": "ping"]).ok, "still connected")
        #expect(writing < .seconds(60))
    }

    @Test func aKeyThatChangedAndChangedBackIsLeftOut() async throws {
        // The lag is held, not hoped for: the first event is larger than the socket can hold
        // (its send buffer, wmem_default, plus what the queue may keep before it counts as
        // full), so while the lazy connection reads nothing, at least the queue's limit of it
        // stays queued and every later revision folds into the lag, however the daemon's loop
        // happens to batch the writes. (With 100 kB values, a loop that took the burst in one
        // tick could send the first event and the coalesced one into the socket, ending the lag
        // before x and y changed.)
        let queueBytes = 65536
        let sendBuffer = try #require(Int(try String(contentsOfFile: "/proc/sys/net/core/wmem_default", encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)))
        let firstSize = 2 * (sendBuffer + queueBytes)
        let d = try await TestDaemon.start(
            ["--queue-bytes", String(queueBytes), "--max-value-bytes", String(firstSize + 64), "--max-line", String(firstSize + 4096)], inMemory: true)
        let lazy = try WireConnection(path: d.socketPath, receiveBuffer: 4096)
        _ = try lazy.call(["op": "subscribe", "repo": "b", "coalesce": true])
        let writer = try d.connect()
        let big = JSONValue.string(String(repeating: "f", count: firstSize))
        _ = try writer.call(["op": "set", "repo": "b", "key": "f", "value": big])
        for i in 1..<40 { _ = try writer.call(["op": "set", "repo": "b", "key": "f", "value": .int(Int64(i))]) }
        // While it lags: x appears and goes again; y appears and changes; a changes back.
        _ = try writer.call(["op": "set", "repo": "b", "key": "x", "value": 1])
        _ = try writer.call(["op": "delete", "repo": "b", "key": "x"])
        _ = try writer.call(["op": "set", "repo": "b", "key": "y", "value": 1])
        _ = try writer.call(["op": "set", "repo": "b", "key": "y", "value": 2])
        let finalRev = try #require(try writer.call(["op": "list", "repo": "b"])["rev"]?.uint64Value)

        let first = try lazy.receive(timeout: .seconds(30))
        #expect(first["rev"] == 1 && first["from"] == nil, "the big event, plain: \(first.withoutChanges)")
        let last = try lazy.receive()
        #expect(last["rev"]?.uint64Value == finalRev && last["from"] == 2, "then one coalesced event for all the rest: \(last.withoutChanges)")
        let keys = (last["changes"]?.arrayValue ?? []).compactMap { $0.objectValue?["key"]?.stringValue }
        #expect(keys == ["f", "y"], "x changed and changed back; keys in byte order")
        #expect(last["changes"]?.arrayValue?.first == ["key": "f", "old": big, "new": 39])
        #expect(last["changes"]?.arrayValue?.last == ["key": "y", "new": 2], "y did not exist for the subscriber")
    }

    @Test func coalesceWithOnceIsABadRequest() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "subscribe", "repo": "r", "coalesce": true, "once": true]).errorCode == "bad_request")
        #expect(try c.call(["op": "subscribe", "repo": "r", "coalesce": true, "once": false]).ok)
    }
}

extension JSONObject {
    /// The event without its (possibly large) changes, for messages.
    var withoutChanges: JSONObject {
        var copy = self
        copy["changes"] = nil
        return copy
    }
}
