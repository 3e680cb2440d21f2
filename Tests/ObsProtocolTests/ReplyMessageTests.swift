// Tests of the typed replies: each one encoded, read back through ServerMessage as a client
// reads it, and equal; lines a real obsd wrote, decoded into the expected values and written
// again byte for byte (from `CanonicalJSON`, as the daemon holds values); and replies that
// break the contract refused with a ProtocolViolation naming the field.

import ObsProtocol
import ObservableKit
import Testing

/// The line `reply` encodes to, with id 7.
func line<R: ReplyMessage>(_ reply: R, id: JSONValue = 7) -> String {
    var out: [UInt8] = []
    reply.encode(into: &out, id: id)
    return String(decoding: out, as: UTF8.self)
}

/// A daemon's line read as a client reads it: a reply, its members as `R`.
func reply<R: ReplyMessage>(_ text: String, as type: R.Type = R.self) throws -> (id: JSONValue, reply: R) {
    let message = try Array(text.utf8).withUnsafeBytes { raw in try ServerMessage.decode(line: raw) }
    guard case .reply(let reply) = message else { throw ProtocolViolation("not a reply: \(text)") }
    return (reply.id, try reply.decode(as: R.self))
}

/// Encodes `value`, decodes the line, and checks it comes back equal with its id.
func expectRoundTrip<R: ReplyMessage & Equatable>(_ value: R, sourceLocation: SourceLocation = #_sourceLocation) throws {
    let text = line(value, id: "r")
    #expect(text.hasSuffix("}\n") && text.hasPrefix(#"{"id":"r","ok":true"#), sourceLocation: sourceLocation)
    let decoded = try reply(String(text.dropLast()), as: R.self)
    #expect(decoded.id == "r", sourceLocation: sourceLocation)
    #expect(decoded.reply == value, sourceLocation: sourceLocation)
}

/// Decodes a daemon's line as `R` over canonical values and writes it back: the same bytes.
func expectDaemonLine<R: ReplyMessage & Equatable>(
    _ text: String, _ expected: R, sourceLocation: SourceLocation = #_sourceLocation
) throws {
    let decoded = try reply(text, as: R.self)
    #expect(decoded.reply == expected, sourceLocation: sourceLocation)
    #expect(line(decoded.reply, id: decoded.id) == text + "\n", "re-encoded as the daemon wrote it", sourceLocation: sourceLocation)
}

@Suite struct ReplyMessageTests {
    @Test func everyReplyRoundTrips() throws {
        try expectRoundTrip(HelloReply(server: "obsd/9.9.9", maxLine: 1 << 20))
        try expectRoundTrip(WriteReply<JSONValue>(revision: 3, changed: true, old: ["a": [1, 2.5, nil]]))
        try expectRoundTrip(WriteReply<JSONValue>(revision: 3, changed: false, old: .null))
        try expectRoundTrip(WriteReply<JSONValue>(revision: 0, changed: false))
        try expectRoundTrip(WriteReply<CanonicalJSON>(revision: UInt64(Int64.max), changed: true, old: "x"))
        try expectRoundTrip(BatchReply(revision: 9, changed: false))
        try expectRoundTrip(GetReply<JSONValue>(value: "dark", revision: 2))
        try expectRoundTrip(GetReply<JSONValue>(value: .null, revision: 2, lease: 7))
        try expectRoundTrip(ListReply<JSONValue>(revision: 4, epoch: "e", keys: ["a", "é", "z"]))
        try expectRoundTrip(ListReply<JSONValue>(revision: 4, epoch: "e", keys: ["a", "b"], valuesInKeyOrder: [1, ["x": true]]))
        try expectRoundTrip(ListReply<JSONValue>(revision: 0, epoch: "e", keys: [], valuesInKeyOrder: []))
        try expectRoundTrip(
            ReposReply(repositories: [
                RepositoryInfo(name: "a", revision: 1, keys: 0, epoch: "e1"), RepositoryInfo(name: "b", revision: 9, keys: 3, epoch: "e2"),
            ]))
        try expectRoundTrip(ReposReply(repositories: []))
        try expectRoundTrip(SubscribeReply(subscription: 3, revision: 42, epoch: "e"))
        try expectRoundTrip(EmptyReply())
        try expectRoundTrip(GrantReply(lease: 7))
        try expectRoundTrip(GrantReply(lease: 7, ttl: 30))
        try expectRoundTrip(KeepaliveReply())
        try expectRoundTrip(KeepaliveReply(ttl: LeaseCommand.maxTTL))
        try expectRoundTrip(RevokeReply())
        try expectRoundTrip(RevokeReply(revisions: ["svc": 13, "ui": 4]))
    }

