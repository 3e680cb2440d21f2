// ObsValues — values as the daemon keeps, compares and forwards them: their canonical
// compact encoding, made once when a value arrives, never a tree of nodes.
//
// Canonical means what the JSON writer would produce for the parsed value: no whitespace,
// strings with only `"`, `\` and control characters escaped, integer literals in the int64
// range as written (`-0` as `0`), other numbers in Swift's shortest round-trip form, object
// members in their order (a repeated name keeps the last value, at the first position).
// So a value read from a request, from storage or built by a client encodes the same way,
// and equal bytes always mean equal values. Unequal bytes mean unequal values too unless
// the value is not *plain* — it holds an object with two or more members (their order may
// differ) or a non-integer number (`1.0` equals `1`): only then are trees compared.

import ObservableKit

/// A JSON value held as its canonical compact encoding.
public struct CanonicalJSON: Sendable {
    /// The canonical encoding.
    public let bytes: [UInt8]
    /// Whether byte inequality decides inequality (see the file header).
    public let isPlain: Bool

    /// The encoding of `value`.
    public init(_ value: JSONValue) {
        var out: [UInt8] = []
        out.writeJSON(value)
        self.bytes = out
        self.isPlain = value.isPlain
    }

    /// Bytes already known to be canonical (read back from the daemon's own store).
    public init(canonical bytes: [UInt8], isPlain: Bool) {
        self.bytes = bytes
        self.isPlain = isPlain
    }

    /// Validates one JSON document and makes it canonical.
    public init(validating bytes: UnsafeRawBufferPointer, maxDepth: Int = JSONParser.defaultMaxDepth) throws(JSONParseError) {
        guard let base = bytes.baseAddress, bytes.count > 0 else { throw JSONParseError(reason: "empty input", offset: 0) }
        var parser = Parser(base: base.assumingMemoryBound(to: UInt8.self), end: bytes.count, maxDepth: maxDepth)
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count)
        let plain = try parser.canonicalValue(into: &out)
        parser.skipWhitespace()
        if parser.pos != parser.end { throw parser.fail("unexpected data after the JSON value") }
        self.init(canonical: out, isPlain: plain)
    }

    /// The value as a tree (parsed on demand: rarely needed).
    public var json: JSONValue {
        // Canonical bytes are valid JSON by construction.
        (try? JSONParser.parse(bytes, maxDepth: Int.max)) ?? .null
    }
}

extension CanonicalJSON: Equatable {
    /// JSON equality, the contract's rule for "changes nothing".
    public static func == (lhs: CanonicalJSON, rhs: CanonicalJSON) -> Bool {
        if lhs.bytes == rhs.bytes { return true }
        if lhs.isPlain && rhs.isPlain { return false }
        return lhs.json == rhs.json
    }
}

extension JSONSink where Self: ~Copyable {
    /// Writes a canonical value's encoding.
    @inlinable
    public mutating func writeCanonical(_ value: CanonicalJSON) { writeRaw(value.bytes) }
}

extension JSONValue {
    /// Whether its canonical encoding decides equality bytewise (see `CanonicalJSON`).
    var isPlain: Bool {
        switch self {
        case .null, .bool, .int, .string: return true
        case .double: return false
        case .array(let elements): return elements.allSatisfy(\.isPlain)
        case .object(let o): return o.members.count < 2 && o.members.allSatisfy { $0.value.isPlain }
        }
    }
}

// MARK: - Canonicalizing parser

extension Parser {
    /// Validates the value at `pos` exactly as `parseValue` does and appends its canonical
    /// encoding to `out`, without building it as a tree; returns whether it is plain.
    /// `depthBelow`: how deep the value sits in the document (for the nesting limit).
    package mutating func canonicalValue(depthBelow: Int = 0, into out: inout [UInt8]) throws(JSONParseError) -> Bool {
        let start = pos
        let written = out.count
        var duplicate = false
        let plain = try canonical(depth: depthBelow, into: &out, duplicate: &duplicate)
        guard duplicate else { return plain }
        // A repeated member name somewhere: the tree parser knows which value stays where.
        out.removeSubrange(written...)
        pos = start
        let value = try parseValue(depth: depthBelow)
        out.writeJSON(value)
        return value.isPlain
    }

