// ObsProtocol — the values inside typed messages, and how a message's fields are read back.
//
// A reply or event that carries values (`get`, `set`, `list`, `change`, `snapshot`) is one
// generic type over `WireValue`: the daemon holds values as `CanonicalJSON` and writes their
// bytes as they are; a client decodes them as `JSONValue` trees. One definition per message,
// two instantiations. `MessageFields` reads a parsed message's members with a
// `ProtocolViolation` that names the message and the field for anything the contract does
// not allow.

/// A JSON value as a typed message holds it: `CanonicalJSON` (the daemon's bytes, written as
/// they are) or `JSONValue` (a tree, what a client reads).
public protocol WireValue: Sendable, Equatable {
    /// Writes the value's JSON encoding.
    func writeJSON<S: JSONSink & ~Copyable>(to sink: inout S)
    /// The value as it was read from a message. (A static function, not an initializer, so
    /// that `CanonicalJSON.init` and `JSONValue.init` stay unambiguous as function values.)
    static func decoded(from value: JSONValue) -> Self
}

extension JSONValue: WireValue {
    @inlinable
    public func writeJSON<S: JSONSink & ~Copyable>(to sink: inout S) { sink.writeJSON(self) }

    @inlinable
    public static func decoded(from value: JSONValue) -> JSONValue { value }
}

extension CanonicalJSON: WireValue {
    @inlinable
    public func writeJSON<S: JSONSink & ~Copyable>(to sink: inout S) { sink.writeCanonical(self) }

    public static func decoded(from value: JSONValue) -> CanonicalJSON { CanonicalJSON(value) }
}

/// A message from the daemon that breaks the protocol.
public struct ProtocolViolation: Error, Sendable, Equatable, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// Typed access to the members of a parsed message, failing with a `ProtocolViolation`
/// that names the message (`what`, e.g. `"the get reply"`) and the field.
struct MessageFields {
    let object: JSONObject
    let what: String

    init(_ object: JSONObject, _ what: String) {
        self.object = object
        self.what = what
    }

    func violation(_ field: String, _ expected: String) -> ProtocolViolation {
        if let value = object[field] {
            return ProtocolViolation("\(what) has \"\(field)\": \(value.jsonText.prefix(60)), not \(expected)")
        }
        return ProtocolViolation("\(what) has no \"\(field)\" (\(expected))")
    }

    /// The member, unless it is absent or `null`.
    func present(_ field: String) -> JSONValue? {
        guard let value = object[field], !value.isNull else { return nil }
        return value
    }

    func unsigned(_ field: String) throws(ProtocolViolation) -> UInt64 {
        guard let value = object[field]?.uint64Value else { throw violation(field, "a non-negative integer") }
        return value
    }

    func optionalUnsigned(_ field: String) throws(ProtocolViolation) -> UInt64? {
        guard let value = present(field) else { return nil }
        guard let number = value.uint64Value else { throw violation(field, "a non-negative integer") }
        return number
    }

    func integer(_ field: String) throws(ProtocolViolation) -> Int64 {
        guard let value = object[field]?.int64Value else { throw violation(field, "an integer") }
        return value
    }

    func count(_ field: String) throws(ProtocolViolation) -> Int {
        guard let value = object[field]?.int64Value, value >= 0, let count = Int(exactly: value) else {
            throw violation(field, "a count")
        }
        return count
    }

    func string(_ field: String) throws(ProtocolViolation) -> String {
        guard let value = object[field]?.stringValue else { throw violation(field, "a string") }
        return value
    }

    func bool(_ field: String) throws(ProtocolViolation) -> Bool {
        guard let value = object[field]?.boolValue else { throw violation(field, "a boolean") }
        return value
    }

    func objectMember(_ field: String) throws(ProtocolViolation) -> JSONObject {
        guard let value = object[field]?.objectValue else { throw violation(field, "an object") }
        return value
    }

    func array(_ field: String) throws(ProtocolViolation) -> [JSONValue] {
        guard let value = object[field]?.arrayValue else { throw violation(field, "an array") }
        return value
    }

    /// A repository revision that a subscription's message is at.
    func revision() throws(ProtocolViolation) -> UInt64 { try unsigned("rev") }
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
