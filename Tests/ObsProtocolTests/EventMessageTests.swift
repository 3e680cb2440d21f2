// Tests of the typed events: each one encoded and read back through ServerMessage as a client
// reads it; lines a real obsd wrote (a plain change, one with `by`, a forced write, a
// snapshot, `synced`), decoded and written again byte for byte from canonical values; the
// lease extension's `lease` member and the `progress` event; and events that break the
// contract refused.

import ObsProtocol
import ObservableKit
import Testing

func eventLine<E: EventMessage>(_ event: E) -> String {
    var out: [UInt8] = []
    event.encode(into: &out)
    return String(decoding: out, as: UTF8.self)
}

func event(_ text: String) throws -> ServerEvent {
    let message = try Array(text.utf8).withUnsafeBytes { raw in try ServerMessage.decode(line: raw) }
    guard case .event(let event) = message else { throw ProtocolViolation("not an event: \(text)") }
    return event
}

/// Decodes a daemon's event line into `E` over canonical values and writes it back.
func expectDaemonEvent<E: EventMessage & Equatable>(_ text: String, _ expected: E, sourceLocation: SourceLocation = #_sourceLocation) throws {
    guard case .object(let object) = try JSONParser.parse(text) else { throw ProtocolViolation("not an object") }
    #expect(object["event"]?.stringValue == E.name, sourceLocation: sourceLocation)
    let decoded = try E(decoding: object)
    #expect(decoded == expected, sourceLocation: sourceLocation)
    #expect(eventLine(decoded) == text + "\n", "re-encoded as the daemon wrote it", sourceLocation: sourceLocation)
}

@Suite struct EventMessageTests {
    let changes: [Change<JSONValue>] = [
        Change(key: "theme", old: "light", new: "dark"), Change(key: "draft", old: "x", new: nil), Change(key: "lang", old: nil, new: .null),
    ]

    @Test func everyEventRoundTrips() throws {
        let writer = Writer(uid: 1000, gid: 100, pid: 4242)
        let change = ChangeEvent(subscription: 3, repository: "ui", revision: 43, changes: changes)
        let variants = [
            change,
            ChangeEvent(subscription: 3, repository: "ui", revision: 43, changes: changes, from: 40, by: writer),
            ChangeEvent(subscription: 1, repository: "svc", revision: 13, changes: [Change(key: "web/ready", old: true, new: nil)],
                by: writer, lease: LeaseEnd(lease: 7, reason: .closed)),
            ChangeEvent(subscription: 1, repository: "svc", revision: 13, changes: [], lease: LeaseEnd(lease: 7, reason: .init(rawValue: "new"))),
        ]
        for variant in variants {
            #expect(try event(eventLine(variant)) == .change(variant))
        }
        let snapshot = SnapshotEvent<JSONValue>(subscription: 3, repository: "ui", revision: 42, entries: [("a", 1), ("b", ["x": nil])])
        #expect(try event(eventLine(snapshot)) == .snapshot(snapshot))
        #expect(snapshot.values == ["a": 1, "b": ["x": nil]])
        let synced = SyncedEvent(subscription: 3, repository: "ui", revision: 57)
        #expect(try event(eventLine(synced)) == .synced(synced))
        let progress = ProgressEvent(subscription: 3, repository: "ui", revision: 88)
        #expect(try event(eventLine(progress)) == .progress(progress))
        #expect(eventLine(progress) == #"{"event":"progress","sub":3,"repo":"ui","rev":88}"# + "\n")
        let overflow = OverflowEvent(revisions: [4: 17, 3: 43])
        #expect(try event(eventLine(overflow)) == .overflow(overflow))
        #expect(eventLine(overflow) == #"{"event":"overflow","revs":{"3":43,"4":17}}"# + "\n")
        let revoked = RevokedEvent(subscription: 2, repository: "ui", error: ProtocolError(.forbidden, "uid 1000 may no longer read ui"))
        #expect(try event(eventLine(revoked)) == .revoked(revoked))
    }

