// End-to-end conformance: the real obsd binary, driven over a raw socket, against every
// rule of the wire contract (../shared/PROTOCOL.md, restated in docs/PROTOCOL.md).
// Absence of an event is proven with a sentinel: a later change the same subscription
// (or another on the same connection and repository) selects; delivery is in revision
// order, so anything earlier would have arrived before it.

import Foundation
import ObsProtocol
import TestSupport
import Testing

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct RequestReplyConformance {
    @Test func helloPingAndIdEcho() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let hello = try c.call(["op": "hello", "protocol": 1, "client": "tests"])
        #expect(hello.ok && hello["protocol"] == 1 && hello["maxLine"] == 1_048_576)
        #expect(hello["server"]?.stringValue?.hasPrefix("obsd/") == true)
        #expect(try c.call(["id": "abc", "op": "ping"]) == JSONObject(uniqueMembers: [("id", "abc"), ("ok", true)]))
        #expect(try c.call(["id": 2.5, "op": "ping"])["id"] == 2.5)
        try c.send(#"{"op":"ping"}"#)
        let noID = try c.receive()
        #expect(noID["id"] == .null && noID.ok)
    }

    @Test func repliesComeInRequestOrderForPipelinedRequests() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        var batch = ""
        for i in 0..<500 {
            switch i % 4 {
            case 0: batch += #"{"id":\#(i),"op":"set","repo":"p","key":"k\#(i % 7)","value":\#(i)}"# + "\n"
            case 1: batch += #"{"id":\#(i),"op":"get","repo":"p","key":"nope"}"# + "\n"
            case 2: batch += "not json\n"
            default: batch += #"{"id":\#(i),"op":"list","repo":"p"}"# + "\n"
            }
        }
        try c.sendRaw(Array(batch.utf8))
        for i in 0..<500 {
            let reply = try c.receive()
            #expect(reply["id"] == (i % 4 == 2 ? .null : .int(Int64(i))), "reply \(i)")
        }
    }

    @Test func setGetDeleteSemantics() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let created = try c.call(["op": "set", "repo": "ui", "key": "theme", "value": "light"])
        #expect(created == JSONObject(uniqueMembers: [("id", 1), ("ok", true), ("rev", 1), ("changed", true)]))
        let updated = try c.call(["op": "set", "repo": "ui", "key": "theme", "value": "dark"])
        #expect(updated["rev"] == 2 && updated["changed"] == true && updated["old"] == "light")
        let get = try c.call(["op": "get", "repo": "ui", "key": "theme"])
        #expect(get["value"] == "dark" && get["rev"] == 2)
        // A key holding null exists.
        _ = try c.call(["op": "set", "repo": "ui", "key": "n", "value": nil])
        let getNull = try c.call(["op": "get", "repo": "ui", "key": "n"])
        #expect(getNull.ok && getNull["value"] == .null && getNull["rev"] == 3)
        let setOverNull = try c.call(["op": "set", "repo": "ui", "key": "n", "value": 1])
        #expect(setOverNull["old"] == .null, "old is present (null) because the key existed")
        let deleted = try c.call(["op": "delete", "repo": "ui", "key": "theme"])
        #expect(deleted["rev"] == 5 && deleted["changed"] == true && deleted["old"] == "dark")
        let absent = try c.call(["op": "delete", "repo": "ui", "key": "theme"])
        #expect(absent.ok && absent["changed"] == false && absent["rev"] == 5 && absent["old"] == nil)
        let missing = try c.call(["op": "get", "repo": "ui", "key": "theme"])
        #expect(missing.errorCode == "not_found" && missing["id"] != nil)
        let otherRepo = try c.call(["op": "get", "repo": "never-written", "key": "k"])
        #expect(otherRepo.errorCode == "not_found")
        // Values round-trip: int64 exactly, objects, doubles.
        let value: JSONValue = ["big": .int(.max), "neg": .int(.min), "d": 0.1, "arr": [1, "x", nil, true], "e": "é\u{0}"]
        _ = try c.call(["op": "set", "repo": "ui", "key": "v", "value": value])
        #expect(try c.call(["op": "get", "repo": "ui", "key": "v"])["value"] == value)
    }

    @Test func equalWritesChangeNothingAndForceChangesAnyway() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        _ = try c.call(["op": "subscribe", "repo": "ui"])
        _ = try c.call(["op": "set", "repo": "ui", "key": "o", "value": ["a": 1, "b": [1, 2]]])
        #expect(try c.receive()["rev"] == 1)
        let equal = try c.call(["op": "set", "repo": "ui", "key": "o", "value": ["b": [1.0, 2], "a": 1.0]])
        #expect(equal["changed"] == false && equal["rev"] == 1 && equal["old"] != nil)
        let forced = try c.call(["op": "set", "repo": "ui", "key": "o", "value": ["a": 1, "b": [1, 2]], "force": true])
        #expect(forced["changed"] == true && forced["rev"] == 2)
        let event = try c.receive()
        #expect(event["rev"] == 2, "the equal write sent no event")
        let change = event["changes"]?.arrayValue?.first?.objectValue
        #expect(change?["old"] == change?["new"] && change?["old"] != nil)
    }

    @Test func compareAndSet() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 1, "ifRev": 3]).errorCode == "conflict")
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 1, "ifRev": 0])["rev"] == 1)
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 2, "ifRev": 0]).errorCode == "conflict")
        #expect(try c.call(["op": "delete", "repo": "r", "key": "k", "ifRev": 9]).errorCode == "conflict")
        #expect(try c.call(["op": "get", "repo": "r", "key": "k"])["value"] == 1, "a failed condition changes nothing")
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 2, "ifRev": 1])["rev"] == 2)
        #expect(try c.call(["op": "delete", "repo": "r", "key": "k", "ifRev": 2])["changed"] == true)
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 5, "ifRev": 0])["rev"] == 4)
    }

    @Test func batchIsAtomicWithOneRevisionAndOneEvent() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let w = try d.connect()
        _ = try c.call(["op": "subscribe", "repo": "b"])
        _ = try w.call(["op": "set", "repo": "b", "key": "x", "value": 1])
        let ops: JSONValue = [
            ["op": "set", "key": "a", "value": 1], ["op": "set", "key": "x", "value": 1], ["op": "delete", "key": "gone"],
            ["op": "delete", "key": "x"], ["op": "set", "key": "c", "value": [3]],
        ]
        #expect(try w.call(["op": "batch", "repo": "b", "ops": ops]).errorCode == "bad_request", "x appears twice")
        let ok: JSONValue = [
            ["op": "set", "key": "a", "value": 1], ["op": "delete", "key": "gone"], ["op": "delete", "key": "x"],
            ["op": "set", "key": "c", "value": [3]],
        ]
        let reply = try w.call(["op": "batch", "repo": "b", "ops": ok])
        #expect(reply == JSONObject(uniqueMembers: [("id", 3), ("ok", true), ("rev", 2), ("changed", true)]))
        _ = try c.receive()  // revision 1
        let event = try c.receive()
        #expect(event["rev"] == 2)
        #expect(event["changes"] == [["key": "a", "new": 1], ["key": "x", "old": 1], ["key": "c", "new": [3]]])
        let failed = try w.call(["op": "batch", "repo": "b", "ops": [["op": "set", "key": "z", "value": 1], ["op": "set", "key": "a", "value": 2, "ifRev": 1]]])
        #expect(failed.errorCode == "conflict")
        #expect(try w.call(["op": "get", "repo": "b", "key": "z"]).errorCode == "not_found")
        let noop = try w.call(["op": "batch", "repo": "b", "ops": [["op": "set", "key": "a", "value": 1], ["op": "delete", "key": "x"]]])
        #expect(noop["changed"] == false && noop["rev"] == 2)
        let empty = try w.call(["op": "batch", "repo": "b", "ops": []])
        #expect(empty["changed"] == false && empty["rev"] == 2)
        // Key revisions: an op that changed nothing does not touch its key's revision.
        _ = try w.call(["op": "batch", "repo": "b", "ops": [["op": "set", "key": "a", "value": 1], ["op": "set", "key": "c", "value": 4]]])
        #expect(try w.call(["op": "get", "repo": "b", "key": "a"])["rev"] == 2)
        #expect(try w.call(["op": "get", "repo": "b", "key": "c"])["rev"] == 3)
        // Sentinel: the no-op and failed batches produced no events.
        #expect(try c.receive()["rev"] == 3)
    }

    @Test func listAndRepos() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        for key in ["b", "a/2", "a/1", "é", "Z", "e\u{301}"] {
            _ = try c.call(["op": "set", "repo": "l", "key": .string(key), "value": .string(key)])
        }
        _ = try c.call(["op": "set", "repo": "A", "key": "k", "value": 1])
        let all = try c.call(["op": "list", "repo": "l"])
        #expect(all["keys"] == ["Z", "a/1", "a/2", "b", "e\u{301}", "é"] && all["rev"] == 6 && all["values"] == nil)
        let prefixed = try c.call(["op": "list", "repo": "l", "prefix": "a/", "values": true])
        #expect(prefixed["keys"] == ["a/1", "a/2"] && prefixed["values"] == ["a/1": "a/1", "a/2": "a/2"])
        let none = try c.call(["op": "list", "repo": "nothing-here"])
        #expect(none["keys"] == [] && none["rev"] == 0)
        // Reading or subscribing to a repository does not make it exist.
        _ = try c.call(["op": "subscribe", "repo": "ghost"])
        _ = try c.call(["op": "get", "repo": "ghost2", "key": "k"])
        _ = try c.call(["op": "delete", "repo": "ghost3", "key": "k"])
        let repos = try c.call(["op": "repos"])
        let entries = repos["repos"]?.arrayValue?.compactMap(\.objectValue) ?? []
        #expect(entries.map { $0["name"] } == ["A", "l"] && entries.map { $0["rev"] } == [1, 6] && entries.map { $0["keys"] } == [1, 6])
        #expect(entries.allSatisfy { $0["epoch"]?.stringValue?.isEmpty == false }, "every entry names its epoch")
        let stats = try c.call(["op": "stats"])
        #expect(stats["connections"] == 1 && stats["subscriptions"] == 1 && stats["repos"] == 2)
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct FramingConformance {
    @Test func crlfAndEmptyLinesAndBadJSON() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        try c.sendRaw(Array("\n\r\n{\"id\":1,\"op\":\"ping\"}\r\n\n".utf8))
        #expect(try c.receive()["id"] == 1)
        try c.send("{\"id\":2,")
        let bad = try c.receive()
        #expect(bad.errorCode == "bad_json" && bad["id"] == .null)
        try c.send("[1,2]")
        #expect(try c.receive().errorCode == "bad_json")
        try c.sendRaw([0x7B, 0x22, 0xFF, 0x22, 0x3A, 0x31, 0x7D, 0x0A])  // invalid UTF-8
        #expect(try c.receive().errorCode == "bad_json")
        try c.send(#"{"op":"nope"}"#)
        #expect(try c.receive().errorCode == "unknown_op")
        try c.send(#"{"id":9}"#)
        let missingOp = try c.receive()
        #expect(missingOp.errorCode == "bad_request" && missingOp["id"] == 9)
        #expect(try c.call(["op": "ping"]).ok, "the connection stays usable")
    }

    @Test func tooLargeLinesGetAnErrorAndTheConnectionStaysUsable() async throws {
        let d = try await TestDaemon.start(["--max-line", "1024"])
        let c = try d.connect()
        let exact = #"{"id":1,"op":"set","repo":"r","key":"k","value":""# + String(repeating: "x", count: 1024 - 51) + #""}"#
        #expect(exact.utf8.count == 1024)
        try c.send(exact)
        #expect(try c.receive()["ok"] == true)
        try c.send(#"{"id":2,"op":"set","repo":"r","key":"k","value":""# + String(repeating: "x", count: 2000) + #""}"#)
        let big = try c.receive()
        #expect(big.errorCode == "too_large" && big["id"] == .null)
        #expect(try c.call(["id": 3, "op": "ping"]).ok)
        // A line without a newline gets its error before the newline ever comes.
        try c.sendRaw(Array(repeating: UInt8(ascii: "y"), count: 100_000))
        #expect(try c.receive().errorCode == "too_large")
        try c.sendRaw(Array(repeating: UInt8(ascii: "y"), count: 100_000) + [10])
        #expect(try c.call(["id": 4, "op": "ping"])["id"] == 4, "the rest of the line was discarded")
    }

    @Test func hostileInputsGetClearErrors() async throws {
        let d = try await TestDaemon.start(["--max-line", "4000000", "--max-value-bytes", "4000000"])
        let c = try d.connect()
        try c.send(String(repeating: "[", count: 100_000) + String(repeating: "]", count: 100_000))
        #expect(try c.receive().errorCode == "bad_json")
        try c.send(#"{"id":1,"op":"set","repo":"r","key":"k","value":1e999}"#)
        #expect(try c.receive().errorCode == "bad_json")
        try c.send(#"{"id":2,"op":"set","repo":"r","key":"k","value":"\ud800"}"#)
        #expect(try c.receive().errorCode == "bad_json")
        try c.sendRaw(Array(#"{"id":3,"op":"set","repo":"r","key":"k\#u{0}","value":"a"#.utf8) + [0] + Array(#""}"#.utf8) + [10])
        #expect(try c.receive().errorCode == "bad_json", "a raw NUL inside a string is a control character")
        try c.send(#"{"id":4,"op":"set","repo":"r","key":"nul\u0000key","value":"\u0000"}"#)
        #expect(try c.receive().ok, "an escaped NUL is fine")
        let million = "[" + Array(repeating: "1", count: 1_000_000).joined(separator: ",") + "]"
        try c.send(#"{"id":5,"op":"set","repo":"r","key":"big","value":\#(million)}"#)
        #expect(try c.receive(timeout: .seconds(30)).ok)
        #expect(try c.call(["op": "get", "repo": "r", "key": "big"], timeout: .seconds(30))["value"]?.arrayValue?.count == 1_000_000)
    }

    @Test func aGibibyteLineWithoutNewlineIsRefusedInBoundedMemory() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        #expect(try c.call(["id": 1, "op": "ping"]).ok)
        let before = try peakResidentKiB(d.pid)
        let chunk = [UInt8](repeating: UInt8(ascii: "x"), count: 1 << 20)
        try c.sendRaw(chunk + [UInt8(ascii: "x")])  // one byte over the default 1 MiB limit
        #expect(try c.receive().errorCode == "too_large", "refused as soon as the line crosses the limit")
        for _ in 1..<1024 { try c.sendRaw(chunk) }
        try c.sendRaw([10])
        #expect(try c.call(["id": 2, "op": "ping"], timeout: .seconds(60))["id"] == 2, "the rest of the line was discarded")
        let grown = try peakResidentKiB(d.pid) - before
        #expect(grown < 32 * 1024, "the daemon's peak RSS grew \(grown) KiB while discarding 1 GiB")
    }
}

/// The peak resident set size of process `pid` (VmHWM), in KiB.
func peakResidentKiB(_ pid: Int32) throws -> Int {
    let status = try String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)
    guard let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmHWM:") }),
        let kib = Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "")
    else { throw TestFailure("no VmHWM in /proc/\(pid)/status") }
    return kib
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct SubscriptionConformance {
    @Test func keyedPrefixAndAllFiltering() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let keysSub = try c.call(["op": "subscribe", "repo": "ui", "keys": ["theme", "lang"]])
        let prefixSub = try c.call(["op": "subscribe", "repo": "ui", "prefix": "win/"])
        let allSub = try c.call(["op": "subscribe", "repo": "ui"])
        #expect(keysSub["sub"] != prefixSub["sub"] && prefixSub["sub"] != allSub["sub"])
        let w = try d.connect()
        _ = try w.call(["op": "set", "repo": "ui", "key": "theme", "value": "dark"])
        _ = try w.call(["op": "set", "repo": "ui", "key": "win/1", "value": 1])
        _ = try w.call(["op": "set", "repo": "other", "key": "theme", "value": "x"])
        _ = try w.call(["op": "batch", "repo": "ui", "ops": [["op": "set", "key": "lang", "value": "fr"], ["op": "set", "key": "win/2", "value": 2], ["op": "set", "key": "zz", "value": 0]]])
        var bySub: [UInt64: [JSONObject]] = [:]
        for _ in 0..<7 {
            let e = try c.receive()
            #expect(e["event"] == "change" && e["id"] == nil && e["repo"] == "ui")
            bySub[e["sub"]!.uint64Value!, default: []].append(e)
        }
        #expect(bySub[keysSub["sub"]!.uint64Value!]?.map { $0["changes"]! } == [[["key": "theme", "new": "dark"]], [["key": "lang", "new": "fr"]]])
        #expect(bySub[prefixSub["sub"]!.uint64Value!]?.map { $0["changes"]! } == [[["key": "win/1", "new": 1]], [["key": "win/2", "new": 2]]])
        #expect(bySub[allSub["sub"]!.uint64Value!]?.map { $0["rev"]! } == [1, 2, 3])
        #expect(bySub[allSub["sub"]!.uint64Value!]?.last?["changes"]?.arrayValue?.count == 3)
    }

    @Test func initialSnapshotComesFirstThenHigherRevisions() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        _ = try c.call(["op": "batch", "repo": "ui", "ops": [["op": "set", "key": "theme", "value": "light"], ["op": "set", "key": "lang", "value": "en"], ["op": "set", "key": "x", "value": 0]]])
        let id = try c.request(["op": "subscribe", "repo": "ui", "keys": ["theme", "lang", "absent"], "initial": true])
        let reply = try c.receive()
        #expect(reply["id"] == id && reply["rev"] == 1)
        let snapshot = try c.receive()
        #expect(snapshot == JSONObject(uniqueMembers: [("event", "snapshot"), ("sub", reply["sub"]!), ("repo", "ui"), ("rev", 1), ("values", ["lang": "en", "theme": "light"])]))
        _ = try c.call(["op": "set", "repo": "ui", "key": "theme", "value": "dark"])
        let change = try c.receive()
        #expect(change["rev"] == 2)
        // Empty repository: empty snapshot at revision 0, as in the contract's example session.
        let empty = try c.call(["op": "subscribe", "repo": "fresh", "keys": ["theme"], "initial": true])
        #expect(empty["rev"] == 0)
        let emptySnapshot = try c.receive()
        #expect(emptySnapshot["values"] == .object(JSONObject()) && emptySnapshot["rev"] == 0)
    }

    @Test func sinceReplaysThenSyncsThenGoesLive() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        for i in 1...6 { _ = try c.call(["op": "set", "repo": "h", "key": i % 2 == 0 ? "even" : "odd", "value": .int(Int64(i))]) }
        let reply = try c.call(["op": "subscribe", "repo": "h", "keys": ["even"], "since": 2])
        #expect(reply["rev"] == 6)
        let r1 = try c.receive(), r2 = try c.receive(), synced = try c.receive()
        #expect(r1["rev"] == 4 && r2["rev"] == 6)
        #expect(r1["changes"] == [["key": "even", "old": 2, "new": 4]])
        #expect(synced == JSONObject(uniqueMembers: [("event", "synced"), ("sub", reply["sub"]!), ("repo", "h"), ("rev", 6)]))
        _ = try c.call(["op": "set", "repo": "h", "key": "even", "value": 8])
        #expect(try c.receive()["rev"] == 7)
        // Caught up already: an empty replay still ends with synced.
        let current = try c.call(["op": "subscribe", "repo": "h", "since": 7])
        let s2 = try c.receive()
        #expect(s2["event"] == "synced" && s2["sub"] == current["sub"] && s2["rev"] == 7)
        // since 0 on an empty repository.
        _ = try c.call(["op": "subscribe", "repo": "void", "since": 0])
        #expect(try c.receive()["event"] == "synced")
    }

    @Test func sinceBeyondHistoryOrAheadIsCompacted() async throws {
        let d = try await TestDaemon.start(["--history-limit", "3"])
        let c = try d.connect()
        for i in 1...10 { _ = try c.call(["op": "set", "repo": "h", "key": "k", "value": .int(Int64(i))]) }
        #expect(try c.call(["op": "subscribe", "repo": "h", "since": 6]).errorCode == "compacted")
        let ok = try c.call(["op": "subscribe", "repo": "h", "since": 7])
        #expect(ok.ok)
        #expect(try c.receive()["rev"] == 8)
        #expect(try c.call(["op": "subscribe", "repo": "h", "since": 11]).errorCode == "compacted")
        #expect(try c.call(["op": "subscribe", "repo": "never", "since": 1]).errorCode == "compacted")
        #expect(try c.call(["op": "subscribe", "repo": "h", "since": 1, "initial": true]).errorCode == "bad_request")
    }

    @Test func onceEndsAfterItsFirstChange() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let once = try c.call(["op": "subscribe", "repo": "o", "keys": ["k"], "once": true])
        let sentinel = try c.call(["op": "subscribe", "repo": "o", "keys": ["s"]])
        _ = try c.call(["op": "set", "repo": "o", "key": "k", "value": 1])
        _ = try c.call(["op": "set", "repo": "o", "key": "k", "value": 2])
        _ = try c.call(["op": "set", "repo": "o", "key": "s", "value": 0])
        let first = try c.receive()
        #expect(first["sub"] == once["sub"] && first["rev"] == 1)
        #expect(try c.receive()["sub"] == sentinel["sub"], "nothing more for the once subscription")
        #expect(try c.call(["op": "unsubscribe", "sub": once["sub"]!]).errorCode == "not_found")
        // once with since: the first replayed change ends it, with no synced.
        let replayOnce = try c.call(["op": "subscribe", "repo": "o", "keys": ["k"], "since": 0, "once": true])
        let replayed = try c.receive()
        #expect(replayed["sub"] == replayOnce["sub"] && replayed["rev"] == 1 && replayed["event"] == "change")
        _ = try c.call(["op": "set", "repo": "o", "key": "s", "value": 1])
        #expect(try c.receive()["sub"] == sentinel["sub"])
        // once with initial: snapshot, then exactly one change.
        let initialOnce = try c.call(["op": "subscribe", "repo": "o", "keys": ["k"], "initial": true, "once": true])
        #expect(try c.receive()["event"] == "snapshot")
        _ = try c.call(["op": "set", "repo": "o", "key": "k", "value": 3])
        _ = try c.call(["op": "set", "repo": "o", "key": "k", "value": 4])
        _ = try c.call(["op": "set", "repo": "o", "key": "s", "value": 2])
        let change = try c.receive()
        #expect(change["sub"] == initialOnce["sub"] && change["rev"] == 5)
        #expect(try c.receive()["sub"] == sentinel["sub"])
    }

    @Test func unsubscribeStopsEventsAtItsReply() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let sub = try c.call(["op": "subscribe", "repo": "u", "keys": ["k"]])
        let sentinel = try c.call(["op": "subscribe", "repo": "u", "keys": ["s"]])
        let w = try d.connect()
        _ = try w.call(["op": "set", "repo": "u", "key": "k", "value": 1])
        #expect(try c.receive()["sub"] == sub["sub"])
        let un = try c.call(["op": "unsubscribe", "sub": sub["sub"]!])
        #expect(un.ok)
        _ = try w.call(["op": "set", "repo": "u", "key": "k", "value": 2])
        _ = try w.call(["op": "set", "repo": "u", "key": "s", "value": 1])
        #expect(try c.receive()["sub"] == sentinel["sub"])
        #expect(try c.call(["op": "unsubscribe", "sub": sub["sub"]!]).errorCode == "not_found")
        #expect(try c.call(["op": "unsubscribe", "sub": 999]).errorCode == "not_found")
    }

    @Test func closingAConnectionEndsItsSubscriptions() async throws {
        let d = try await TestDaemon.start()
        let observer = try d.connect()
        do {
            let c = try d.connect()
            _ = try c.call(["op": "subscribe", "repo": "x"])
            _ = try c.call(["op": "subscribe", "repo": "y", "keys": ["a"]])
            #expect(try observer.call(["op": "stats"])["subscriptions"] == 2)
            c.close()
        }
        // The daemon notices the close asynchronously: it ends the subscriptions, then counts
        // the connection out. Wait for both, bounded.
        var last = JSONObject()
        let settled = try eventually(timeout: .seconds(10)) {
            last = try observer.call(["op": "stats"])
            return last["subscriptions"] == 0 && last["connections"] == 1
        }
        #expect(settled, "subscriptions \(String(describing: last["subscriptions"])), connections \(String(describing: last["connections"]))")
    }
}
