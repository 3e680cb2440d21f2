// ObsProtocol — a request line as the general decoder reads it: a tree for every member but
// the values a request only stores and forwards, which stay canonical (see CanonicalJSON).

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
}

extension Parser {
    mutating func parseRequestDocument() throws(JSONParseError) -> RequestDocument {
        skipWhitespace()
        guard pos < end, base[pos] == UInt8(ascii: "{") else { return RequestDocument(notObject: try parseDocument()) }
        var value: CanonicalJSON? = nil
        var ops: [CanonicalJSON?]? = nil
        let object = try parseObject(depth: 1) { name, parser throws(JSONParseError) in
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
                let value = try parser.parseOps(into: &captured)
                ops = captured
                return value
            }
            return nil
        }
        skipWhitespace()
        if pos != end { throw fail("unexpected data after the JSON value") }
        return RequestDocument(object: object, value: value, opValues: ops ?? [])
    }

    /// `ops`: an array whose object elements have their `value` kept canonical.
    private mutating func parseOps(into captured: inout [CanonicalJSON?]) throws(JSONParseError) -> JSONValue {
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
            if pos < end, base[pos] == UInt8(ascii: "{") {
                let element = try parseObject(depth: 3) { name, parser throws(JSONParseError) in
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