    @Test func theLeaseMemberComesAfterTheChanges() {
        let event = ChangeEvent<JSONValue>(
            subscription: 1, repository: "svc", revision: 13, changes: [Change(key: "web/ready", old: true, new: nil)],
            lease: LeaseEnd(lease: 7, reason: .closed))
        #expect(
            eventLine(event)
                == #"{"event":"change","sub":1,"repo":"svc","rev":13,"changes":[{"key":"web/ready","old":true}],"lease":{"id":7,"end":"closed"}}"#
                + "\n")
    }

    @Test func eventsAsARealDaemonWroteThem() throws {
        let value = CanonicalJSON([1, ["x": nil]] as JSONValue)
        try expectDaemonEvent(
            #"{"event":"change","sub":2,"repo":"cap","rev":1,"changes":[{"key":"k","new":[1,{"x":null}]}]}"#,
            ChangeEvent(subscription: 2, repository: "cap", revision: 1, changes: [Change(key: "k", old: nil, new: value)]))
        try expectDaemonEvent(
            #"{"event":"change","sub":1,"by":{"uid":0,"gid":0,"pid":14829},"repo":"cap","rev":2,"changes":[{"key":"k","old":[1,{"x":null}],"new":[1,{"x":null}]}]}"#,
            ChangeEvent(
                subscription: 1, repository: "cap", revision: 2, changes: [Change(key: "k", old: value, new: value)],
                by: Writer(uid: 0, gid: 0, pid: 14829)))
        try expectDaemonEvent(
            #"{"event":"change","sub":2,"repo":"ui","rev":3,"changes":[{"key":"lang","new":"fr"},{"key":"theme","old":"dark"}]}"#,
            ChangeEvent<CanonicalJSON>(
                subscription: 2, repository: "ui", revision: 3, changes: [Change(key: "lang", old: nil, new: "fr"), Change(key: "theme", old: "dark", new: nil)]))
        try expectDaemonEvent(
            #"{"event":"change","sub":1,"by":{"uid":1000,"gid":1000,"pid":4242},"repo":"ui","rev":9000,"from":42,"changes":[{"key":"a","new":1}]}"#,
            ChangeEvent<CanonicalJSON>(
                subscription: 1, repository: "ui", revision: 9000, changes: [Change(key: "a", old: nil, new: 1)], from: 42,
                by: Writer(uid: 1000, gid: 1000, pid: 4242)))
        try expectDaemonEvent(
            #"{"event":"snapshot","sub":1,"repo":"ui","rev":0,"values":{}}"#,
            SnapshotEvent<CanonicalJSON>(subscription: 1, repository: "ui", revision: 0, entries: []))
        try expectDaemonEvent(#"{"event":"synced","sub":2,"repo":"ui","rev":3}"#, SyncedEvent(subscription: 2, repository: "ui", revision: 3))
        try expectDaemonEvent(#"{"event":"overflow","revs":{"3":43,"4":17}}"#, OverflowEvent(revisions: [3: 43, 4: 17]))
        try expectDaemonEvent(
            #"{"event":"revoked","sub":4,"repo":"secret","error":{"code":"forbidden","message":"uid 1000 may no longer read repository secret"}}"#,
            RevokedEvent(subscription: 4, repository: "secret", error: ProtocolError(.forbidden, "uid 1000 may no longer read repository secret")))
    }

    @Test func anEventThisVersionDoesNotKnowIsKeptByName() throws {
        #expect(try event(#"{"event":"from-the-future","sub":1}"#) == .unknown(name: "from-the-future"))
        #expect(try event(#"{"event":"progress","sub":5,"repo":"ui","rev":9}"#).subscription == 5)
    }

    @Test(arguments: [
        #"{"event":"change","sub":1,"repo":"ui","changes":[]}"#,  // no rev
        #"{"event":"change","sub":1,"repo":"ui","rev":2,"changes":[{"old":1}]}"#,  // a change without a key
        #"{"event":"change","sub":1,"repo":"ui","rev":2,"changes":[],"lease":{"id":0,"end":"closed"}}"#,
        #"{"event":"change","sub":1,"repo":"ui","rev":2,"changes":[],"lease":{"id":7}}"#,
        #"{"event":"change","sub":1,"repo":"ui","rev":2,"changes":[],"lease":7}"#,
        #"{"event":"snapshot","sub":1,"repo":"ui","rev":2,"values":[]}"#,
        #"{"event":"synced","sub":1,"rev":2}"#,  // no repo
        #"{"event":"progress","sub":1,"repo":"ui","rev":-2}"#,
        #"{"event":"overflow","revs":{"x":1}}"#,
        #"{"event":"overflow"}"#,
        #"{"event":7}"#,
    ])
    func aBrokenEventIsAProtocolViolation(text: String) {
        #expect(throws: ProtocolViolation.self) { try event(text) }
    }
}
