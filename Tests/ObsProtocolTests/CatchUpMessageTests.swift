// Tests of the messages of catch-up and sync (the contract's "Catching up" and "Sync"
// sections): the `catchup` subscribe option encoded and decoded by the general decoder with
// its `bad_request` cases, the reply's `catchup`, the `catchup` event (whole and in pieces,
// as the contract shows it, and refused when it breaks the contract), and the `sync`
// request and reply, with the `bad_request` and `not_found` its `sub` can get.
//
// The requests are read with `Request.decodeInGeneral`: the fast path (RequestScanner.swift)
// does not know `catchup` yet and must hand such a line to the general decoder (see the
// report of the client branch); `sync` it never takes.

import ObsProtocol
import ObservableKit
import Testing

private func general(_ text: String) throws(RequestFailure) -> Request {
    try decode(text, with: { raw throws(RequestFailure) in try Request.decodeInGeneral(line: raw) })
}

private func generalFailure(_ text: String) -> RequestFailure? {
    failure(text, with: { raw throws(RequestFailure) in try Request.decodeInGeneral(line: raw) })
}

private func requestLine(_ command: Command, id: JSONValue = 1) -> String {
    var out: [UInt8] = []
    command.encodeRequest(into: &out, id: id)
    return String(decoding: out, as: UTF8.self)
}

@Suite struct CatchUpRequestTests {
    @Test func catchupIsSentOnlyWhenAskedAndReadBack() throws {
        let resume = SubscribeRequest(repo: "ui", selection: .prefix("p/"), since: 40, epoch: "e1", progress: true, catchup: true)
        let text = requestLine(.subscribe(resume))
        #expect(text == #"{"id":1,"op":"subscribe","repo":"ui","prefix":"p/","since":40,"epoch":"e1","progress":true,"catchup":true}"# + "\n")
        guard case .subscribe(let back) = try general(String(text.dropLast())).command else { Issue.record("subscribe"); return }
        #expect(back == resume)
        #expect(requestLine(.subscribe(SubscribeRequest(repo: "ui", since: 3))) == #"{"id":1,"op":"subscribe","repo":"ui","since":3}"# + "\n")
    }

    @Test(arguments: [
        #"{"id":1,"op":"subscribe","repo":"ui","since":4,"catchup":false}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","since":4,"catchup":null}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","catchup":false}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","initial":true,"catchup":false}"#,
        #"{"id":1,"op":"subscribe","repo":"ui","once":true,"catchup":null}"#,
    ])
    func catchupFalseIsTheSameAsLeavingItOut(_ text: String) throws {
        guard case .subscribe(let s) = try general(text).command else { Issue.record("subscribe"); return }
        #expect(!s.catchup)
    }

    @Test func catchupWithSinceAndWhatItGoesWith() throws {
        let text = #"{"id":1,"op":"subscribe","repo":"ui","keys":["a"],"since":0,"epoch":"x","catchup":true,"coalesce":true,"writers":true,"echo":false,"progress":true}"#
        guard case .subscribe(let s) = try general(text).command else { Issue.record("subscribe"); return }
        #expect(s.catchup && s.since == 0 && s.epoch == "x" && s.coalesce && s.writers && !s.echo && s.progress && s.selection == .keys(["a"]))
    }

