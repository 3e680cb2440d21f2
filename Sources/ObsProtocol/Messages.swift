// ObsProtocol — replies and events: encoding (daemon side) and decoding (client side).
//
// Encoders write straight into a `JSONSink`, each message ending with `\n`. A reply is
// `{"id":…,"ok":true` + members + `}`; an error reply is
// `{"id":…,"ok":false,"error":{"code":…,"message":…}}`. Events carry `"event"` and no id.

import ObservableKit

// MARK: - Encoding

/// Writes replies.
public enum ReplyEncoder {
    /// Writes `{"id":<id>,"ok":true`. Follow with members, each starting with a comma,
    /// then `end(_:)`.
    @inlinable
    public static func begin<S: JSONSink & ~Copyable>(_ sink: inout S, id: JSONValue) {
        sink.writeRaw("{\"id\":")
        sink.writeJSON(id)
        sink.writeRaw(",\"ok\":true")
    }

    /// Closes a reply begun with `begin(_:id:)`.
    @inlinable
    public static func end<S: JSONSink & ~Copyable>(_ sink: inout S) {
        sink.writeRaw("}\n")
    }

    /// Writes a success reply with no members.
    @inlinable
    public static func ok<S: JSONSink & ~Copyable>(_ sink: inout S, id: JSONValue) {
        begin(&sink, id: id)
        end(&sink)
    }

    /// Writes an error reply.
    public static func error<S: JSONSink & ~Copyable>(_ sink: inout S, id: JSONValue, _ error: ProtocolError) {
        sink.writeRaw("{\"id\":")
        sink.writeJSON(id)
        sink.writeRaw(",\"ok\":false,\"error\":{\"code\":")
        sink.writeJSONString(error.code.rawValue)
        sink.writeMember(",\"message\":", error.message)
        sink.writeRaw("}}\n")
    }
}

/// Writes events.
public enum EventEncoder {
    /// Writes one change object: `{"key":…[,"old":…][,"new":…]}`.
    public static func writeChange<S: JSONSink & ~Copyable>(_ sink: inout S, _ change: Change<JSONValue>) {
        writeChange(&sink, change) { sink, value in sink.writeJSON(value) }
    }

    /// Writes one change object of any value type, each value written by `writeValue`.
    @inlinable
    public static func writeChange<S: JSONSink & ~Copyable, V>(
        _ sink: inout S, _ change: Change<V>, writeValue: (inout S, V) -> Void
    ) {
        sink.writeRaw("{\"key\":")
        sink.writeJSONString(change.key)
        if let old = change.old {
            sink.writeRaw(",\"old\":")
            writeValue(&sink, old)
        }
        if let new = change.new {
            sink.writeRaw(",\"new\":")
            writeValue(&sink, new)
        }
        sink.writeByte(UInt8(ascii: "}"))
    }

    /// Writes `{"event":"change","sub":<sub>` — the part of a change event that differs
    /// between subscriptions. Follow with `writeChangeBody`.
    @inlinable
    public static func writeChangeHead<S: JSONSink & ~Copyable>(_ sink: inout S, sub: UInt64) {
        sink.writeMember("{\"event\":\"change\",\"sub\":", sub)
    }

    /// Writes `,"by":{"uid":…,"gid":…,"pid":…}`: who wrote a revision (`writers: true`).
    @inlinable
    public static func writeBy<S: JSONSink & ~Copyable>(_ sink: inout S, _ writer: Writer) {
        sink.writeMember(",\"by\":{\"uid\":", UInt64(writer.uid))
        sink.writeMember(",\"gid\":", UInt64(writer.gid))
        sink.writeRaw(",\"pid\":")
        sink.writeJSON(.int(Int64(writer.pid)))
        sink.writeByte(UInt8(ascii: "}"))
    }