    private mutating func canonical(depth: Int, into out: inout [UInt8], duplicate: inout Bool) throws(JSONParseError) -> Bool {
        skipWhitespace()
        guard pos < end else { throw fail("unexpected end of input") }
        switch base[pos] {
        case UInt8(ascii: "{"):
            if depth + 1 > maxDepth { throw fail("nesting deeper than \(maxDepth) levels") }
            pos += 1
            out.append(UInt8(ascii: "{"))
            skipWhitespace()
            if pos < end, base[pos] == UInt8(ascii: "}") {
                pos += 1
                out.append(UInt8(ascii: "}"))
                return true
            }
            var plain = true
            var names: [Range<Int>] = []  // where each member name's encoding sits in `out`
            var seen: Set<ArraySlice<UInt8>>? = nil  // past a few members: a hash set of them
            while true {
                skipWhitespace()
                guard pos < end else { throw fail("unexpected end of input in an object") }
                guard base[pos] == UInt8(ascii: "\"") else { throw fail("expected a member name string, found \(describe(base[pos]))") }
                if !names.isEmpty { out.append(UInt8(ascii: ",")) }
                let nameStart = out.count
                try canonicalString(into: &out)
                let name = nameStart..<out.count
                if !duplicate {
                    if seen == nil, names.count >= 16 { seen = Set(names.map { out[$0] }) }
                    if seen != nil {
                        if !seen!.insert(out[name]).inserted { duplicate = true }
                    } else if names.contains(where: { out[$0] == out[name] }) {
                        duplicate = true
                    }
                }
                names.append(name)
                skipWhitespace()
                guard pos < end, base[pos] == UInt8(ascii: ":") else { throw fail("expected ':' after a member name") }
                pos += 1
                out.append(UInt8(ascii: ":"))
                if !(try canonical(depth: depth + 1, into: &out, duplicate: &duplicate)) { plain = false }
                skipWhitespace()
                guard pos < end else { throw fail("unexpected end of input in an object") }
                switch base[pos] {
                case UInt8(ascii: ","): pos += 1
                case UInt8(ascii: "}"):
                    pos += 1
                    out.append(UInt8(ascii: "}"))
                    return plain && names.count < 2
                default: throw fail("expected ',' or '}' in an object, found \(describe(base[pos]))")
                }
            }
        case UInt8(ascii: "["):
            if depth + 1 > maxDepth { throw fail("nesting deeper than \(maxDepth) levels") }
            pos += 1
            out.append(UInt8(ascii: "["))
            skipWhitespace()
            if pos < end, base[pos] == UInt8(ascii: "]") {
                pos += 1
                out.append(UInt8(ascii: "]"))
                return true
            }
            var plain = true
            var first = true
            while true {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                if !(try canonical(depth: depth + 1, into: &out, duplicate: &duplicate)) { plain = false }
                skipWhitespace()
                guard pos < end else { throw fail("unexpected end of input in an array") }
                switch base[pos] {
                case UInt8(ascii: ","): pos += 1
                case UInt8(ascii: "]"):
                    pos += 1
                    out.append(UInt8(ascii: "]"))
                    return plain
                default: throw fail("expected ',' or ']' in an array, found \(describe(base[pos]))")
                }
            }
        case UInt8(ascii: "\""):
            try canonicalString(into: &out)
            return true
        case UInt8(ascii: "t"):
            try expectLiteral("true")
            out.append(contentsOf: "true".utf8)
            return true
        case UInt8(ascii: "f"):
            try expectLiteral("false")
            out.append(contentsOf: "false".utf8)
            return true
        case UInt8(ascii: "n"):
            try expectLiteral("null")
            out.append(contentsOf: "null".utf8)
            return true
        case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"):
            let start = pos
            let number = try parseNumber()
            if case .int(let i) = number {
                // An integer literal is its own canonical form — but for `-0`.
                if i == 0 { out.append(UInt8(ascii: "0")) } else { out.append(contentsOf: UnsafeBufferPointer(start: base + start, count: pos - start)) }
                return true
            }
            out.writeJSON(number)
            return false
        default:
            throw fail("unexpected \(describe(base[pos]))")
        }
    }

    /// A string literal at `pos` (its opening quote): copied as it is when that is already
    /// canonical (no escapes), else decoded and written again.
    private mutating func canonicalString(into out: inout [UInt8]) throws(JSONParseError) {
        let quote = pos
        pos += 1
        var ascii = true
        while pos < end {
            let b = base[pos]
            if b == UInt8(ascii: "\"") {
                if !ascii, String(validating: UnsafeBufferPointer(start: base + quote + 1, count: pos - quote - 1), as: UTF8.self) == nil {
                    throw JSONParseError(reason: "invalid UTF-8 in a string", offset: quote + 1)
                }
                pos += 1
                out.append(contentsOf: UnsafeBufferPointer(start: base + quote, count: pos - quote))
                return
            }
            if b == UInt8(ascii: "\\") {
                pos = quote + 1
                out.writeJSONString(try parseString())
                return
            }
            if b < 0x20 { throw fail("control character \(describe(b)) in a string must be escaped") }
            if b >= 0x80 { ascii = false }
            pos += 1
        }
        throw fail("unterminated string")
    }
}

extension CanonicalJSON {
    /// `null`.
    public static let null = CanonicalJSON(JSONValue.null)
}

extension CanonicalJSON: ExpressibleByBooleanLiteral, ExpressibleByIntegerLiteral,
    ExpressibleByFloatLiteral, ExpressibleByStringLiteral, ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral
{
    public init(booleanLiteral value: Bool) { self.init(JSONValue.bool(value)) }
    public init(integerLiteral value: Int64) { self.init(JSONValue.int(value)) }
    public init(floatLiteral value: Double) { self.init(JSONValue.double(value)) }
    public init(stringLiteral value: String) { self.init(JSONValue.string(value)) }
    public init(arrayLiteral elements: JSONValue...) { self.init(JSONValue.array(elements)) }
    public init(dictionaryLiteral elements: (String, JSONValue)...) {
        self.init(JSONValue.object(JSONObject(uniqueMembers: elements.map { (name: $0.0, value: $0.1) })))
    }
}
