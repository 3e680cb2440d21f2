// ObsProtocol — the events, typed: `change`, `snapshot`, `synced`, `overflow`, `revoked` and
// `progress`. Each writes its whole line (built on EventEncoder's pieces, so a `change` event
// written here has the bytes the daemon's encode-once body has) and reads itself back from a
// parsed event. ServerMessage.swift decodes a line into one of them. A lease's end, the member
// a `change` event may carry, is ObsValues' `LeaseEnd` (the store keeps it too); this file reads it.

import ObservableKit

/// An event with a typed form: the daemon writes it, a client reads it back.
public protocol EventMessage: Sendable {
    /// The event's name, its `"event"` member.
    static var name: String { get }
    /// Writes the whole event line, ending with `\n`.
    func encode<S: JSONSink & ~Copyable>(into sink: inout S)
    /// Reads the event from its parsed members.
    init(decoding members: JSONObject) throws(ProtocolViolation)
}

extension LeaseEnd {
    /// Reads the `"lease"` member of a `change` event (the type is ObsValues').
    init(decoding value: JSONValue) throws(ProtocolViolation) {
        guard let o = value.objectValue else { throw ProtocolViolation("the change event's \"lease\" is not an object") }
        let f = MessageFields(o, "the change event's lease")
        let id = try f.unsigned("id")
        guard id >= 1 else { throw f.violation("id", "a lease id (1 or more)") }
        self.init(lease: id, reason: Reason(rawValue: try f.string("end")))
    }
}

/// A `change` event: one revision's changes to a subscription's keys — or, coalesced, several.
public struct ChangeEvent<Value: WireValue>: EventMessage, Equatable {
    public static var name: String { "change" }

    /// The subscription (`sub`).
    public var subscription: UInt64
    /// The repository (`repo`).
    public var repository: String
    /// The revision the changes are at (`rev`).
    public var revision: UInt64
    /// The changes: of one revision in the order they were applied; of a coalesced event, one
    /// per key whose value differs from the one last received, in byte order of the keys.
    public var changes: [Change<Value>]
    /// For a coalesced event, the first revision it covers (it covers `from...revision`).
    public var from: UInt64?
    /// Who wrote `revision`, for a subscription with `writers`.
    public var by: Writer?
    /// For the revision that deleted an ended lease's keys: which lease, and why it ended.
    public var lease: LeaseEnd?

    public init(
        subscription: UInt64, repository: String, revision: UInt64, changes: [Change<Value>], from: UInt64? = nil,
        by: Writer? = nil, lease: LeaseEnd? = nil
    ) {
        self.subscription = subscription
        self.repository = repository
        self.revision = revision
        self.changes = changes
        self.from = from
        self.by = by
        self.lease = lease
    }

    /// Whether this event coalesces several revisions.
    public var isCoalesced: Bool { from != nil }

    /// The change of `key` in this event, if any.
    public func change(for key: Key) -> Change<Value>? {
        changes.first { $0.key == key }
    }

    /// The changes as an ObservableKit change set (`from` kept, `by` and `lease` dropped).
    public var changeSet: ChangeSet<Value> { ChangeSet(revision: revision, changes: changes, from: from) }

    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        EventEncoder.writeChangeHead(&sink, sub: subscription)
        if let by { EventEncoder.writeBy(&sink, by) }
        EventEncoder.writeChangeBody(&sink, repo: repository, rev: revision, from: from, count: changes.count, lease: lease) { sink, i in
            EventEncoder.writeChange(&sink, changes[i]) { sink, value in value.writeJSON(to: &sink) }
        }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the change event")
        let revision = try f.revision()
        var changes: [Change<Value>] = []
        let items = try f.array("changes")
        changes.reserveCapacity(items.count)
        for item in items {
            guard let c = item.objectValue, let key = c["key"]?.stringValue else {
                throw ProtocolViolation("the change event has a change without a key: \(item.jsonText.prefix(60))")
            }
            changes.append(Change(key: Key(key), old: c["old"].map(Value.decoded(from:)), new: c["new"].map(Value.decoded(from:))))
        }
        var from: UInt64?
        if let value = members["from"] {
            guard let f = value.uint64Value, f >= 1, f <= revision else {
                throw ProtocolViolation("change event with a \"from\" that is not a revision from 1 to \"rev\"")
            }
            from = f
        }
        self.init(
            subscription: try f.unsigned("sub"), repository: try f.string("repo"), revision: revision, changes: changes, from: from,
            by: try members["by"].map { value throws(ProtocolViolation) in try Writer(decoding: value) },
            lease: try f.present("lease").map { value throws(ProtocolViolation) in try LeaseEnd(decoding: value) })
    }
}

/// A `snapshot` event: the selected keys' values at `revision`, first, for `initial: true`.
public struct SnapshotEvent<Value: WireValue>: EventMessage, Equatable {
    public static var name: String { "snapshot" }

    public var subscription: UInt64
    public var repository: String
    public var revision: UInt64
    /// The keys that exist and their values, in byte order of the keys.
    public var entries: [(key: Key, value: Value)]

    public init(subscription: UInt64, repository: String, revision: UInt64, entries: [(key: Key, value: Value)]) {
        self.subscription = subscription
        self.repository = repository
        self.revision = revision
        self.entries = entries
    }

