// ObsProtocol — a request line as the general decoder reads it: a tree for every member but
// the values a request only stores and forwards, which stay canonical (see CanonicalJSON), and
// the literals of its unsigned integer fields as written (UnsignedLiteral.swift).

/// A request line as the decoder sees it: every member parsed as a tree except the values
/// it would only store and forward — `value`, and `value` in each element of `ops` — which
/// are kept canonical (a placeholder `null` stands in the tree where they were).
struct RequestDocument {
    /// The top-level value when it is not an object (the request is refused).
    var notObject: JSONValue? = nil
    var object = JSONObject()
    var value: CanonicalJSON? = nil
    /// For each element of `ops`, its `value`.
    var opValues: [CanonicalJSON?] = []
    /// The number literals of the unsigned fields (`ifRev`, `since`, `sub`, `lease`) as
    /// written: the tree keeps an integer beyond the int64 range only as a double.
    var unsigned: [String: UnsignedLiteral] = [:]
    /// For each element of `ops`, the literals of its unsigned fields.
    var opUnsigned: [[String: UnsignedLiteral]] = []
}

extension Parser {
    mutating func parseRequestDocument() throws(JSONParseError) -> RequestDocument {
        skipWhitespace()
        guard pos < end, base[pos] == UInt8(ascii: "{") else { return RequestDocument(notObject: try parseDocument()) }
        var value: CanonicalJSON? = nil
        var ops: [CanonicalJSON?]? = nil
        var opUnsigned: [[String: UnsignedLiteral]] = []
        var unsigned: [String: UnsignedLiteral] = [:]
        let object = try parseObject(depth: 1) { name, parser throws(JSONParseError) in
            if UnsignedLiteral.isUnsignedField(name) { return try parser.parseUnsignedField(name, into: &unsigned) }
            if sameUTF8(name, "value") {
                var out: [UInt8] = []
                let plain = try parser.canonicalValue(depthBelow: 1, into: &out)
                value = CanonicalJSON(canonical: out, isPlain: plain)
                return .null
            }
            if sameUTF8(name, "ops") {
                parser.skipWhitespace()
                guard parser.pos < parser.end, parser.base[parser.pos] == UInt8(ascii: "[") else { return nil }
                var captured: [CanonicalJSON?] = []
                var literals: [[String: UnsignedLiteral]] = []
                let value = try parser.parseOps(into: &captured, literals: &literals)
                ops = captured
                opUnsigned = literals
                return value
            }
            return nil
        }
        skipWhitespace()
        if pos != end { throw fail("unexpected data after the JSON value") }
        return RequestDocument(object: object, value: value, opValues: ops ?? [], unsigned: unsigned, opUnsigned: opUnsigned)
    }

    /// The value of member `name`, an unsigned field: a number's literal is kept in `literals`
    /// as written, and the number in the tree; any other value is parsed as usual (nil).
    private mutating func parseUnsignedField(_ name: String, into literals: inout [String: UnsignedLiteral]) throws(JSONParseError) -> JSONValue? {
        skipWhitespace()
        // A repeated name: the last one wins, in the tree and here.
        literals[name] = nil
        guard pos < end, base[pos] == UInt8(ascii: "-") || (base[pos] >= UInt8(ascii: "0") && base[pos] <= UInt8(ascii: "9")) else { return nil }
        let start = pos
        let number = try parseNumber()
        literals[name] = UnsignedLiteral(UnsafeBufferPointer(start: base + start, count: pos - start))
        return number
    }

    /// `ops`: an array whose object elements have their `value` kept canonical, and the
    /// literals of their unsigned fields in `literals`.
    private mutating func parseOps(into captured: inout [CanonicalJSON?], literals: inout [[String: UnsignedLiteral]]) throws(JSONParseError) -> JSONValue {
        if 2 > maxDepth { throw fail("nesting deeper than \(maxDepth) levels") }
        pos += 1  // [
        var elements: [JSONValue] = []
        skipWhitespace()
        if pos < end, base[pos] == UInt8(ascii: "]") {
            pos += 1
            return .array(elements)
        }
        while true {
            skipWhitespace()
            var value: CanonicalJSON? = nil
            var unsigned: [String: UnsignedLiteral] = [:]
            if pos < end, base[pos] == UInt8(ascii: "{") {
                let element = try parseObject(depth: 3) { name, parser throws(JSONParseError) in
                    if UnsignedLiteral.isUnsignedField(name) { return try parser.parseUnsignedField(name, into: &unsigned) }
                    guard sameUTF8(name, "value") else { return nil }
                    var out: [UInt8] = []
                    let plain = try parser.canonicalValue(depthBelow: 3, into: &out)
                    value = CanonicalJSON(canonical: out, isPlain: plain)
                    return .null
                }
                elements.append(.object(element))
            } else {
                elements.append(try parseValue(depth: 2))
            }
            captured.append(value)
            literals.append(unsigned)
            skipWhitespace()
            guard pos < end else { throw fail("unexpected end of input in an array") }
            switch base[pos] {
            case UInt8(ascii: ","): pos += 1
            case UInt8(ascii: "]"):
                pos += 1
                return .array(elements)
            default: throw fail("expected ',' or ']' in an array, found \(describe(base[pos]))")
            }
        }
    }
}
