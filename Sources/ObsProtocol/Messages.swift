// ObsProtocol — the pieces replies and events are written from: a reply's frame and the
// error reply (`ReplyEncoder`), and the parts of events the daemon encodes once and splices
// per subscriber (`EventEncoder`: a change object, the change head, `by`, the change body).
//
// Encoders write straight into a `JSONSink`, each message ending with `\n`. A reply is
// `{"id":…,"ok":true` + members + `}`; an error reply is
// `{"id":…,"ok":false,"error":{"code":…,"message":…}}`. Events carry `"event"` and no id.
// The typed messages built on these are in Replies.swift, Stats.swift, Events.swift,
// LeaseMessages.swift and CatchUpMessages.swift.

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
    @inlinable
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
    @inlinable
    public static func writeChange<S: JSONSink & ~Copyable>(_ sink: inout S, _ change: Change<JSONValue>) {
        writeChange(&sink, change) { sink, value in sink.writeJSON(value) }
    }

    /// Writes one change object of any value type, each value written by `writeValue`.
    @inlinable
    public static func writeChange<S: JSONSink & ~Copyable, V>(
        _ sink: inout S, _ change: Change<V>, writeValue: (inout S, V) -> Void
    ) {
        change.key.withUTF8 { writeChange(&sink, keyUTF8: UnsafeRawBufferPointer($0), old: change.old, new: change.new, writeValue: writeValue) }
    }

    /// Writes one change object from its key's UTF-8 and its values (nil: absent), each value
    /// written by `writeValue` (the daemon's single-key writes give the canonical bytes).
    @inlinable
    public static func writeChange<S: JSONSink & ~Copyable, V>(
        _ sink: inout S, keyUTF8 key: UnsafeRawBufferPointer, old: V?, new: V?, writeValue: (inout S, V) -> Void
    ) {
        sink.writeRaw("{\"key\":")
        sink.writeJSONString(utf8: key)
        if let old {
            sink.writeRaw(",\"old\":")
            writeValue(&sink, old)
        }
        if let new {
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

    /// Writes `,"repo":…,"rev":…[,"from":…],"changes":[…][,"lease":{…}]}\n` (`from`: the first
    /// revision a coalesced event covers; `lease`: the lease whose end made the revision), the
    /// `count` change objects written in order by `writeChange` (given each one's position;
    /// see `writeChange(_:_:writeValue:)`).
    @inlinable
    public static func writeChangeBody<S: JSONSink & ~Copyable>(
        _ sink: inout S, repo: String, rev: UInt64, from: UInt64? = nil, count: Int, lease: LeaseEnd? = nil,
        writeChange: (inout S, Int) -> Void
    ) {
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        if let from { sink.writeMember(",\"from\":", from) }
        sink.writeRaw(",\"changes\":[")
        for i in 0..<count {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            writeChange(&sink, i)
        }
        sink.writeByte(UInt8(ascii: "]"))
        lease?.writeMember(into: &sink)
        sink.writeRaw("}\n")
    }

    /// Writes a whole `synced` event.
    @inlinable
    public static func writeSynced<S: JSONSink & ~Copyable>(_ sink: inout S, sub: UInt64, repo: String, rev: UInt64) {
        writePosition(&sink, event: "synced", sub: sub, repo: repo, rev: rev)
    }

    /// Writes a whole event that says where a subscription stands (`synced`, `progress`):
    /// `{"event":<event>,"sub":…,"repo":…,"rev":…}`.
    @inlinable
    public static func writePosition<S: JSONSink & ~Copyable>(_ sink: inout S, event: String, sub: UInt64, repo: String, rev: UInt64) {
        sink.writeMember("{\"event\":", event)
        sink.writeMember(",\"sub\":", sub)
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        sink.writeRaw("}\n")
    }

    /// Writes a whole `overflow` event.
    @inlinable
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
