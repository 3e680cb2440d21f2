// Tests of request decoding: every op, and the precise error code for every way a
// request can be wrong.

import Foundation
import ObsProtocol
import ObservableKit
import Testing

/// `text` read by `decoder` (`Request.decode(line:)` unless told).
func decode<R>(
    _ text: String, with decoder: (UnsafeRawBufferPointer) throws(RequestFailure) -> R = { raw throws(RequestFailure) in try Request.decode(line: raw) }
) throws(RequestFailure) -> R {
    let bytes = Array(text.utf8)
    let result = bytes.withUnsafeBytes { raw in Result { () throws(RequestFailure) in try decoder(raw) } }
    return try result.get()
}

func decode(_ text: String) throws(RequestFailure) -> Request { try decode(text, with: { raw throws(RequestFailure) in try Request.decode(line: raw) }) }

/// Why `decoder` refuses `text`, or nil if it accepts it.
func failure<R>(
    _ text: String, with decoder: (UnsafeRawBufferPointer) throws(RequestFailure) -> R = { raw throws(RequestFailure) in try Request.decode(line: raw) }
) -> RequestFailure? {
    do {
        _ = try decode(text, with: decoder)
        return nil
    } catch {
        return error
    }
}

@Suite struct RequestDecodingTests {
    @Test func decodesEveryOp() throws {
        guard case .hello(let p, let c) = try decode(#"{"op":"hello","protocol":1,"client":"t"}"#).command, p == 1, c == "t" else {
            Issue.record("hello"); return
        }
        guard case .ping = try decode(#"{"op":"ping"}"#).command else { Issue.record("ping"); return }
        guard case .get("ui", "theme") = try decode(#"{"op":"get","repo":"ui","key":"theme"}"#).command else {
            Issue.record("get"); return
        }
        guard case .set("ui", "k", .null, 3, true) = try decode(#"{"op":"set","repo":"ui","key":"k","value":null,"ifRev":3,"force":true}"#).command
        else { Issue.record("set with null value"); return }
        guard case .delete("ui", "k", 0) = try decode(#"{"op":"delete","repo":"ui","key":"k","ifRev":0}"#).command else {
            Issue.record("delete"); return
        }
        guard case .batch("ui", let ops) = try decode(
            #"{"op":"batch","repo":"ui","ops":[{"op":"set","key":"a","value":1},{"op":"delete","key":"b","ifRev":2}]}"#).command,
            ops.count == 2
        else { Issue.record("batch"); return }
        guard case .list("ui", "p/", true) = try decode(#"{"op":"list","repo":"ui","prefix":"p/","values":true}"#).command else {
            Issue.record("list"); return
        }
        guard case .repos = try decode(#"{"op":"repos"}"#).command else { Issue.record("repos"); return }
        guard case .subscribe(let s) = try decode(#"{"op":"subscribe","repo":"ui","keys":["a","b","a"],"initial":true,"once":true}"#).command
        else { Issue.record("subscribe"); return }
        #expect(s == SubscribeRequest(repo: "ui", selection: .keys(["a", "b"]), initial: true, since: nil, once: true))
        guard case .unsubscribe(7) = try decode(#"{"op":"unsubscribe","sub":7}"#).command else { Issue.record("unsubscribe"); return }
        guard case .stats = try decode(#"{"op":"stats"}"#).command else { Issue.record("stats"); return }
    }

    @Test func echoesIdsVerbatimAndIgnoresUnknownFields() throws {
        #expect(try decode(#"{"id":7,"op":"ping","extra":[1]}"#).id == 7)
        #expect(try decode(#"{"id":"a-1","op":"ping"}"#).id == "a-1")
        #expect(try decode(#"{"id":1.5,"op":"ping"}"#).id == 1.5)
        #expect(try decode(#"{"op":"ping"}"#).id == .null)
    }

    @Test(arguments: ["nope", "[1,2]", "\"op\"", "42", "{\"op\":\"ping\"", "{\"op\":\"ping\"} x"])
    func badJSON(_ text: String) {
        let f = failure(text)
        #expect(f?.error.code == .badJSON)
        #expect(f?.id == .null)
    }

    @Test(arguments: [
        #"{"id":1}"#, #"{"id":1,"op":null}"#, #"{"id":1,"op":5}"#, #"{"id":1,"op":["get"]}"#,
        #"{"id":1,"op":"get","key":"k"}"#, #"{"id":1,"op":"get","repo":"ui"}"#,
        #"{"id":1,"op":"get","repo":"","key":"k"}"#, #"{"id":1,"op":"get","repo":"a b","key":"k"}"#,
        #"{"id":1,"op":"get","repo":"ü","key":"k"}"#, #"{"id":1,"op":"get","repo":5,"key":"k"}"#,
        #"{"id":1,"op":"get","repo":"ui","key":""}"#, #"{"id":1,"op":"get","repo":"ui","key":7}"#,
        #"{"id":1,"op":"set","repo":"ui","key":"k"}"#, #"{"id":1,"op":"set","repo":"ui","key":"k","value":1,"ifRev":-1}"#,
        #"{"id":1,"op":"set","repo":"ui","key":"k","value":1,"ifRev":"3"}"#, #"{"id":1,"op":"set","repo":"ui","key":"k","value":1,"ifRev":1.5}"#,
        #"{"id":1,"op":"set","repo":"ui","key":"k","value":1,"force":"yes"}"#,
        #"{"id":1,"op":"batch","repo":"ui"}"#, #"{"id":1,"op":"batch","repo":"ui","ops":{}}"#,
        #"{"id":1,"op":"batch","repo":"ui","ops":[1]}"#, #"{"id":1,"op":"batch","repo":"ui","ops":[{"op":"get","key":"a"}]}"#,
        #"{"id":1,"op":"batch","repo":"ui","ops":[{"op":"set","key":"a"}]}"#,
        #"{"id":1,"op":"batch","repo":"ui","ops":[{"op":"set","key":"a","value":1},{"op":"delete","key":"a"}]}"#,
        #"{"id":1,"op":"list","repo":"ui","prefix":3}"#, #"{"id":1,"op":"list","repo":"ui","values":1}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","keys":["a"],"prefix":"p"}"#, #"{"id":1,"op":"subscribe","repo":"ui","keys":"a"}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","keys":[1]}"#, #"{"id":1,"op":"subscribe","repo":"ui","keys":[""]}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","since":1,"initial":true}"#, #"{"id":1,"op":"subscribe","repo":"ui","since":-1}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","once":1}"#, #"{"id":1,"op":"subscribe"}"#,
        #"{"id":1,"op":"unsubscribe"}"#, #"{"id":1,"op":"unsubscribe","sub":"1"}"#,
    ])
    func badRequest(_ text: String) {
        let f = failure(text)
        #expect(f?.error.code == .badRequest, "\(text): \(String(describing: f))")
        #expect(f?.id == 1)
    }

    @Test func invalidIdIsBadRequestAndEchoed() {
        let f = failure(#"{"id":{"x":1},"op":"ping"}"#)
        #expect(f?.error.code == .badRequest)
        #expect(f?.id == ["x": 1])
        #expect(failure(#"{"id":true,"op":"ping"}"#)?.error.code == .badRequest)
    }

    @Test func unknownOp() {
        let f = failure(#"{"id":"q","op":"frobnicate"}"#)
        #expect(f?.error.code == .unknownOp)
        #expect(f?.id == "q")
    }

    @Test func keyAndRepoLimits() throws {
        let key1024 = String(repeating: "k", count: 1024)
        _ = try decode(#"{"op":"get","repo":"ui","key":"\#(key1024)"}"#)
        #expect(failure(#"{"op":"get","repo":"ui","key":"\#(key1024)k"}"#)?.error.code == .badRequest)
        let multibyte = String(repeating: "é", count: 513)  // 1026 bytes, 513 characters
        #expect(failure(#"{"op":"get","repo":"ui","key":"\#(multibyte)"}"#)?.error.code == .badRequest)
        let repo128 = String(repeating: "r", count: 128)
        _ = try decode(#"{"op":"get","repo":"\#(repo128)","key":"k"}"#)
        #expect(failure(#"{"op":"get","repo":"\#(repo128)r","key":"k"}"#)?.error.code == .badRequest)
        _ = try decode(#"{"op":"get","repo":"A-z_0.9","key":"k"}"#)
    }

    @Test func nullOptionalFieldsMeanAbsent() throws {
        guard case .set(_, _, _, nil, false) = try decode(#"{"op":"set","repo":"ui","key":"k","value":1,"ifRev":null,"force":null}"#).command
        else { Issue.record("null optionals"); return }
        guard case .subscribe(let s) = try decode(#"{"op":"subscribe","repo":"ui","keys":null,"prefix":"p"}"#).command else {
            Issue.record("subscribe"); return
        }
        #expect(s.selection == .prefix("p"))
    }

    @Test func emptyKeysSelectNothingAndEmptyPrefixSelectsAll() throws {
        guard case .subscribe(let a) = try decode(#"{"op":"subscribe","repo":"ui","keys":[]}"#).command,
            case .subscribe(let b) = try decode(#"{"op":"subscribe","repo":"ui","prefix":""}"#).command
        else { Issue.record("subscribe"); return }
        #expect(a.selection == .keys([]))
        #expect(b.selection == .all)
    }

    @Test func encodedRequestsRoundTrip() throws {
        let commands: [Command] = [
            .set(repo: "ui", key: "k", value: ["a": [1, 2.5]], ifRev: 4, force: true),
            .batch(repo: "ui", ops: [.set("a", 1, ifRevision: 0, force: false), .delete("b", ifRevision: nil)]),
            .subscribe(SubscribeRequest(repo: "ui", selection: .prefix("p"), initial: false, since: 9, epoch: "e1", once: true)),
            .hello(protocol: 1, client: "c"), .get(repo: "ui", key: "k"), .list(repo: "ui", prefix: "p", values: true),
        ]
        for command in commands {
            var encoded: [UInt8] = []
            command.encodeRequest(into: &encoded, id: 3)
            #expect(encoded.last == UInt8(ascii: "\n"))
            let back = try decode(String(decoding: encoded.dropLast(), as: UTF8.self))
            #expect(back.id == 3)
            #expect(back.command.op == command.op)
            var again: [UInt8] = []
            back.command.encodeRequest(into: &again, id: 3)
            #expect(again == encoded)
        }
    }

    @Test func valuesAreKeptCanonicalAsTheTreeWouldEncodeThem() throws {
        let line = #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":{ "x" : [1, 2.50, "\u00e9"], "x": -0 }},"#
            + #"{"op":"delete","key":"b"},{"op":"set","key":"c","value":"plain"}],"value":"ignored","id":1}"#
        guard case .batch(_, let ops) = try decode(line).command, ops.count == 3,
            case .set(_, let a, _, _) = ops[0], case .set(_, let c, _, _) = ops[2]
        else { Issue.record("batch"); return }
        #expect(String(decoding: a.bytes, as: UTF8.self) == #"{"x":0}"#, "a repeated name: the last value, at the first position")
        #expect(String(decoding: c.bytes, as: UTF8.self) == #""plain""#)
        guard case .set(_, _, let v, _, _) = try decode(#"{"op":"set","repo":"r","key":"k","value":[1.0, {"b":1,"a":2}],"value":7}"#).command
        else { Issue.record("set"); return }
        #expect(v == 7, "the last value member wins")
        #expect(throws: RequestFailure.self) { try decode(#"{"op":"set","repo":"r","key":"k","value":[1,]}"#) }
        let missing = #expect(throws: RequestFailure.self) { try decode(#"{"op":"set","repo":"r","key":"k"}"#) }
        #expect(missing?.error.message == "missing field \"value\"")
    }
}

@Suite struct ServerMessageTests {
    func decodeMessage(_ text: String) throws -> ServerMessage {
        let bytes = Array(text.utf8)
        return try bytes.withUnsafeBytes { raw in try ServerMessage.decode(line: raw) }
    }

    @Test func decodesRepliesAndEvents() throws {
        guard case .reply(let ok) = try decodeMessage(#"{"id":1,"ok":true,"rev":3}"#), case .success(let o) = ok.result else {
            Issue.record("ok reply"); return
        }
        #expect(o["rev"] == 3)
        #expect(o["id"] == nil)
        guard case .reply(let bad) = try decodeMessage(#"{"id":2,"ok":false,"error":{"code":"conflict","message":"m"}}"#),
            case .failure(let e) = bad.result
        else { Issue.record("error reply"); return }
        #expect(e == ProtocolError(.conflict, "m"))
        guard case .event(.change(let change)) = try decodeMessage(
            #"{"event":"change","sub":3,"repo":"ui","rev":43,"changes":[{"key":"t","old":"a","new":"b"},{"key":"d","old":1},{"key":"n","new":null}]}"#),
            change.subscription == 3, change.repository == "ui", change.revision == 43, change.from == nil, change.by == nil
        else { Issue.record("change"); return }
        #expect(change.changes == [Change(key: "t", old: "a", new: "b"), Change(key: "d", old: 1, new: nil), Change(key: "n", old: nil, new: .null)])
        guard case .event(.overflow(let overflow)) = try decodeMessage(#"{"event":"overflow","revs":{"3":43,"4":17}}"#) else {
            Issue.record("overflow"); return
        }
        #expect(overflow.revisions == [3: 43, 4: 17])
    }

    @Test func encodersProduceWhatDecodersRead() throws {
        var out: [UInt8] = []
        SnapshotEvent(subscription: 1, repository: "ui", revision: 42, entries: [(Key("theme"), JSONValue.string("light"))]).encode(into: &out)
        EventEncoder.writeSynced(&out, sub: 1, repo: "ui", rev: 57)
        ReplyEncoder.error(&out, id: "x", ProtocolError(.tooLarge, "big"))
        let lines = String(decoding: out, as: UTF8.self).split(separator: "\n").map(String.init)
        #expect(lines == [
            #"{"event":"snapshot","sub":1,"repo":"ui","rev":42,"values":{"theme":"light"}}"#,
            #"{"event":"synced","sub":1,"repo":"ui","rev":57}"#,
            #"{"id":"x","ok":false,"error":{"code":"too_large","message":"big"}}"#,
        ])
        for line in lines { _ = try decodeMessage(line) }
    }

    @Test func socketPathResolution() {
        #expect(SocketPath.resolve(explicit: "/a", environment: ["OBSD_SOCKET": "/b"]) == "/a")
        #expect(SocketPath.resolve(explicit: nil, environment: ["OBSD_SOCKET": "/b", "XDG_RUNTIME_DIR": "/run/user/1"]) == "/b")
        #expect(SocketPath.resolve(explicit: nil, configured: "/c", environment: ["XDG_RUNTIME_DIR": "/run/user/1"]) == "/c")
        #expect(SocketPath.resolve(explicit: nil, environment: ["XDG_RUNTIME_DIR": "/run/user/1"]) == "/run/user/1/obsd.sock")
        #expect(SocketPath.resolve(explicit: nil, environment: ["XDG_RUNTIME_DIR": ""]) == "/run/obsd/obsd.sock")
        #expect(SocketPath.resolve(explicit: nil, environment: [:]) == "/run/obsd/obsd.sock")
    }
}

@Suite struct ReleaseTests {
    @Test func theProtocolDocumentShowsThisRelease() throws {
        let doc = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../docs/PROTOCOL.md").path
        let text = try String(contentsOfFile: doc, encoding: .utf8)
        #expect(text.contains("\"obsd/\(ObsRelease.version)\""), "docs/PROTOCOL.md shows the hello reply of this release")
    }
}

@Suite struct FastPathTests {
    static let lines = [
        #"{"id":1,"op":"set","repo":"busbench","key":"bb.fan","value":1700000000000}"#,
        #"{"op":"set","repo":"r","key":"é/k","value":{"b":[1,2.5,null],"a":"x"},"ifRev":0,"force":true,"extra":{"deep":[1]}}"#,
        #"{"id":"s","op":"get","repo":"r","key":"k"}"#,
        #"{"op":"delete","repo":"r","key":"k","ifRev":null}"#,
        #"{"op":"subscribe","repo":"r","keys":["a","b","a"],"initial":true,"once":false}"#,
        #"{"op":"subscribe","repo":"r","prefix":"","since":4,"epoch":"e"}"#,
        #"{"op":"subscribe","repo":"r","prefix":"p/","epoch":"e"}"#,
        #"{"op":"subscribe","repo":"r","keys":["a"],"since":4,"epoch":"e","catchup":true,"progress":true}"#,
        #"{"op":"subscribe","repo":"r","catchup":false}"#,
        #"{"op":"unsubscribe","sub":3,"id":-9}"#,
        #"{"op":"list","repo":"r","values":true,"prefix":null}"#,
        #"{"op":"hello","protocol":1,"client":"c"}"#,
        #"{ "op" : "ping" , "op" : "stats" }"#,
        #"{"op":"repos"}"#,
        // Member names read by one 8-byte load, in any order; near the line's end (fewer than
        // 8 bytes to look ahead) and as prefixes of other names, read as any name is.
        #"{"value":[1],"key":"k","repo":"r","op":"set","keys":null,"values":null,"id":7}"#,
        #"{"repo":"r","key":"k","op":"delete","id":"x"}"#,
        #"{"key":"k","op":"get","repo":"r"}"#,
        // Writes naming a lease, and batches, read in place too.
        #"{"op":"set","repo":"r","key":"k","value":1,"lease":3}"#,
        #"{"op":"batch","repo":"r","ops":[]}"#,
        #"{"id":2,"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":{"y":1,"x":[2.50]},"lease":7,"ifRev":0},{"key":"b","op":"delete","ifRev":3,"value":9,"force":true,"lease":2},{"op":"set","key":"c","value":null,"force":true,"extra":[1]}]}"#,
        #"{"op":"batch","ops":[{"op":"set","key":"x","value":1,"value":2}],"repo":"r"}"#,
    ]
    /// Lines the fast path leaves to the general decoder (which accepts or refuses them).
    static let general = [
        #"{"op":"set","repo":"r","key":"k\u0041","value":1}"#,
        // Batches with a key twice, another operation, no key, a set without a value, a lease 0.
        #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":1},{"op":"delete","key":"a"}]}"#,
        #"{"op":"batch","repo":"r","ops":[{"op":"get","key":"a"}]}"#, #"{"op":"batch","repo":"r","ops":[{"op":"delete"}]}"#,
        #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a"}]}"#, #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":1,"lease":0}]}"#,
        #"{"op":"batch","repo":"r","ops":{}}"#, #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a\n","value":1}]}"#,
        #"{"op":"set","repo":"bad name","key":"k","value":1}"#, #"{"op":"set","repo":"r","key":"","value":1}"#,
        #"{"op":"set","repo":"r","key":"k","value":1,"ifRev":3.0}"#, #"{"op":"get","repo":"r","key":"k","id":1.5}"#,
        #"{"op":"subscribe","repo":"r","keys":["a"],"prefix":"p"}"#, #"{"op":"subscribe","repo":"r","initial":true,"since":1}"#,
        #"{"op":"nope"}"#, #"{}"#, #"[1]"#, #"{"op":"set","repo":"r","key":"k"}"#, #"{"op":"get","repo":"r","key":"k"} x"#,
        #"{"op":"get","repo":"r","key":"k","id":true}"#, #"{"op":"get","repo":"r","key":"k","junk":[1,]}"#,
        #"{"op":"subscribe","repo":"r","prefix":"p/","epoch":7}"#,
        // catchup without since, with once: the general decoder's to refuse; sync is never scanned.
        #"{"op":"subscribe","repo":"r","catchup":true}"#, #"{"op":"subscribe","repo":"r","since":1,"once":true,"catchup":true}"#,
        #"{"op":"sync","sub":1}"#,
        #"{"op":"sets","repo":"r","key":"k","value":1}"#, #"{"op":"se","repo":"r","key":"k","value":1}"#,
    ]

    @Test(arguments: lines) func theFastPathReadsTheCommonRequestsAsTheDecoderDoes(_ text: String) throws {
        try Array(text.utf8).withUnsafeBytes { raw in
            let fast = try #require(Request.scan(raw), "the fast path takes \(text)")
            #expect(fast == (try Request.decodeInGeneral(line: raw)))
        }
    }

    /// The fast path's string scan (eight bytes at a time) against the general decoder: keys
    /// of every length up to 20 with a quote, a backslash, a control character, a non-ASCII
    /// character or an invalid UTF-8 byte at every position — the fast path reads the line
    /// exactly as the decoder does, or leaves it to the decoder.
    @Test func theFastPathsStringScanAgreesWithTheDecoderAtEveryPosition() throws {
        let specials: [[UInt8]] = [[0x22], [0x5C, 0x22], [0x5C, 0x6E], [0x01], [0x1F], Array("é".utf8), [0xFF], [0xC3], Array("€".utf8)]
        var taken = 0
        for length in 0...20 {
            for at in 0...length {
                for special in specials {
                    var key = [UInt8](repeating: UInt8(ascii: "k"), count: length)
                    key.insert(contentsOf: special, at: at)
                    let line = Array(#"{"id":1,"op":"get","repo":"r","key":""#.utf8) + key + Array(#""}"#.utf8)
                    try line.withUnsafeBytes { raw in
                        let general = try? Request.decodeInGeneral(line: raw)
                        guard let fast = Request.scan(raw) else { return }
                        taken += 1
                        #expect(fast == general, "key bytes \(key)")
                    }
                }
            }
        }
        #expect(taken > 100, "the fast path took \(taken) of the lines")
    }

    /// Writes the daemon applies in place — single keys, with leases, batches: what the fast
    /// path reads is what the decoder reads; anything else is not offered as one.
    @Test(arguments: lines + general + [
        #"{"id":"w","op":"set","repo":"r","key":"k","value":{"b":[1,2.50],"a":null},"ifRev":0,"force":true}"#,
        #"{"op":"delete","repo":"r","key":"k","ifRev":4,"force":true,"value":1}"#, #"{"op":"set","repo":"r","key":"k","value":1,"lease":3}"#,
        #"{"op":"set","repo":"r","key":"k","value":1,"lease":null}"#, #"{"op":"set","repo":"r","key":null,"value":1}"#,
        #"{"op":"set","repo":"r","key":"k","value":1,"value":"two"}"#, #"{"op":"get","repo":"r","key":"k"}"#,
    ]) func aSingleKeyWriteReadInPlaceIsTheDecodersWrite(_ text: String) {
        var values: [UInt8] = []
        Array(text.utf8).withUnsafeBytes { raw in
            let decoded = try? Request.decodeInGeneral(line: raw)
            _ = Request.scan(raw, maxDepth: JSONParser.defaultMaxDepth, values: &values) { scanned in
                if scanned.withWrite({ _, _, _ in true }) != nil {
                    #expect(decoded.map { scanned.writeReads($0) } == true, "\(text)")
                } else if let decoded {
                    switch decoded.command {
                    case .set, .delete, .batch: Issue.record("a write not offered in place: \(text)")
                    default: break
                    }
                }
                return true
            }
        }
    }

    /// One `values` buffer kept across lines, as a connection keeps it (values are appended
    /// after earlier lines' until it holds 4 KiB): every line still reads as the decoder reads it.
    @Test func aValuesBufferKeptAcrossLinesReadsEveryLineAsTheDecoderDoes() throws {
        var values: [UInt8] = []
        let big = #"{"op":"set","repo":"r","key":"big","value":""# + String(repeating: "x", count: 5000) + #""}"#
        for text in Array(repeating: Self.lines + [big], count: 3).joined() {
            try Array(text.utf8).withUnsafeBytes { raw in
                let decoded = try Request.decodeInGeneral(line: raw)
                let handled = Request.scan(raw, maxDepth: JSONParser.defaultMaxDepth, values: &values) { scanned in
                    #expect(scanned.request() == decoded, "\(text.prefix(80))")
                    #expect(scanned.writeReads(decoded) != false, "\(text.prefix(80))")
                    return true
                }
                #expect(handled == true, "the fast path takes \(text.prefix(80))")
            }
        }
        #expect(values.count < 1 << 13, "the buffer is emptied once it holds 4 KiB")
    }

    @Test(arguments: general) func theRestGoesToTheGeneralDecoder(_ text: String) {
        Array(text.utf8).withUnsafeBytes { raw in
            #expect(Request.scan(raw) == nil, "\(text)")
        }
    }
}