    /// Writes `,"repo":…,"rev":…[,"from":…],"changes":[…]}\n` (`from`: the first revision a
    /// coalesced event covers), the `count` change objects written in order by `writeChange`
    /// (given each one's position; see `writeChange(_:_:writeValue:)`).
    @inlinable
    public static func writeChangeBody<S: JSONSink & ~Copyable>(
        _ sink: inout S, repo: String, rev: UInt64, from: UInt64? = nil, count: Int, writeChange: (inout S, Int) -> Void
    ) {
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        if let from { sink.writeMember(",\"from\":", from) }
        sink.writeRaw(",\"changes\":[")
        for i in 0..<count {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            writeChange(&sink, i)
        }
        sink.writeRaw("]}\n")
    }

    /// Writes a whole `snapshot` event.
    public static func writeSnapshot<S: JSONSink & ~Copyable>(
        _ sink: inout S, sub: UInt64, repo: String, rev: UInt64, values: some Sequence<(Key, JSONValue)>
    ) {
        sink.writeMember("{\"event\":\"snapshot\",\"sub\":", sub)
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        sink.writeRaw(",\"values\":{")
        var first = true
        for (key, value) in values {
            if !first { sink.writeByte(UInt8(ascii: ",")) }
            first = false
            sink.writeJSONString(key)
            sink.writeByte(UInt8(ascii: ":"))
            sink.writeJSON(value)
        }
        sink.writeRaw("}}\n")
    }

    /// Writes a whole `synced` event.
    public static func writeSynced<S: JSONSink & ~Copyable>(_ sink: inout S, sub: UInt64, repo: String, rev: UInt64) {
        sink.writeMember("{\"event\":\"synced\",\"sub\":", sub)
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        sink.writeRaw("}\n")
    }

    /// Writes a whole `overflow` event.
    public static func writeOverflow<S: JSONSink & ~Copyable>(_ sink: inout S, revs: some Sequence<(sub: UInt64, rev: UInt64)>) {
        sink.writeRaw("{\"event\":\"overflow\",\"revs\":{")
        var first = true
        for (sub, rev) in revs {
            if !first { sink.writeByte(UInt8(ascii: ",")) }
            first = false
            sink.writeByte(UInt8(ascii: "\""))
            sink.writeDecimal(sub)
            sink.writeRaw("\":")
            sink.writeDecimal(rev)
        }
        sink.writeRaw("}}\n")
    }
}

extension Command {
    /// The request line with `id` and `op`, ended by `\n` (client side).
    public func encodeRequest<S: JSONSink & ~Copyable>(into sink: inout S, id: JSONValue) {
        sink.writeMember("{\"id\":", id)
        sink.writeMember(",\"op\":", op)
        switch self {
        case .hello(let proto, let client):
            if let proto {
                sink.writeRaw(",\"protocol\":")
                sink.writeDecimal(proto)
            }
            if let client { sink.writeMember(",\"client\":", client) }
        case .ping, .repos, .stats:
            break
        case .get(let repo, let key):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
        case .set(let repo, let key, let value, let ifRev, let force, let lease):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
            sink.writeRaw(",\"value\":")
            sink.writeCanonical(value)
            if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
            if force { sink.writeMember(",\"force\":", true) }
            if let lease { sink.writeMember(",\"lease\":", lease) }
        case .delete(let repo, let key, let ifRev):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
            if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
        case .batch(let repo, let ops, let leases):
            sink.writeMember(",\"repo\":", repo)
            sink.writeRaw(",\"ops\":[")
            for (i, op) in ops.enumerated() {
                if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                switch op {
                case .set(let key, let value, let ifRev, let force):
                    sink.writeMember("{\"op\":\"set\",\"key\":", key.string)
                    sink.writeRaw(",\"value\":")
                    sink.writeCanonical(value)
                    if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
                    if force { sink.writeMember(",\"force\":", true) }
                    if i < leases.count, let lease = leases[i] { sink.writeMember(",\"lease\":", lease) }
                case .delete(let key, let ifRev):
                    sink.writeMember("{\"op\":\"delete\",\"key\":", key.string)
                    if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
                }
                sink.writeByte(UInt8(ascii: "}"))
            }
            sink.writeByte(UInt8(ascii: "]"))
        case .list(let repo, let prefix, let values):
            sink.writeMember(",\"repo\":", repo)
            if let prefix { sink.writeMember(",\"prefix\":", prefix) }
            if values { sink.writeMember(",\"values\":", true) }
        case .subscribe(let s):
            sink.writeMember(",\"repo\":", s.repo)
            switch s.selection {
            case .all: break
            case .keys(let keys):
                sink.writeRaw(",\"keys\":[")
                for (i, key) in keys.sorted().enumerated() {
                    if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                    sink.writeJSONString(key)
                }
                sink.writeByte(UInt8(ascii: "]"))
            case .prefix(let p): sink.writeMember(",\"prefix\":", p)
            }
            if s.initial { sink.writeMember(",\"initial\":", true) }
            if let since = s.since {
                sink.writeMember(",\"since\":", since)
                if let epoch = s.epoch { sink.writeMember(",\"epoch\":", epoch) }
            }
            if s.once { sink.writeMember(",\"once\":", true) }
            if s.coalesce { sink.writeMember(",\"coalesce\":", true) }
            if s.writers { sink.writeMember(",\"writers\":", true) }
            if !s.echo { sink.writeMember(",\"echo\":", false) }
            if s.progress { sink.writeMember(",\"progress\":", true) }
        case .unsubscribe(let sub):
            sink.writeMember(",\"sub\":", sub)
        case .grant(let ttl):
            if let ttl { sink.writeMember(",\"ttl\":", UInt64(max(0, ttl))) }
        case .keepalive(let lease), .revoke(let lease):
            sink.writeMember(",\"lease\":", lease)
        }
        sink.writeRaw("}\n")
    }
}