    /// The values by key.
    public var values: [Key: Value] { Dictionary(entries.lazy.map { ($0.key, $0.value) }, uniquingKeysWith: { $1 }) }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.subscription == rhs.subscription && lhs.repository == rhs.repository && lhs.revision == rhs.revision
            && lhs.entries.elementsEqual(rhs.entries) { $0.key == $1.key && $0.value == $1.value }
    }

    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        encodeHead(into: &sink)
        for (i, entry) in entries.enumerated() { Self.encodeMember(entry.key, entry.value, first: i == 0, into: &sink) }
        Self.encodeTail(into: &sink)
    }

    /// The event up to its first value — with `encodeMember` per entry and `encodeTail`, the
    /// same bytes as `encode`, for a sender that encodes a large snapshot a piece at a time.
    @inlinable
    public func encodeHead<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember("{\"event\":\"snapshot\",\"sub\":", subscription)
        sink.writeMember(",\"repo\":", repository)
        sink.writeMember(",\"rev\":", revision)
        sink.writeRaw(",\"values\":{")
    }

    /// One entry of `values` (`"key":value`, after a comma unless it is the first).
    @inlinable
    public static func encodeMember<S: JSONSink & ~Copyable>(_ key: Key, _ value: Value, first: Bool, into sink: inout S) {
        if !first { sink.writeByte(UInt8(ascii: ",")) }
        sink.writeJSONString(key)
        sink.writeByte(UInt8(ascii: ":"))
        value.writeJSON(to: &sink)
    }

    /// The end of the event, after its last value.
    @inlinable
    public static func encodeTail<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw("}}\n")
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the snapshot event")
        let values = try f.objectMember("values")
        self.init(
            subscription: try f.unsigned("sub"), repository: try f.string("repo"), revision: try f.revision(),
            entries: values.members.map { (Key($0.name), Value.decoded(from: $0.value)) })
    }
}

/// An event that says only where a subscription stands — `synced` and `progress`:
/// `{"event":…,"sub":…,"repo":…,"rev":…}`.
public protocol SubscriptionPositionEvent: EventMessage, Equatable {
    var subscription: UInt64 { get }
    var repository: String { get }
    var revision: UInt64 { get }
    init(subscription: UInt64, repository: String, revision: UInt64)
}

extension SubscriptionPositionEvent {
    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        EventEncoder.writePosition(&sink, event: Self.name, sub: subscription, repo: repository, rev: revision)
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the \(Self.name) event")
        self.init(subscription: try f.unsigned("sub"), repository: try f.string("repo"), revision: try f.revision())
    }
}

/// A `synced` event: the `since` replay is complete up to `revision`; what follows is live.
public struct SyncedEvent: SubscriptionPositionEvent {
    public static var name: String { "synced" }

    public var subscription: UInt64
    public var repository: String
    public var revision: UInt64

    public init(subscription: UInt64, repository: String, revision: UInt64) {
        self.subscription = subscription
        self.repository = repository
        self.revision = revision
    }
}

/// A `progress` event (`progress: true`): every change the subscription selects up to
/// `revision` was delivered, so `since: revision` resumes it with nothing missed.
public struct ProgressEvent: SubscriptionPositionEvent {
    public static var name: String { "progress" }

    public var subscription: UInt64
    public var repository: String
    public var revision: UInt64

    public init(subscription: UInt64, repository: String, revision: UInt64) {
        self.subscription = subscription
        self.repository = repository
        self.revision = revision
    }
}

/// An `overflow` event: the daemon is closing the connection because it read too slowly.
public struct OverflowEvent: EventMessage, Equatable {
    public static var name: String { "overflow" }

    /// For each subscription, a revision it is complete up to: resubscribe with `since` it.
    public var revisions: [UInt64: UInt64]

    public init(revisions: [UInt64: UInt64]) {
        self.revisions = revisions
    }

    /// Writes the event, subscriptions in increasing order.
    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        EventEncoder.writeOverflow(&sink, revs: revisions.sorted { $0.key < $1.key }.lazy.map { (sub: $0.key, rev: $0.value) })
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the overflow event")
        var revisions: [UInt64: UInt64] = [:]
        for m in try f.objectMember("revs").members {
            guard let sub = UInt64(m.name), let rev = m.value.uint64Value else {
                throw ProtocolViolation("the overflow event has an invalid revs entry: \(JSONValue.string(m.name).jsonText)")
            }
            revisions[sub] = rev
        }
        self.init(revisions: revisions)
    }
}

/// A `revoked` event (an obsd extension): the subscription ended because the peer may no
/// longer read its repository. Nothing of it follows.
public struct RevokedEvent: EventMessage, Equatable {
    public static var name: String { "revoked" }

    public var subscription: UInt64
    public var repository: String
    /// Why, as an error reply would say it (`forbidden`).
    public var error: ProtocolError

    public init(subscription: UInt64, repository: String, error: ProtocolError) {
        self.subscription = subscription
        self.repository = repository
        self.error = error
    }

    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember("{\"event\":\"revoked\",\"sub\":", subscription)
        sink.writeMember(",\"repo\":", repository)
        sink.writeRaw(",\"error\":{\"code\":")
        sink.writeJSONString(error.code.rawValue)
        sink.writeMember(",\"message\":", error.message)
        sink.writeRaw("}}\n")
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the revoked event")
        let error = members["error"]?.objectValue
        self.init(
            subscription: try f.unsigned("sub"), repository: try f.string("repo"),
            error: ProtocolError(
                decodingCode: error?["code"]?.stringValue ?? ErrorCode.forbidden.rawValue,
                message: error?["message"]?.stringValue ?? "the subscription was revoked"))
    }
}
