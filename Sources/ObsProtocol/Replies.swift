// ObsProtocol — the success replies of the core operations, typed: `hello`, the writes
// (`set`, `delete`, `batch`), `get`, `list`, `repos` and `subscribe`. Each writes its members
// (after `{"id":…,"ok":true`, in the order docs/PROTOCOL.md shows) and reads them back from a
// parsed reply. `stats` is in Stats.swift, the lease replies in LeaseMessages.swift, the
// `sync` reply in CatchUpMessages.swift.

import ObservableKit

/// A success reply with typed members: the daemon writes it, a client reads it back.
public protocol ReplyMessage: Sendable {
    /// Writes the members after `{"id":…,"ok":true`, each starting with a comma.
    func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S)
    /// Reads a success reply's members (`id` and `ok` may be among them: they are ignored).
    init(decoding members: JSONObject) throws(ProtocolViolation)
}

extension ReplyMessage {
    /// Writes the whole reply line, `{"id":…,"ok":true,…}\n`.
    @inlinable
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S, id: JSONValue) {
        ReplyEncoder.begin(&sink, id: id)
        writeMembers(into: &sink)
        ReplyEncoder.end(&sink)
    }
}

/// The reply to `hello`: the protocol version the daemon speaks, its name and its line limit.
public struct HelloReply: ReplyMessage, Equatable {
    /// The protocol version (`protocol`), 1.
    public var protocolVersion: Int64
    /// The daemon and its release, e.g. `obsd/0.3.0`.
    public var server: String
    /// The longest line the daemon reads, in bytes before the `\n` (`maxLine`).
    public var maxLine: Int

    public init(protocolVersion: Int64 = ObsProtocolVersion.current, server: String, maxLine: Int) {
        self.protocolVersion = protocolVersion
        self.server = server
        self.maxLine = maxLine
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw(",\"protocol\":")
        sink.writeDecimal(protocolVersion)
        sink.writeMember(",\"server\":", server)
        sink.writeRaw(",\"maxLine\":")
        sink.writeDecimal(Int64(maxLine))
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the hello reply")
        self.init(protocolVersion: try f.integer("protocol"), server: try f.string("server"), maxLine: try f.count("maxLine"))
    }
}

/// The reply to `set` or `delete`.
public struct WriteReply<Value: WireValue>: ReplyMessage, Equatable {
    /// The repository's revision after the call (`rev`).
    public var revision: UInt64
    /// Whether the call changed anything.
    public var changed: Bool
    /// The key's value before the call; nil if the key did not exist (`.null` if it held null).
    public var old: Value?

    public init(revision: UInt64, changed: Bool, old: Value? = nil) {
        self.revision = revision
        self.changed = changed
        self.old = old
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        Self.writeMembers(into: &sink, revision: revision, changed: changed, hasOld: old != nil) { old?.writeJSON(to: &$0) }
    }

    /// Writes the whole reply with `old` given as its canonical encoding (nil: the key did not
    /// exist): the bytes `encode(into:id:)` writes for the reply it makes — for the daemon's
    /// single-key writes, whose old value is never copied into a `Value`.
    @inlinable
    public static func encode<S: JSONSink & ~Copyable>(
        into sink: inout S, id: JSONValue, revision: UInt64, changed: Bool, canonicalOld old: UnsafeRawBufferPointer?
    ) {
        ReplyEncoder.begin(&sink, id: id)
        writeMembers(into: &sink, revision: revision, changed: changed, hasOld: old != nil) { sink in if let old { sink.writeBytes(old) } }
        ReplyEncoder.end(&sink)
    }

    @inlinable
    static func writeMembers<S: JSONSink & ~Copyable>(
        into sink: inout S, revision: UInt64, changed: Bool, hasOld: Bool, writeOld: (inout S) -> Void
    ) {
        sink.writeMember(",\"rev\":", revision)
        sink.writeMember(",\"changed\":", changed)
        if hasOld {
            sink.writeRaw(",\"old\":")
            writeOld(&sink)
        }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the write reply")
        self.init(revision: try f.revision(), changed: try f.bool("changed"), old: members["old"].map(Value.decoded(from:)))
    }
}

/// The reply to `batch`.
public struct BatchReply: ReplyMessage, Equatable {
    /// The repository's revision after the batch (`rev`).
    public var revision: UInt64
    /// Whether any operation changed anything.
    public var changed: Bool

    public init(revision: UInt64, changed: Bool) {
        self.revision = revision
        self.changed = changed
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"rev\":", revision)
        sink.writeMember(",\"changed\":", changed)
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the batch reply")
        self.init(revision: try f.revision(), changed: try f.bool("changed"))
    }
}

/// The reply to `get` of a key that exists (one that does not is `not_found`).
public struct GetReply<Value: WireValue>: ReplyMessage, Equatable {
    public var value: Value
    /// The revision that last changed the key (`rev`).
    public var revision: UInt64
    /// The lease the key is attached to, if any (the lease extension).
    public var lease: UInt64?

    public init(value: Value, revision: UInt64, lease: UInt64? = nil) {
        self.value = value
        self.revision = revision
        self.lease = lease
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw(",\"value\":")
        value.writeJSON(to: &sink)
        sink.writeMember(",\"rev\":", revision)
        if let lease { sink.writeMember(",\"lease\":", lease) }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the get reply")
        guard let value = members["value"] else { throw f.violation("value", "a value") }
        self.init(value: Value.decoded(from: value), revision: try f.revision(), lease: try f.optionalUnsigned("lease"))
    }
}

