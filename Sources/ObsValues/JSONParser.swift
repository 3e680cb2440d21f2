// ObsValues — the JSON parser (RFC 8259), strict and bounded.
//
// Rejects, with a message naming the byte offset: invalid UTF-8, raw control characters
// in strings, lone UTF-16 surrogates in `\u` escapes (they have no Unicode scalar, and
// replacing them would silently change the data), non-finite numbers, number literals
// longer than `maxNumberLength`, and nesting deeper than `maxDepth`. Integer literals in
// the int64 range become `.int`; every other number becomes `.double`.

import ObservableKit

/// Why a text is not acceptable JSON.
public struct JSONParseError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What is wrong, for a person.
    public let reason: String
    /// The byte offset where the problem was found.
    public let offset: Int

    public var description: String { "\(reason) (at byte \(offset))" }

    package init(reason: String, offset: Int) {
        self.reason = reason
        self.offset = offset
    }
}

/// Parses JSON text.
public enum JSONParser {
    /// The default limit on nesting of arrays and objects.
    public static let defaultMaxDepth = 512
    /// The longest number literal accepted, in bytes.
    public static let maxNumberLength = 1024

    /// Parses one JSON value that spans all of `bytes` (surrounding whitespace allowed).
    public static func parse(_ bytes: UnsafeRawBufferPointer, maxDepth: Int = defaultMaxDepth) throws(JSONParseError) -> JSONValue {
        guard let base = bytes.baseAddress, bytes.count > 0 else {
            throw JSONParseError(reason: "empty input", offset: 0)
        }
        var parser = Parser(base: base.assumingMemoryBound(to: UInt8.self), end: bytes.count, maxDepth: maxDepth)
        return try parser.parseDocument()
    }

    /// Parses one JSON value from bytes.
    public static func parse(_ bytes: [UInt8], maxDepth: Int = defaultMaxDepth) throws(JSONParseError) -> JSONValue {
        let result = bytes.withUnsafeBytes { raw in Result { () throws(JSONParseError) in try parse(raw, maxDepth: maxDepth) } }
        return try result.get()
    }

    /// Parses one JSON value from text.
    public static func parse(_ text: String, maxDepth: Int = defaultMaxDepth) throws(JSONParseError) -> JSONValue {
        try parse(Array(text.utf8), maxDepth: maxDepth)
    }
}