    @Test(arguments: [
        (#"{"id":1,"op":"subscribe","repo":"ui","catchup":true}"#, "since"),  // without since
        (#"{"id":1,"op":"subscribe","repo":"ui","initial":true,"catchup":true}"#, "since"),
        (#"{"id":1,"op":"subscribe","repo":"ui","since":null,"catchup":true}"#, "since"),
        (#"{"id":1,"op":"subscribe","repo":"ui","since":4,"once":true,"catchup":true}"#, "once"),
        (#"{"id":1,"op":"subscribe","repo":"ui","since":4,"catchup":"yes"}"#, "boolean"),
        (#"{"id":1,"op":"subscribe","repo":"ui","since":4,"catchup":1}"#, "boolean"),
        (#"{"id":1,"op":"subscribe","repo":"ui","since":4,"catchup":[true]}"#, "boolean"),
    ])
    func aMisplacedOrIllTypedCatchupIsABadRequestNamingIt(_ text: String, _ also: String) {
        let f = generalFailure(text)
        #expect(f?.error.code == .badRequest, "\(text): \(String(describing: f))")
        #expect(f?.id == 1)
        #expect(f?.error.message.contains("\"catchup\"") == true && f?.error.message.contains(also) == true, "\(String(describing: f))")
    }

    @Test func syncIsEncodedAndDecoded() throws {
        #expect(requestLine(.sync(sub: 7), id: "s") == #"{"id":"s","op":"sync","sub":7}"# + "\n")
        #expect(Command.sync(sub: 7).op == "sync" && Command.sync(sub: 7).repo == nil)
        for text in [#"{"id":2,"op":"sync","sub":7}"#, #"{"op":"sync","sub":7.0,"repo":"ignored"}"#, #"{"sub":7,"op":"sync"}"#] {
            guard case .sync(7) = try general(text).command else { Issue.record("sync: \(text)"); return }
            guard case .sync(7) = try decode(text).command else { Issue.record("sync through decode(line:): \(text)"); return }
        }
        guard case .sync(0) = try general(#"{"op":"sync","sub":0}"#).command,
            case .sync(UInt64(Int64.max)) = try general(#"{"op":"sync","sub":9223372036854775807}"#).command
        else { Issue.record("the int64 range"); return }
    }

    @Test(arguments: [
        #"{"id":1,"op":"sync"}"#, #"{"id":1,"op":"sync","sub":null}"#, #"{"id":1,"op":"sync","sub":"7"}"#,
        #"{"id":1,"op":"sync","sub":1.5}"#, #"{"id":1,"op":"sync","sub":true}"#, #"{"id":1,"op":"sync","sub":[7]}"#,
        #"{"id":1,"op":"sync","sub":{"sub":7}}"#,
    ])
    func aSyncWithoutAnIntegerSubIsABadRequest(_ text: String) {
        for f in [generalFailure(text), failure(text)] {
            #expect(f?.error.code == .badRequest, "\(text): \(String(describing: f))")
            #expect(f?.id == 1 && f?.error.message.contains("\"sub\"") == true)
        }
    }

    /// An integer is a well-formed `sub`: one no subscription can have is answered as any
    /// number that names no live subscription.
    @Test(arguments: [#"{"id":1,"op":"sync","sub":-1}"#, #"{"id":1,"op":"sync","sub":-1.0}"#, #"{"id":1,"op":"sync","sub":1e30}"#])
    func aSyncOfAnIntegerNoSubscriptionCanHaveIsNotFound(_ text: String) {
        let f = generalFailure(text)
        #expect(f?.error.code == .notFound, "\(text): \(String(describing: f))")
        #expect(f?.id == 1)
    }
}

@Suite struct CatchUpReplyAndEventTests {
    @Test func theSubscribeReplyCarriesCatchupAfterTheEpoch() throws {
        try expectRoundTrip(SubscribeReply(subscription: 3, revision: 97, epoch: "e", catchup: .diff))
        try expectRoundTrip(SubscribeReply(subscription: 3, revision: 97, epoch: "e", catchup: .snapshot))
        try expectRoundTrip(SubscribeReply(subscription: 3, revision: 97, epoch: "e", catchup: .replay))
        try expectDaemonLine(
            #"{"id":1,"ok":true,"sub":3,"rev":97,"epoch":"5f0c","catchup":"diff"}"#,
            SubscribeReply(subscription: 3, revision: 97, epoch: "5f0c", catchup: .diff))
        try expectDaemonLine(#"{"id":1,"ok":true,"sub":3,"rev":97,"epoch":"5f0c"}"#, SubscribeReply(subscription: 3, revision: 97, epoch: "5f0c"))
        #expect(try reply(#"{"id":1,"ok":true,"sub":1,"rev":2,"epoch":"e","catchup":null}"#, as: SubscribeReply.self).reply.catchup == nil)
        #expect(
            try reply(#"{"id":1,"ok":true,"sub":1,"rev":2,"epoch":"e","catchup":"merge"}"#, as: SubscribeReply.self).reply.catchup
                == CatchUpMode(rawValue: "merge"), "a mode of a newer daemon reads as itself")
        #expect(throws: ProtocolViolation.self) { try reply(#"{"id":1,"ok":true,"sub":1,"rev":2,"epoch":"e","catchup":true}"#, as: SubscribeReply.self) }
    }

    @Test func theSyncReplyIsItsRevision() throws {
        try expectRoundTrip(SyncReply(revision: 42))
        try expectDaemonLine(#"{"id":"s","ok":true,"rev":42}"#, SyncReply(revision: 42))
        #expect(throws: ProtocolViolation.self) { try reply(#"{"id":1,"ok":true}"#, as: SyncReply.self) }
        #expect(throws: ProtocolViolation.self) { try reply(#"{"id":1,"ok":true,"rev":-1}"#, as: SyncReply.self) }
    }

    @Test func theCatchupEventAsTheContractShowsIt() throws {
        let expected = CatchUpEvent<CanonicalJSON>(
            subscription: 3, repository: "ui", from: 40, revision: 97, entries: [("lang", "fr"), ("theme", "dark")], deleted: ["draft"])
        try expectDaemonEvent(
            #"{"event":"catchup","sub":3,"repo":"ui","from":40,"rev":97,"values":{"lang":"fr","theme":"dark"},"deleted":["draft"]}"#, expected)
        try expectDaemonEvent(
            #"{"event":"catchup","sub":1,"repo":"ui","from":0,"rev":0,"values":{},"deleted":[]}"#,
            CatchUpEvent<CanonicalJSON>(subscription: 1, repository: "ui", from: 0, revision: 0, entries: [], deleted: []))
        // Through ServerMessage, as a client reads it.
        let diff = CatchUpEvent<JSONValue>(
            subscription: 3, repository: "ui", from: 40, revision: 97, entries: [("b", ["x": [1, nil]]), ("a", .null)], deleted: ["c", "é"])
        let read = try event(eventLine(diff))
        #expect(read == .catchUp(diff) && read.subscription == 3)
        #expect(diff.values == ["a": .null, "b": ["x": [1, nil]]] && !diff.isEmpty)
        #expect(CatchUpEvent<JSONValue>(subscription: 1, repository: "r", from: 1, revision: 2, entries: [], deleted: []).isEmpty)
    }

    @Test func aLargeCatchupWrittenInPiecesIsTheSameLine() {
        let entries: [(key: Key, value: JSONValue)] = (0..<50).map { (Key("k\($0)"), .int(Int64($0))) }
        let deleted: [Key] = (0..<20).map { Key("d\($0)") }
        let whole = CatchUpEvent<JSONValue>(subscription: 9, repository: "big", from: 1, revision: 500, entries: entries, deleted: deleted)
        var pieces: [UInt8] = []
        whole.encodeHead(into: &pieces)
        for (i, entry) in entries.enumerated() { SnapshotEvent<JSONValue>.encodeMember(entry.key, entry.value, first: i == 0, into: &pieces) }
        CatchUpEvent<JSONValue>.encodeDeletedHead(into: &pieces)
        for (i, key) in deleted.enumerated() { CatchUpEvent<JSONValue>.encodeDeleted(key, first: i == 0, into: &pieces) }
        CatchUpEvent<JSONValue>.encodeTail(into: &pieces)
        #expect(String(decoding: pieces, as: UTF8.self) == eventLine(whole))
    }

    @Test func valuesAndDeletedMayBeLeftOut() throws {
        guard case .catchUp(let onlyDeleted) = try event(#"{"event":"catchup","sub":1,"repo":"ui","from":2,"rev":5,"deleted":["a"]}"#),
            case .catchUp(let onlyValues) = try event(#"{"event":"catchup","sub":1,"repo":"ui","from":2,"rev":5,"values":{"a":1},"deleted":null}"#)
        else { Issue.record("catchup events"); return }
        #expect(onlyDeleted.entries.isEmpty && onlyDeleted.deleted == ["a"])
        #expect(onlyValues.values == ["a": 1] && onlyValues.deleted.isEmpty)
    }

    @Test(arguments: [
        #"{"event":"catchup","sub":1,"repo":"ui","from":6,"rev":5,"values":{},"deleted":[]}"#,  // from above rev
        #"{"event":"catchup","sub":1,"repo":"ui","rev":5,"values":{},"deleted":[]}"#,  // no from
        #"{"event":"catchup","sub":1,"repo":"ui","from":-1,"rev":5,"values":{},"deleted":[]}"#,
        #"{"event":"catchup","sub":1,"repo":"ui","from":1,"values":{},"deleted":[]}"#,  // no rev
        #"{"event":"catchup","sub":1,"from":1,"rev":5,"values":{},"deleted":[]}"#,  // no repo
        #"{"event":"catchup","repo":"ui","from":1,"rev":5,"values":{},"deleted":[]}"#,  // no sub
        #"{"event":"catchup","sub":1,"repo":"ui","from":1,"rev":5,"values":[],"deleted":[]}"#,
        #"{"event":"catchup","sub":1,"repo":"ui","from":1,"rev":5,"values":{},"deleted":{}}"#,
        #"{"event":"catchup","sub":1,"repo":"ui","from":1,"rev":5,"values":{},"deleted":[1]}"#,
        #"{"event":"catchup","sub":1,"repo":"ui","from":1,"rev":5,"values":{"a":1},"deleted":["b","a"]}"#,  // a key in both
    ])
    func aBrokenCatchupIsAProtocolViolation(_ text: String) {
        #expect(throws: ProtocolViolation.self) { try event(text) }
    }
}
