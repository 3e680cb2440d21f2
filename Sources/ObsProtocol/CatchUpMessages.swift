// ObsProtocol — the messages of a resume that never fails and of a copy known to be fresh
// (the contract's "Catching up" and "Sync" sections), typed: how a `subscribe` with
// `catchup: true` is brought up to its reply's revision (`CatchUpMode`, the reply's
// `catchup`), the `catchup` event that carries a diff, and the reply to `sync`. The
// `catchup` request option is `SubscribeRequest.catchup`, the `sync` request
// `Command.sync(sub:)` (Request.swift). Each message writes its whole line — the catch-up
// also in pieces, for a sender that streams a large one — and reads itself back.

import ObservableKit

/// How a subscription that asked for `catchup: true` is brought up to its reply's revision
/// before `synced` (the subscribe reply's `catchup`). Extensible: a value this version does
/// not know reads as itself.
public struct CatchUpMode: RawRepresentable, Sendable, Hashable, CustomStringConvertible {
    public var rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }

    /// The history holds every revision after `since`: the replayed `change` events, as a
    /// plain `since` sends them.
    public static let replay = CatchUpMode(rawValue: "replay")
    /// Same history, but it no longer reaches back: one `catchup` event (``CatchUpEvent``)
    /// with the keys that changed since, as they are now.
    public static let diff = CatchUpMode(rawValue: "diff")
    /// Another history, or the deletions since are no longer known: one `snapshot` event
    /// with the complete selected state, which replaces everything held for the selection.
    public static let snapshot = CatchUpMode(rawValue: "snapshot")

    public var description: String { rawValue }
}

/// A `catchup` event: a subscription that resumed from `from` past the daemon's history,
/// brought up to `revision` in one step. Setting every member of `values` and removing every
/// key of `deleted` turns the selected state at `from` (of this history) into the selected
/// state at `revision`. A key that did not change after `from` is in neither.
///
/// `{"event":"catchup","sub":3,"repo":"ui","from":40,"rev":97,"values":{"lang":"fr"},"deleted":["draft"]}`
public struct CatchUpEvent<Value: WireValue>: EventMessage, Equatable {
    public static var name: String { "catchup" }

    /// The subscription (`sub`).
    public var subscription: UInt64
    /// The repository (`repo`).
    public var repository: String
    /// The revision the subscription resumed after (`from`: the request's `since`).
    public var from: UInt64
    /// The revision the values are at (`rev`: the subscribe reply's).
    public var revision: UInt64
    /// Every selected key that exists at `revision` and was last changed after `from`, with
    /// its value at `revision` — possibly equal to the one it had at `from` — in the order the
    /// daemon listed them.
    public var entries: [(key: Key, value: Value)]
    /// The selected keys that existed at `from` and do not at `revision`, in byte order; it
    /// may also list keys created and deleted again after `from`.
    public var deleted: [Key]

    public init(subscription: UInt64, repository: String, from: UInt64, revision: UInt64, entries: [(key: Key, value: Value)], deleted: [Key]) {
        self.subscription = subscription
        self.repository = repository
        self.from = from
        self.revision = revision
        self.entries = entries
        self.deleted = deleted
    }

    /// The values by key.
    public var values: [Key: Value] { Dictionary(entries.lazy.map { ($0.key, $0.value) }, uniquingKeysWith: { $1 }) }

    /// Whether the event changes nothing: no key changed after `from`.
    public var isEmpty: Bool { entries.isEmpty && deleted.isEmpty }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.subscription == rhs.subscription && lhs.repository == rhs.repository && lhs.from == rhs.from && lhs.revision == rhs.revision
            && lhs.entries.elementsEqual(rhs.entries) { $0.key == $1.key && $0.value == $1.value } && lhs.deleted == rhs.deleted
    }

    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        encodeHead(into: &sink)
        for (i, entry) in entries.enumerated() { SnapshotEvent<Value>.encodeMember(entry.key, entry.value, first: i == 0, into: &sink) }
        Self.encodeDeletedHead(into: &sink)
        for (i, key) in deleted.enumerated() { Self.encodeDeleted(key, first: i == 0, into: &sink) }
        Self.encodeTail(into: &sink)
    }

    /// The event up to its first value: `{"event":"catchup","sub":…,"repo":…,"from":…,"rev":…,"values":{`.
    /// Then, for a sender that encodes a large catch-up a piece at a time, the same bytes as
    /// `encode`: `SnapshotEvent.encodeMember` per value, `encodeDeletedHead`, `encodeDeleted`
    /// per deleted key, `encodeTail`.
    @inlinable
    public func encodeHead<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember("{\"event\":\"catchup\",\"sub\":", subscription)
        sink.writeMember(",\"repo\":", repository)
        sink.writeMember(",\"from\":", from)
        sink.writeMember(",\"rev\":", revision)
        sink.writeRaw(",\"values\":{")
    }

    /// Between the last value and the first deleted key: `},"deleted":[`.
    @inlinable
    public static func encodeDeletedHead<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw("},\"deleted\":[")
    }

    /// One key of `deleted` (after a comma unless it is the first).
    @inlinable
    public static func encodeDeleted<S: JSONSink & ~Copyable>(_ key: Key, first: Bool, into sink: inout S) {
        if !first { sink.writeByte(UInt8(ascii: ",")) }
        sink.writeJSONString(key)
    }

    /// The end of the event, after its last deleted key.
    @inlinable
    public static func encodeTail<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw("]}\n")
    }

    /// Reads the event. `values` and `deleted` may be left out (nothing of that kind); a key
    /// in both, `from` above `rev`, or a deleted entry that is not a string is a violation.
    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the catchup event")
        let revision = try f.revision()
        let from = try f.unsigned("from")
        guard from <= revision else { throw f.violation("from", "a revision up to \"rev\" (\(revision))") }
        let values = f.present("values") == nil ? JSONObject() : try f.objectMember("values")
        var deleted: [Key] = []
        if f.present("deleted") != nil {
            let items = try f.array("deleted")
            deleted.reserveCapacity(items.count)
            for item in items {
                guard let key = item.stringValue else { throw f.violation("deleted", "an array of keys") }
                deleted.append(Key(key))
            }
        }
        if !deleted.isEmpty, !values.isEmpty {
            let listed = Swift.Set(deleted)
            if let both = values.members.first(where: { listed.contains(Key($0.name)) }) {
                throw ProtocolViolation("the catchup event lists key \(JSONValue.string(both.name).jsonText) both in \"values\" and in \"deleted\"")
            }
        }
        self.init(
            subscription: try f.unsigned("sub"), repository: try f.string("repo"), from: from, revision: revision,
            entries: values.members.map { (Key($0.name), Value.decoded(from: $0.value)) }, deleted: deleted)
    }
}

/// The reply to `sync`: the repository's revision when the daemon read the request. Every
/// event of the subscription up to it was sent before the reply.
public struct SyncReply: ReplyMessage, Equatable {
    /// The revision (`rev`): at least that of every write acknowledged before the `sync` was read.
    public var revision: UInt64

    public init(revision: UInt64) {
        self.revision = revision
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"rev\":", revision)
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        self.init(revision: try MessageFields(members, "the sync reply").revision())
    }
}