    /// A single-key write's reply, written from the old value's canonical bytes, is byte for
    /// byte the typed reply's.
    @Test func aWriteReplyFromCanonicalBytesIsTheTypedReply() {
        let olds: [CanonicalJSON?] = [nil, CanonicalJSON(.null), CanonicalJSON(["b": [1, 2.5], "a": "x\"y"]), CanonicalJSON(.int(-7))]
        for old in olds {
            for id: JSONValue in [.null, .int(9), .string("w")] {
                var typed: [UInt8] = []
                WriteReply<CanonicalJSON>(revision: 42, changed: old != nil, old: old).encode(into: &typed, id: id)
                var raw: [UInt8] = []
                (old?.bytes ?? []).withUnsafeBytes { bytes in
                    WriteReply<CanonicalJSON>.encode(into: &raw, id: id, revision: 42, changed: old != nil, canonicalOld: old == nil ? nil : bytes)
                }
                #expect(raw == typed, "\(String(decoding: raw, as: UTF8.self))")
            }
        }
    }

    @Test func theStatsReplyRoundTripsWithEveryFieldAndUnknownCounters() throws {
        var stats = Stats(
            connections: 2, subscriptions: 3, repositories: 1, peer: .init(uid: 1000, gid: 100, pid: -1, privileged: true),
            server: "obsd/0.3.0", otherCounters: [.init(name: "newCounter", value: 5), .init(name: "ratio", value: 0.5)])
        stats.connectionsTotal = 10
        stats.pid = 4242
        stats.reloadError = "line 3: bad"
        stats.storage = "disk"
        stats.storageFsyncs = 8
        stats.clients = [.init(uid: 1, gid: 2, pid: 3, subscriptions: 4, connectedSeconds: 5)]
        try expectRoundTrip(stats)
        try expectRoundTrip(Stats(connections: 1, subscriptions: 0, repositories: 0))
    }