// MARK: - Decoding

/// A reply as a client receives it.
public struct Reply: Sendable {
    /// The echoed request id.
    public let id: JSONValue
    /// The reply's members (without `id` and `ok`) on success, or the error.
    public let result: Result<JSONObject, ProtocolError>
}

/// An event as a client receives it.
public enum Event: Sendable {
    /// A revision's changes; with `from`, a coalesced event covering revisions `from…rev`
    /// (one change per key that differs from what the subscription last received); with
    /// `by`, who wrote revision `rev` (subscriptions with `writers: true`).
    case change(sub: UInt64, repo: String, rev: UInt64, changes: [Change<JSONValue>], from: UInt64?, by: Writer?)
    case snapshot(sub: UInt64, repo: String, rev: UInt64, values: [(key: Key, value: JSONValue)])
    case synced(sub: UInt64, repo: String, rev: UInt64)
    /// The connection is being closed: for each subscription, the revision it is complete up to.
    case overflow(revs: [UInt64: UInt64])
    /// Extension: the subscription ended because the peer may no longer read its repository.
    case revoked(sub: UInt64, repo: String, error: ProtocolError)
    /// An event this client does not know (a newer daemon); ignored.
    case unknown(name: String)

    /// The subscription the event belongs to, if it belongs to one.
    public var sub: UInt64? {
        switch self {
        case .change(let sub, _, _, _, _, _), .snapshot(let sub, _, _, _), .synced(let sub, _, _), .revoked(let sub, _, _): return sub
        case .overflow, .unknown: return nil
        }
    }
}

/// A message from the daemon.
public enum ServerMessage: Sendable {
    case reply(Reply)
    case event(Event)
}

/// A message from the daemon that breaks the protocol.
public struct ProtocolViolation: Error, Sendable, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

extension ServerMessage {
    /// Decodes one line from the daemon.
    public static func decode(line: UnsafeRawBufferPointer) throws(ProtocolViolation) -> ServerMessage {
        let value: JSONValue
        do {
            value = try JSONParser.parse(line, maxDepth: 4096)
        } catch {
            throw ProtocolViolation("daemon sent invalid JSON: \(error)")
        }
        guard case .object(var o) = value else { throw ProtocolViolation("daemon sent a non-object message") }
        if let name = o["event"] {
            guard case .string(let name) = name else { throw ProtocolViolation("\"event\" is not a string") }
            return .event(try decodeEvent(name, o))
        }
        guard let ok = o["ok"]?.boolValue else { throw ProtocolViolation("message has neither \"event\" nor \"ok\"") }
        let id = o["id"] ?? .null
        if ok {
            o["id"] = nil
            o["ok"] = nil
            return .reply(Reply(id: id, result: .success(o)))
        }
        guard let error = o["error"]?.objectValue,
            let codeText = error["code"]?.stringValue
        else { throw ProtocolViolation("error reply without error.code") }
        let message = error["message"]?.stringValue ?? ""
        // A code this client does not know is reported as internal, keeping its text.
        let code = ErrorCode(rawValue: codeText) ?? .internal
        let text = ErrorCode(rawValue: codeText) == nil ? "\(codeText): \(message)" : message
        return .reply(Reply(id: id, result: .failure(ProtocolError(code, text))))
    }