/// The reply to `list`: a repository's keys in byte order, and their values when asked for.
public struct ListReply<Value: WireValue>: ReplyMessage, Equatable {
    /// The repository's revision (`rev`).
    public var revision: UInt64
    /// The history `revision` belongs to.
    public var epoch: String
    /// The keys, in byte order.
    public var keys: [Key]
    /// With `values: true`, the value of each key of `keys`, in the same order.
    public var valuesInKeyOrder: [Value]?

    public init(revision: UInt64, epoch: String, keys: [Key], valuesInKeyOrder: [Value]? = nil) {
        self.revision = revision
        self.epoch = epoch
        self.keys = keys
        self.valuesInKeyOrder = valuesInKeyOrder
    }

    /// The values by key, when they were asked for — a dictionary built on each read: read it
    /// once, not per key.
    public var values: [Key: Value]? {
        valuesInKeyOrder.map { Dictionary(zip(keys, $0), uniquingKeysWith: { $1 }) }
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"rev\":", revision)
        sink.writeMember(",\"epoch\":", epoch)
        sink.writeRaw(",\"keys\":[")
        for (i, key) in keys.enumerated() {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            sink.writeJSONString(key)
        }
        sink.writeByte(UInt8(ascii: "]"))
        if let valuesInKeyOrder {
            sink.writeRaw(",\"values\":{")
            for (i, (key, value)) in zip(keys, valuesInKeyOrder).enumerated() {
                if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                sink.writeJSONString(key)
                sink.writeByte(UInt8(ascii: ":"))
                value.writeJSON(to: &sink)
            }
            sink.writeByte(UInt8(ascii: "}"))
        }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the list reply")
        var keys: [Key] = []
        for item in try f.array("keys") {
            guard let key = item.stringValue else { throw f.violation("keys", "an array of keys") }
            keys.append(Key(key))
        }
        var values: [Value]?
        if f.present("values") != nil {
            let object = try f.objectMember("values")
            values = []
            values?.reserveCapacity(keys.count)
            for key in keys {
                guard let value = object[key.string] else { throw f.violation("values", "a value for every key") }
                values?.append(Value.decoded(from: value))
            }
        }
        self.init(revision: try f.revision(), epoch: try f.string("epoch"), keys: keys, valuesInKeyOrder: values)
    }
}

/// One repository as `repos` lists it.
public struct RepositoryInfo: Sendable, Equatable {
    public var name: String
    /// Its revision (`rev`).
    public var revision: UInt64
    /// How many keys it holds.
    public var keys: Int
    /// The history `revision` belongs to.
    public var epoch: String

    public init(name: String, revision: UInt64, keys: Int, epoch: String) {
        self.name = name
        self.revision = revision
        self.keys = keys
        self.epoch = epoch
    }
}

/// The reply to `repos`: the repositories that exist, sorted by name.
public struct ReposReply: ReplyMessage, Equatable {
    public var repositories: [RepositoryInfo]

    public init(repositories: [RepositoryInfo]) {
        self.repositories = repositories
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw(",\"repos\":[")
        for (i, repository) in repositories.enumerated() {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            sink.writeMember("{\"name\":", repository.name)
            sink.writeMember(",\"rev\":", repository.revision)
            sink.writeRaw(",\"keys\":")
            sink.writeDecimal(Int64(repository.keys))
            sink.writeMember(",\"epoch\":", repository.epoch)
            sink.writeByte(UInt8(ascii: "}"))
        }
        sink.writeByte(UInt8(ascii: "]"))
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the repos reply")
        var repositories: [RepositoryInfo] = []
        for item in try f.array("repos") {
            guard let entry = item.objectValue else { throw f.violation("repos", "an array of objects") }
            let e = MessageFields(entry, "a repos entry")
            repositories.append(
                RepositoryInfo(name: try e.string("name"), revision: try e.revision(), keys: try e.count("keys"), epoch: try e.string("epoch")))
        }
        self.init(repositories: repositories)
    }
}

/// The reply to `subscribe`: the subscription's number and where it starts.
public struct SubscribeReply: ReplyMessage, Equatable {
    /// The subscription's number on its connection (`sub`).
    public var subscription: UInt64
    /// The repository's revision when the subscription began (`rev`).
    public var revision: UInt64
    /// The history `revision` belongs to.
    public var epoch: String
    /// For a subscription that asked for `catchup`: how it is brought up to `revision` before
    /// `synced` (written after `epoch`). Nil when it did not ask — or from a daemon without
    /// catch-up, which ignores the option (a plain `since` replay, or `compacted`).
    public var catchup: CatchUpMode?

    public init(subscription: UInt64, revision: UInt64, epoch: String, catchup: CatchUpMode? = nil) {
        self.subscription = subscription
        self.revision = revision
        self.epoch = epoch
        self.catchup = catchup
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"sub\":", subscription)
        sink.writeMember(",\"rev\":", revision)
        sink.writeMember(",\"epoch\":", epoch)
        if let catchup { sink.writeMember(",\"catchup\":", catchup.rawValue) }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the subscribe reply")
        let catchup: CatchUpMode?
        if f.present("catchup") != nil {
            catchup = CatchUpMode(rawValue: try f.string("catchup"))
        } else {
            catchup = nil
        }
        self.init(subscription: try f.unsigned("sub"), revision: try f.revision(), epoch: try f.string("epoch"), catchup: catchup)
    }
}

/// A reply with no members: `ping`, `unsubscribe`.
public struct EmptyReply: ReplyMessage, Equatable {
    public init() {}

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {}

    public init(decoding members: JSONObject) throws(ProtocolViolation) {}
}