    @Test func repliesAsARealDaemonWroteThem() throws {
        try expectDaemonLine(
            #"{"id":1,"ok":true,"protocol":1,"server":"obsd/0.3.0","maxLine":1048576}"#,
            HelloReply(protocolVersion: 1, server: "obsd/0.3.0", maxLine: 1_048_576))
        try expectDaemonLine(
            #"{"id":2,"ok":true,"sub":1,"rev":0,"epoch":"63cc4ef89af00531cd0607685a73bea2"}"#,
            SubscribeReply(subscription: 1, revision: 0, epoch: "63cc4ef89af00531cd0607685a73bea2"))
        try expectDaemonLine(#"{"id":3,"ok":true,"rev":1,"changed":true}"#, WriteReply<CanonicalJSON>(revision: 1, changed: true))
        try expectDaemonLine(
            #"{"id":4,"ok":true,"rev":2,"changed":true,"old":{"b":[1,2.5],"a":"x"}}"#,
            WriteReply<CanonicalJSON>(revision: 2, changed: true, old: CanonicalJSON(["b": [1, 2.5], "a": "x"] as JSONValue)))
        try expectDaemonLine(#"{"id":5,"ok":true,"value":"dark","rev":2}"#, GetReply<CanonicalJSON>(value: "dark", revision: 2))
        try expectDaemonLine(#"{"id":6,"ok":true,"rev":3,"changed":true}"#, BatchReply(revision: 3, changed: true))
        try expectDaemonLine(
            #"{"id":7,"ok":true,"rev":3,"epoch":"63cc4ef89af00531cd0607685a73bea2","keys":["lang"],"values":{"lang":"fr"}}"#,
            ListReply<CanonicalJSON>(revision: 3, epoch: "63cc4ef89af00531cd0607685a73bea2", keys: ["lang"], valuesInKeyOrder: ["fr"]))
        try expectDaemonLine(
            #"{"id":8,"ok":true,"repos":[{"name":"ui","rev":3,"keys":1,"epoch":"63cc4ef89af00531cd0607685a73bea2"}]}"#,
            ReposReply(repositories: [RepositoryInfo(name: "ui", revision: 3, keys: 1, epoch: "63cc4ef89af00531cd0607685a73bea2")]))
        try expectDaemonLine(#"{"id":11,"ok":true,"rev":3,"changed":false}"#, WriteReply<CanonicalJSON>(revision: 3, changed: false))
        try expectDaemonLine(#"{"id":13,"ok":true}"#, EmptyReply())
    }

    @Test func statsAsARealDaemonWroteThem() throws {
        let privileged =
            #"{"id":10,"ok":true,"connections":1,"subscriptions":2,"repos":1,"peer":{"uid":0,"gid":0,"pid":14752,"privileged":true},"#
            + #""server":"obsd/0.3.0","connectionsTotal":1,"connectionsRefused":0,"requests":10,"writes":3,"eventsOut":0,"bytesOut":0,"#
            + #""overflows":0,"writersHeld":0,"repositoriesHeld":1,"errors":0,"denied":0,"uptimeSeconds":1,"pid":14739,"reloads":0,"#
            + #""reloadFailures":0,"storage":"memory (nothing persists)","clients":[{"uid":0,"gid":0,"pid":14752,"subscriptions":2,"#
            + #""connectedSeconds":0}]}"#
        let stats = try reply(privileged, as: Stats.self).reply
        #expect(stats.connections == 1 && stats.subscriptions == 2 && stats.repositories == 1)
        #expect(stats.peer == Stats.Peer(uid: 0, gid: 0, pid: 14752, privileged: true))
        #expect(stats.requests == 10 && stats.writes == 3 && stats.pid == 14739 && stats.uptimeSeconds == 1)
        #expect(stats.storage == "memory (nothing persists)" && stats.reloadError == nil && stats.storageCommits == nil)
        #expect(stats.clients == [Stats.Client(uid: 0, gid: 0, pid: 14752, subscriptions: 2, connectedSeconds: 0)])
        #expect(stats.otherCounters.isEmpty)
        #expect(line(stats, id: 10) == privileged + "\n", "written in the daemon's order")

        let unprivileged =
            #"{"id":1,"ok":true,"connections":2,"subscriptions":0,"repos":3,"peer":{"uid":1000,"gid":1000,"pid":7,"privileged":false},"#
            + #""server":"obsd/0.3.0","futureGauge":12,"futureRatio":0.25,"futureText":"left out"}"#
        let limited = try reply(unprivileged, as: Stats.self).reply
        #expect(limited.requests == nil && limited.clients == nil && limited.peer?.privileged == false)
        #expect(limited.otherCounters == [.init(name: "futureGauge", value: 12), .init(name: "futureRatio", value: 0.25)])
    }

    @Test(arguments: [
        (#"{"ok":true,"protocol":"1","server":"s","maxLine":1}"#, "protocol"),
        (#"{"ok":true,"protocol":1,"maxLine":1}"#, "server"),
        (#"{"ok":true,"protocol":1,"server":"s","maxLine":-1}"#, "maxLine"),
    ])
    func aBrokenHelloReplyNamesTheField(text: String, field: String) {
        let error = #expect(throws: ProtocolViolation.self) { try reply(text, as: HelloReply.self) }
        #expect(error?.description.contains("\"\(field)\"") == true, "\(error?.description ?? "")")
    }

    @Test func brokenRepliesAreProtocolViolations() {
        let broken: [(String, any ReplyMessage.Type)] = [
            (#"{"ok":true,"changed":true}"#, WriteReply<JSONValue>.self),  // no rev
            (#"{"ok":true,"rev":-1,"changed":true}"#, WriteReply<JSONValue>.self),
            (#"{"ok":true,"rev":1,"changed":"yes"}"#, BatchReply.self),
            (#"{"ok":true,"rev":1}"#, GetReply<JSONValue>.self),  // no value
            (#"{"ok":true,"value":1,"rev":1,"lease":"7"}"#, GetReply<JSONValue>.self),
            (#"{"ok":true,"rev":1,"epoch":"e","keys":[1]}"#, ListReply<JSONValue>.self),
            (#"{"ok":true,"rev":1,"epoch":"e","keys":["a"],"values":{}}"#, ListReply<JSONValue>.self),  // a key without its value
            (#"{"ok":true,"rev":1,"keys":[]}"#, ListReply<JSONValue>.self),  // no epoch
            (#"{"ok":true,"repos":[{"name":"a","rev":1,"keys":1}]}"#, ReposReply.self),
            (#"{"ok":true,"sub":1,"rev":0}"#, SubscribeReply.self),
            (#"{"ok":true,"connections":1,"subscriptions":0}"#, Stats.self),
            (#"{"ok":true,"connections":1,"subscriptions":0,"repos":0,"peer":{"uid":1,"gid":1,"pid":1}}"#, Stats.self),
            (#"{"ok":true,"lease":0}"#, GrantReply.self),
            (#"{"ok":true,"lease":1,"ttl":0}"#, GrantReply.self),
            (#"{"ok":true,"ttl":31536001}"#, KeepaliveReply.self),
            (#"{"ok":true,"revs":{"ui":"3"}}"#, RevokeReply.self),
        ]
        for (text, type) in broken {
            #expect(throws: ProtocolViolation.self, "\(text) as \(type)") { try reply(text, as: type) }
        }
    }

    @Test func anErrorReplyIsTheDaemonsErrorNotAMessage() throws {
        #expect(throws: ProtocolError(.notFound, "key \"nope\" does not exist in repository ui")) {
            try reply(
                #"{"id":14,"ok":false,"error":{"code":"not_found","message":"key \"nope\" does not exist in repository ui"}}"#,
                as: GetReply<JSONValue>.self)
        }
        #expect(throws: ProtocolError(ErrorCode(rawValue: "from_the_future"), "m"), "a code this version does not know is kept") {
            try reply(#"{"id":1,"ok":false,"error":{"code":"from_the_future","message":"m"}}"#, as: EmptyReply.self)
        }
    }
}