    private static func decodeEvent(_ name: String, _ o: JSONObject) throws(ProtocolViolation) -> Event {
        func uint(_ field: String) throws(ProtocolViolation) -> UInt64 {
            guard let v = o[field]?.uint64Value else { throw ProtocolViolation("\(name) event without a valid \"\(field)\"") }
            return v
        }
        func string(_ field: String) throws(ProtocolViolation) -> String {
            guard let v = o[field]?.stringValue else { throw ProtocolViolation("\(name) event without a valid \"\(field)\"") }
            return v
        }
        switch name {
        case "change":
            guard let items = o["changes"]?.arrayValue else { throw ProtocolViolation("change event without \"changes\"") }
            var changes: [Change<JSONValue>] = []
            changes.reserveCapacity(items.count)
            for item in items {
                guard let c = item.objectValue, let key = c["key"]?.stringValue else {
                    throw ProtocolViolation("change without a key")
                }
                changes.append(Change(key: Key(key), old: c["old"], new: c["new"]))
            }
            let rev = try uint("rev")
            var from: UInt64?
            if let value = o["from"] {
                guard let f = value.uint64Value, f >= 1, f <= rev else {
                    throw ProtocolViolation("change event with a \"from\" that is not a revision from 1 to \"rev\"")
                }
                from = f
            }
            return .change(
                sub: try uint("sub"), repo: try string("repo"), rev: rev, changes: changes, from: from,
                by: try o["by"].map { value throws(ProtocolViolation) in try Writer(decoding: value) })
        case "snapshot":
            guard let values = o["values"]?.objectValue else { throw ProtocolViolation("snapshot event without \"values\"") }
            return .snapshot(
                sub: try uint("sub"), repo: try string("repo"), rev: try uint("rev"),
                values: values.members.map { (Key($0.name), $0.value) })
        case "synced":
            return .synced(sub: try uint("sub"), repo: try string("repo"), rev: try uint("rev"))
        case "overflow":
            var revs: [UInt64: UInt64] = [:]
            for m in o["revs"]?.objectValue?.members ?? [] {
                guard let sub = UInt64(m.name), let rev = m.value.uint64Value else {
                    throw ProtocolViolation("overflow event with an invalid revs entry")
                }
                revs[sub] = rev
            }
            return .overflow(revs: revs)
        case "revoked":
            let error = o["error"]?.objectValue
            let code = error?["code"]?.stringValue.flatMap(ErrorCode.init(rawValue:)) ?? .forbidden
            return .revoked(
                sub: try uint("sub"), repo: try string("repo"),
                error: ProtocolError(code, error?["message"]?.stringValue ?? "the subscription was revoked"))
        default:
            return .unknown(name: name)
        }
    }
}

extension Writer {
    /// Decodes `{"uid": U, "gid": G, "pid": P}` (other members are ignored).
    public init(decoding value: JSONValue) throws(ProtocolViolation) {
        guard let o = value.objectValue, let uid = o["uid"]?.int64Value.flatMap(UInt32.init(exactly:)),
            let gid = o["gid"]?.int64Value.flatMap(UInt32.init(exactly:)),
            let pid = o["pid"]?.int64Value.flatMap(Int32.init(exactly:))
        else { throw ProtocolViolation("\"by\" is not {\"uid\",\"gid\",\"pid\"} with 32-bit integers: \(value.jsonText)") }
        self.init(uid: uid, gid: gid, pid: pid)
    }
}