package struct Parser {
    package let base: UnsafePointer<UInt8>
    package let end: Int
    package let maxDepth: Int
    package var pos = 0

    package init(base: UnsafePointer<UInt8>, end: Int, maxDepth: Int) {
        self.base = base
        self.end = end
        self.maxDepth = maxDepth
    }

    package mutating func parseDocument() throws(JSONParseError) -> JSONValue {
        let value = try parseValue(depth: 0)
        skipWhitespace()
        if pos != end { throw fail("unexpected data after the JSON value") }
        return value
    }

    // MARK: Values

    package mutating func parseValue(depth: Int) throws(JSONParseError) -> JSONValue {
        skipWhitespace()
        guard pos < end else { throw fail("unexpected end of input") }
        switch base[pos] {
        case UInt8(ascii: "{"): return .object(try parseObject(depth: depth + 1))
        case UInt8(ascii: "["): return .array(try parseArray(depth: depth + 1))
        case UInt8(ascii: "\""):
            pos += 1
            return .string(try parseString())
        case UInt8(ascii: "t"): try expectLiteral("true"); return .bool(true)
        case UInt8(ascii: "f"): try expectLiteral("false"); return .bool(false)
        case UInt8(ascii: "n"): try expectLiteral("null"); return .null
        case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return try parseNumber()
        default: throw fail("unexpected \(describe(base[pos]))")
        }
    }

    /// A member the caller parses itself: given the member's name and the parser at its
    /// value, returns the value to keep in the tree, or nil to have it parsed as usual.
    package typealias MemberHook = (String, inout Parser) throws(JSONParseError) -> JSONValue?

    package mutating func parseObject(depth: Int, hook: MemberHook? = nil) throws(JSONParseError) -> JSONObject {
        if depth > maxDepth { throw fail("nesting deeper than \(maxDepth) levels") }
        pos += 1  // {
        var members: [(name: String, value: JSONValue)] = []
        var positions: [Key: Int]? = nil
        skipWhitespace()
        if pos < end, base[pos] == UInt8(ascii: "}") {
            pos += 1
            return JSONObject(uniqueMembers: members)
        }
        while true {
            skipWhitespace()
            guard pos < end else { throw fail("unexpected end of input in an object") }
            guard base[pos] == UInt8(ascii: "\"") else { throw fail("expected a member name string, found \(describe(base[pos]))") }
            pos += 1
            let name = try parseString()
            skipWhitespace()
            guard pos < end, base[pos] == UInt8(ascii: ":") else { throw fail("expected ':' after a member name") }
            pos += 1
            let value: JSONValue
            if let hook, let parsed = try hook(name, &self) { value = parsed } else { value = try parseValue(depth: depth) }
            // Repeated names: the last one wins, at the position of the first.
            if let existing = Self.position(of: name, in: members, index: &positions) {
                members[existing].value = value
            } else {
                positions?[Key(name)] = members.count
                members.append((name, value))
            }
            skipWhitespace()
            guard pos < end else { throw fail("unexpected end of input in an object") }
            switch base[pos] {
            case UInt8(ascii: ","): pos += 1
            case UInt8(ascii: "}"):
                pos += 1
                return JSONObject(uniqueMembers: members)
            default: throw fail("expected ',' or '}' in an object, found \(describe(base[pos]))")
            }
        }
    }

    /// Finds a member by name: a scan while the object is small, a hash index after.
    package static func position(
        of name: String, in members: [(name: String, value: JSONValue)], index: inout [Key: Int]?
    ) -> Int? {
        if index == nil {
            if members.count < 16 {
                return members.firstIndex { sameUTF8($0.name, name) }
            }
            var map = [Key: Int](minimumCapacity: members.count * 2)
            for (i, m) in members.enumerated() { map[Key(m.name)] = i }
            index = map
        }
        return index![Key(name)]
    }

    package mutating func parseArray(depth: Int) throws(JSONParseError) -> [JSONValue] {
        if depth > maxDepth { throw fail("nesting deeper than \(maxDepth) levels") }
        pos += 1  // [
        var elements: [JSONValue] = []
        skipWhitespace()
        if pos < end, base[pos] == UInt8(ascii: "]") {
            pos += 1
            return elements
        }
        while true {
            elements.append(try parseValue(depth: depth))
            skipWhitespace()
            guard pos < end else { throw fail("unexpected end of input in an array") }
            switch base[pos] {
            case UInt8(ascii: ","): pos += 1
            case UInt8(ascii: "]"):
                pos += 1
                return elements
            default: throw fail("expected ',' or ']' in an array, found \(describe(base[pos]))")
            }
        }
    }

    // MARK: Strings

    /// Parses a string body; `pos` is just after the opening quote.
    package mutating func parseString() throws(JSONParseError) -> String {
        let start = pos
        var ascii = true
        while pos < end {
            let b = base[pos]
            if b == UInt8(ascii: "\"") {
                let bytes = UnsafeBufferPointer(start: base + start, count: pos - start)
                pos += 1
                if ascii { return String(decoding: bytes, as: UTF8.self) }
                guard let s = String(validating: bytes, as: UTF8.self) else {
                    throw JSONParseError(reason: "invalid UTF-8 in a string", offset: start)
                }
                return s
            }
            if b == UInt8(ascii: "\\") { return try parseEscapedString(from: start) }
            if b < 0x20 { throw fail("control character \(describe(b)) in a string must be escaped") }
            if b >= 0x80 { ascii = false }
            pos += 1
        }
        throw fail("unterminated string")
    }

    /// Slow path: the string contains escapes. `pos` is at the first backslash.
    package mutating func parseEscapedString(from start: Int) throws(JSONParseError) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(pos - start + 16)
        out.append(contentsOf: UnsafeBufferPointer(start: base + start, count: pos - start))
        while pos < end {
            let b = base[pos]
            switch b {
            case UInt8(ascii: "\""):
                pos += 1
                guard let s = String(validating: out, as: UTF8.self) else {
                    throw JSONParseError(reason: "invalid UTF-8 in a string", offset: start)
                }
                return s
            case UInt8(ascii: "\\"):
                pos += 1
                guard pos < end else { throw fail("unterminated escape sequence") }
                let e = base[pos]
                pos += 1
                switch e {
                case UInt8(ascii: "\""): out.append(0x22)
                case UInt8(ascii: "\\"): out.append(0x5C)
                case UInt8(ascii: "/"): out.append(0x2F)
                case UInt8(ascii: "b"): out.append(0x08)
                case UInt8(ascii: "f"): out.append(0x0C)
                case UInt8(ascii: "n"): out.append(0x0A)
                case UInt8(ascii: "r"): out.append(0x0D)
                case UInt8(ascii: "t"): out.append(0x09)
                case UInt8(ascii: "u"): try appendUnicodeEscape(to: &out)
                default:
                    pos -= 1
                    throw fail("invalid escape '\\\(Character(Unicode.Scalar(e)))'")
                }
            default:
                if b < 0x20 { throw fail("control character \(describe(b)) in a string must be escaped") }
                out.append(b)
                pos += 1
            }
        }
        throw fail("unterminated string")
    }

    /// `pos` is just after `\u`.
    package mutating func appendUnicodeEscape(to out: inout [UInt8]) throws(JSONParseError) {
        let escapeStart = pos - 2
        let unit = try hex4()
        var scalarValue = UInt32(unit)
        if (0xD800...0xDBFF).contains(unit) {
            guard pos + 6 <= end, base[pos] == UInt8(ascii: "\\"), base[pos + 1] == UInt8(ascii: "u") else {
                throw JSONParseError(reason: "lone UTF-16 surrogate \\u\(hex(unit)) has no Unicode scalar", offset: escapeStart)
            }
            pos += 2
            let low = try hex4()
            guard (0xDC00...0xDFFF).contains(low) else {
                throw JSONParseError(reason: "lone UTF-16 surrogate \\u\(hex(unit)) has no Unicode scalar", offset: escapeStart)
            }
            scalarValue = 0x10000 + ((UInt32(unit) - 0xD800) << 10) + (UInt32(low) - 0xDC00)
        } else if (0xDC00...0xDFFF).contains(unit) {
            throw JSONParseError(reason: "lone UTF-16 surrogate \\u\(hex(unit)) has no Unicode scalar", offset: escapeStart)
        }
        // Always valid: surrogates were excluded above.
        guard let scalar = Unicode.Scalar(scalarValue) else {
            throw JSONParseError(reason: "invalid \\u escape", offset: escapeStart)
        }
        out.append(contentsOf: UTF8.encode(scalar)!)
    }

    package mutating func hex4() throws(JSONParseError) -> UInt16 {
        guard pos + 4 <= end else { throw fail("truncated \\u escape") }
        var v: UInt16 = 0
        for _ in 0..<4 {
            let b = base[pos]
            let d: UInt8
            switch b {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): d = b - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): d = b - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): d = b - UInt8(ascii: "A") + 10
            default: throw fail("invalid hex digit \(describe(b)) in a \\u escape")
            }
            v = v << 4 | UInt16(d)
            pos += 1
        }
        return v
    }

    // MARK: Numbers

    package mutating func parseNumber() throws(JSONParseError) -> JSONValue {
        let start = pos
        var isInteger = true
        let negative = base[pos] == UInt8(ascii: "-")
        if negative { pos += 1 }
        guard pos < end, isDigit(base[pos]) else { throw fail("expected a digit in a number") }
        // The integer part's value, accumulated as it is read: with at most 18 digits it
        // cannot overflow, and the usual integer needs no second pass (`int64`).
        let digitsStart = pos
        var magnitude: Int64 = 0
        if base[pos] == UInt8(ascii: "0") {
            pos += 1
            if pos < end, isDigit(base[pos]) { throw fail("leading zeros are not allowed in numbers") }
        } else {
            while pos < end, isDigit(base[pos]) {
                magnitude = magnitude &* 10 &+ Int64(base[pos] &- UInt8(ascii: "0"))
                pos += 1
            }
        }
        if pos - digitsStart <= 18, pos == end || (base[pos] != UInt8(ascii: ".") && base[pos] | 0x20 != UInt8(ascii: "e")) {
            return .int(negative ? -magnitude : magnitude)
        }
        if pos < end, base[pos] == UInt8(ascii: ".") {
            isInteger = false
            pos += 1
            guard pos < end, isDigit(base[pos]) else { throw fail("expected a digit after the decimal point") }
            while pos < end, isDigit(base[pos]) { pos += 1 }
        }
        if pos < end, base[pos] == UInt8(ascii: "e") || base[pos] == UInt8(ascii: "E") {
            isInteger = false
            pos += 1
            if pos < end, base[pos] == UInt8(ascii: "+") || base[pos] == UInt8(ascii: "-") { pos += 1 }
            guard pos < end, isDigit(base[pos]) else { throw fail("expected a digit in the exponent") }
            while pos < end, isDigit(base[pos]) { pos += 1 }
        }
        let length = pos - start
        if length > JSONParser.maxNumberLength {
            throw JSONParseError(reason: "number literal longer than \(JSONParser.maxNumberLength) bytes", offset: start)
        }
        let bytes = UnsafeBufferPointer(start: base + start, count: length)
        if isInteger, let i = Self.int64(bytes) { return .int(i) }
        let text = String(decoding: bytes, as: UTF8.self)
        guard let d = Double(text), d.isFinite else {
            throw JSONParseError(reason: "number \(text.prefix(40)) is out of range", offset: start)
        }
        return .double(d)
    }

    /// The integer value of a validated integer literal, or `nil` outside the int64 range.
    package static func int64(_ bytes: UnsafeBufferPointer<UInt8>) -> Int64? {
        var i = 0
        let negative = bytes[0] == UInt8(ascii: "-")
        if negative { i = 1 }
        // Accumulate negatively so that Int64.min is representable.
        var value: Int64 = 0
        while i < bytes.count {
            let digit = Int64(bytes[i] &- UInt8(ascii: "0"))
            let (m, o1) = value.multipliedReportingOverflow(by: 10)
            let (s, o2) = m.subtractingReportingOverflow(digit)
            if o1 || o2 { return nil }
            value = s
            i += 1
        }
        if negative { return value }
        return value == .min ? nil : -value
    }

    // MARK: Helpers

    package mutating func expectLiteral(_ literal: StaticString) throws(JSONParseError) {
        let n = literal.utf8CodeUnitCount
        guard pos + n <= end, memcmp(base + pos, literal.utf8Start, n) == 0 else {
            throw fail("invalid literal (expected \(literal))")
        }
        pos += n
    }

    @inlinable @inline(__always)  // the request scanner (ObsProtocol) calls it between every two tokens
    package mutating func skipWhitespace() {
        while pos < end {
            switch base[pos] {
            case 0x20, 0x09, 0x0A, 0x0D: pos += 1
            default: return
            }
        }
    }

    @inlinable @inline(__always)
    package func isDigit(_ b: UInt8) -> Bool { b >= UInt8(ascii: "0") && b <= UInt8(ascii: "9") }

    package func fail(_ reason: String) -> JSONParseError { JSONParseError(reason: reason, offset: pos) }

    package func describe(_ b: UInt8) -> String {
        if b >= 0x20 && b < 0x7F { return "'\(Character(Unicode.Scalar(b)))'" }
        return "byte 0x\(hex(UInt16(b)))"
    }

    package func hex(_ v: UInt16) -> String {
        let s = String(v, radix: 16, uppercase: true)
        return String(repeating: "0", count: max(0, (v > 0xFF ? 4 : 2) - s.count)) + s
    }
}

/// Compares `n` bytes (the parser's literals are a few bytes: no call into libc).
func memcmp(_ a: UnsafePointer<UInt8>, _ b: UnsafePointer<UInt8>, _ n: Int) -> Int {
    for i in 0..<n where a[i] != b[i] { return Int(a[i]) - Int(b[i]) }
    return 0
}
