// ObsProtocol — the fast path of request decoding: the requests clients send most, read
// straight from their bytes, with no tree and no member table, into the fields that
// ScannedRequest.swift makes a `Request` of (or hands over in place: a single-key write).
//
// It takes only what it is sure of: member names and strings without escapes, ids that are
// integers, strings or null, revisions that are plain integer literals, booleans, a value
// (canonicalized in one pass), a list of plain keys, a batch's operations (each read the same
// way). Every other member is validated and skipped as the general decoder would skip it.
// Anything else — an escape, a field of an unexpected type, a rule broken (a batch naming a
// key twice), invalid JSON —
// returns nil and the general decoder takes the line, so every answer, every error message
// included, is exactly the general decoder's (the fuzz harness checks that the two agree).

import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// The fast path's reading of a member it does not trust itself to judge.
private struct NotFast: Error {}

extension Parser {
    /// `skipWhitespace`, with the usual case — no whitespace at all — decided here: called
    /// around every token, the calls themselves were 3 % of the daemon's time at fan-out 1.
    @inline(__always)
    private mutating func skipSpace() {
        if pos < end, base[pos] <= 0x20 { skipWhitespace() }
    }

    /// Reads a request object into `fields`; false (or a throw) when the line needs the
    /// general decoder.
    mutating func scanRequest(into fields: inout ScannedFields, values: inout [UInt8], ops: inout [ScannedOp]) throws -> Bool {
        skipSpace()
        guard pos < end, base[pos] == UInt8(ascii: "{") else { return false }
        pos += 1
        skipSpace()
        if pos < end, base[pos] == UInt8(ascii: "}") { return false }  // no op: the general decoder says so
        while true {
            skipSpace()
            guard pos < end, base[pos] == UInt8(ascii: "\"") else { return false }
            let known = knownName()
            let name = known == nil ? try plainString() : UnsafeBufferPointer(start: nil, count: 0)
            skipSpace()
            guard pos < end, base[pos] == UInt8(ascii: ":") else { return false }
            pos += 1
            skipSpace()
            guard pos < end else { return false }
            if let known {
                try scanKnown(known, into: &fields, values: &values)
            } else {
                try scanMember(name, into: &fields, values: &values, ops: &ops)
            }
            skipSpace()
            guard pos < end else { return false }
            if base[pos] == UInt8(ascii: ",") {
                pos += 1
                continue
            }
            guard base[pos] == UInt8(ascii: "}") else { return false }
            pos += 1
            skipSpace()
            return pos == end
        }
    }

    /// The members every write names, read without a lookup of their name.
    private enum KnownName { case id, op, repo, key, value }

    /// At a member name's opening quote: the name, if it is one of `KnownName` (then `pos` is
    /// past its closing quote), matched with its closing quote by one 8-byte load. Else nil,
    /// `pos` unmoved, and `plainString` reads the name.
    @inline(__always)
    private mutating func knownName() -> KnownName? {
        guard pos + 9 <= end else { return nil }
        // Little-endian: the name's first byte is the word's lowest.
        let w = UnsafeRawPointer(base).loadUnaligned(fromByteOffset: pos + 1, as: UInt64.self)
        let known: KnownName
        let length: Int
        switch w & 0xFF_FFFF {
        case 0x22_6469: (known, length) = (.id, 3)  // id"
        case 0x22_706F: (known, length) = (.op, 3)  // op"
        default:
            if w & 0xFFFF_FFFF == 0x2279_656B {  // key"
                (known, length) = (.key, 4)
            } else if w & 0xFF_FFFF_FFFF == 0x22_6F70_6572 {  // repo"
                (known, length) = (.repo, 5)
            } else if w & 0xFFFF_FFFF_FFFF == 0x2265_756C_6176 {  // value"
                (known, length) = (.value, 6)
            } else {
                return nil
            }
        }
        pos += 1 + length
        return known
    }

    private mutating func scanKnown(_ name: KnownName, into f: inout ScannedFields, values: inout [UInt8]) throws {
        switch name {
        case .id:
            switch base[pos] {
            case UInt8(ascii: "\""): f.id = .string(try text())
            case UInt8(ascii: "n"): try expectLiteral("null"); f.id = .null
            case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"):
                guard case .int(let i) = try parseNumber() else { throw NotFast() }
                f.id = .int(i)
            default: throw NotFast()
            }
        case .op:
            guard base[pos] == UInt8(ascii: "\"") else { throw NotFast() }
            // "set" (with both quotes) in one load, the usual operation; else read as a name.
            if pos + 8 <= end, UnsafeRawPointer(base).loadUnaligned(fromByteOffset: pos, as: UInt64.self) & 0xFF_FFFF_FFFF == 0x22_7465_7322 {
                pos += 5
                f.op = .set
            } else {
                f.op = Operation(try plainString())
            }
        case .repo:
            guard base[pos] == UInt8(ascii: "\""), case let bytes = try plainString(), ProtocolRules.isValidRepoName(bytes: bytes) else {
                throw NotFast()
            }
            f.repo = bytes
        case .key:
            if base[pos] == UInt8(ascii: "n") {
                try expectLiteral("null")
                f.key = nil
                break
            }
            guard base[pos] == UInt8(ascii: "\""), case let key = try plainString(), !key.isEmpty, key.count <= ProtocolRules.maxKeyBytes else {
                throw NotFast()
            }
            f.key = key
        case .value:
            // A repeated member keeps its last value, as the general decoder does.
            let start = values.count
            f.valueIsPlain = try canonicalValue(depthBelow: 1, into: &values)
            f.value = start..<values.count
        }
    }

    private mutating func scanMember(_ name: UnsafeBufferPointer<UInt8>, into f: inout ScannedFields, values: inout [UInt8], ops: inout [ScannedOp]) throws {
        switch name.count {
        // Read here when `knownName` could not look ahead 8 bytes (the end of the line).
        case 2 where Self.equal(name, "id"): try scanKnown(.id, into: &f, values: &values)
        case 2 where Self.equal(name, "op"): try scanKnown(.op, into: &f, values: &values)
        case 4 where Self.equal(name, "repo"): try scanKnown(.repo, into: &f, values: &values)
        case 3 where Self.equal(name, "key"): try scanKnown(.key, into: &f, values: &values)
        case 5 where Self.equal(name, "value"): try scanKnown(.value, into: &f, values: &values)
        case 5 where Self.equal(name, "ifRev"): f.ifRev = try optionalUnsigned()
        case 5 where Self.equal(name, "since"): f.since = try optionalUnsigned()
        case 3 where Self.equal(name, "sub"): f.sub = try optionalUnsigned()
        case 5 where Self.equal(name, "force"): f.force = try optionalBool()
        case 7 where Self.equal(name, "initial"): f.initial = try optionalBool()
        case 4 where Self.equal(name, "once"): f.once = try optionalBool()
        case 8 where Self.equal(name, "coalesce"): f.coalesce = try optionalBool()
        case 7 where Self.equal(name, "writers"): f.writers = try optionalBool()
        case 4 where Self.equal(name, "echo"): f.echo = try optionalBool()
        case 8 where Self.equal(name, "progress"): f.progress = try optionalBool()
        case 7 where Self.equal(name, "catchup"): f.catchup = try optionalBool()
        case 5 where Self.equal(name, "lease"):
            // A lease to attach (the lease extension), or null; 0 is the general decoder's to refuse.
            guard let lease = try optionalUnsigned() else { f.lease = nil; break }
            guard lease >= 1 else { throw NotFast() }
            f.lease = lease
        case 6 where Self.equal(name, "values"): f.values = try optionalBool()
        case 6 where Self.equal(name, "prefix"): f.prefix = try optionalText()
        case 5 where Self.equal(name, "epoch"): f.epoch = try optionalText()
        case 6 where Self.equal(name, "client"): f.client = try optionalText()
        case 8 where Self.equal(name, "protocol"):
            if base[pos] == UInt8(ascii: "n") {
                try expectLiteral("null")
                f.proto = nil
            } else {
                guard case .int(let i) = try parseNumber() else { throw NotFast() }
                f.proto = i
            }
        case 4 where Self.equal(name, "keys"): f.keys = try optionalKeys()
        case 3 where Self.equal(name, "ops"):
            // A repeated member keeps its last value, as the general decoder does.
            ops = try batchOps(values: &values)
            f.hasOps = true
        default:
            _ = try parseValue(depth: 1)  // validated, ignored
        }
    }

    // MARK: A batch's operations

    /// A batch's `ops`: each `{"op":"set"|"delete","key":…}` with its `value`, `ifRev`,
    /// `force` and `lease` (other members validated and skipped), keys distinct.
    private mutating func batchOps(values: inout [UInt8]) throws -> [ScannedOp] {
        // The array and its objects nest two below the request: a limit that low is the
        // general decoder's to report.
        guard base[pos] == UInt8(ascii: "["), maxDepth >= 4 else { throw NotFast() }
        pos += 1
        var ops: [ScannedOp] = []
        skipSpace()
        if pos < end, base[pos] == UInt8(ascii: "]") {
            pos += 1
            return ops
        }
        while true {
            skipSpace()
            ops.append(try batchOp(values: &values))
            skipSpace()
            guard pos < end else { throw NotFast() }
            if base[pos] == UInt8(ascii: ",") {
                pos += 1
                continue
            }
            guard base[pos] == UInt8(ascii: "]") else { throw NotFast() }
            pos += 1
            break
        }
        // A key named twice: the general decoder's message says which.
        if ops.count <= 32 {
            for i in 1..<max(1, ops.count) {
                for j in 0..<i where ops[i].key.count == ops[j].key.count && memcmp(ops[i].key.baseAddress!, ops[j].key.baseAddress!, ops[i].key.count) == 0 {
                    throw NotFast()
                }
            }
        } else {
            var seen = Set<Key>(minimumCapacity: ops.count)
            for op in ops where !seen.insert(Key(String(decoding: op.key, as: UTF8.self))).inserted { throw NotFast() }
        }
        return ops
    }

    private mutating func batchOp(values: inout [UInt8]) throws -> ScannedOp {
        guard pos < end, base[pos] == UInt8(ascii: "{") else { throw NotFast() }
        pos += 1
        var op = ScannedOp()
        var kind: Operation?
        skipSpace()
        if pos < end, base[pos] == UInt8(ascii: "}") { throw NotFast() }
        while true {
            skipSpace()
            guard pos < end, base[pos] == UInt8(ascii: "\"") else { throw NotFast() }
            let name = try plainString()
            skipSpace()
            guard pos < end, base[pos] == UInt8(ascii: ":") else { throw NotFast() }
            pos += 1
            skipSpace()
            guard pos < end else { throw NotFast() }
            switch name.count {
            case 2 where Self.equal(name, "op"):
                guard base[pos] == UInt8(ascii: "\"") else { throw NotFast() }
                kind = Operation(try plainString())
            case 3 where Self.equal(name, "key"):
                guard base[pos] == UInt8(ascii: "\""), case let key = try plainString(), !key.isEmpty, key.count <= ProtocolRules.maxKeyBytes else {
                    throw NotFast()
                }
                op.key = key
            case 5 where Self.equal(name, "value"):
                let start = values.count
                op.isPlain = try canonicalValue(depthBelow: 3, into: &values)
                op.value = start..<values.count
            case 5 where Self.equal(name, "ifRev"): op.ifRev = try optionalUnsigned()
            case 5 where Self.equal(name, "force"): op.force = try optionalBool() ?? false
            case 5 where Self.equal(name, "lease"):
                guard let lease = try optionalUnsigned() else { op.lease = nil; break }
                guard lease >= 1 else { throw NotFast() }
                op.lease = lease
            default:
                _ = try parseValue(depth: 3)  // validated, ignored
            }
            skipSpace()
            guard pos < end else { throw NotFast() }
            if base[pos] == UInt8(ascii: ",") {
                pos += 1
                continue
            }
            guard base[pos] == UInt8(ascii: "}") else { throw NotFast() }
            pos += 1
            break
        }
        switch kind {
        case .set? where op.value != nil && !op.key.isEmpty:
            op.isSet = true
        case .delete? where !op.key.isEmpty:
            (op.isSet, op.value, op.force, op.lease) = (false, nil, false, nil)
        default:
            throw NotFast()  // no op, another op, no key, a set without a value
        }
        return op
    }

    // MARK: Values the fast path reads

    /// A string without escapes at `pos` (its opening quote): its UTF-8 bytes, validated.
    /// Finds the closing quote and classifies the body in one pass, eight bytes at a time
    /// (a request's strings are short: a call to `memchr` and a second pass cost more).
    private mutating func plainString() throws -> UnsafeBufferPointer<UInt8> {
        pos += 1
        let start = pos
        let ones: UInt64 = 0x0101_0101_0101_0101
        let highs: UInt64 = 0x8080_8080_8080_8080
        let raw = UnsafeRawPointer(base)
        var high: UInt64 = 0  // every byte before the quote, or-ed: non-ASCII if a high bit is set
        var i = start
        var quote = -1
        while i + 8 <= end {
            let w = raw.loadUnaligned(fromByteOffset: i, as: UInt64.self)
            // Bytes that are a quote; a backslash or a control character: (x - 0x01…) & ~x & 0x80…
            // flags the zero bytes of x, exactly up to the first (a borrow can flag bytes above it).
            let q = w ^ (0x22 &* ones)
            let b = w ^ (0x5C &* ones)
            let quotes = (q &- ones) & ~q & highs
            let special = (((b &- ones) & ~b) | ((w &- 0x20 &* ones) & ~w)) & highs
            if quotes | special != 0 {
                let firstQuote = quotes.trailingZeroBitCount >> 3  // 8: none
                guard special.trailingZeroBitCount >> 3 > firstQuote else { throw NotFast() }
                high |= firstQuote == 0 ? 0 : w & (~0 >> UInt64(64 - 8 * firstQuote))
                quote = i + firstQuote
                break
            }
            high |= w
            i += 8
        }
        if quote < 0 {
            while i < end {
                let c = base[i]
                if c == UInt8(ascii: "\"") {
                    quote = i
                    break
                }
                if c == UInt8(ascii: "\\") || c < 0x20 { throw NotFast() }
                high |= UInt64(c)
                i += 1
            }
            guard quote >= 0 else { throw NotFast() }
        }
        let bytes = UnsafeBufferPointer(start: base + start, count: quote - start)
        if high & highs != 0, String(validating: bytes, as: UTF8.self) == nil { throw NotFast() }
        pos = quote + 1
        return bytes
    }

    private mutating func text() throws -> String {
        String(decoding: try plainString(), as: UTF8.self)
    }

    private mutating func optionalText() throws -> String? {
        if base[pos] == UInt8(ascii: "n") {
            try expectLiteral("null")
            return nil
        }
        guard base[pos] == UInt8(ascii: "\"") else { throw NotFast() }
        return try text()
    }

    /// A non-negative integer literal below 2^64, or null.
    private mutating func optionalUnsigned() throws -> UInt64? {
        if base[pos] == UInt8(ascii: "n") {
            try expectLiteral("null")
            return nil
        }
        let start = pos
        var value: UInt64 = 0
        while pos < end, base[pos] >= UInt8(ascii: "0"), base[pos] <= UInt8(ascii: "9") {
            let (m, o1) = value.multipliedReportingOverflow(by: 10)
            let (s, o2) = m.addingReportingOverflow(UInt64(base[pos] - UInt8(ascii: "0")))
            if o1 || o2 { throw NotFast() }
            value = s
            pos += 1
        }
        // Digits only, no leading zero (JSON's rule), nothing number-like after them.
        let count = pos - start
        guard count > 0, count == 1 || base[start] != UInt8(ascii: "0") else { throw NotFast() }
        if pos < end, [UInt8(ascii: "."), UInt8(ascii: "e"), UInt8(ascii: "E")].contains(base[pos]) { throw NotFast() }
        return value
    }

    private mutating func optionalBool() throws -> Bool? {
        switch base[pos] {
        case UInt8(ascii: "t"): try expectLiteral("true"); return true
        case UInt8(ascii: "f"): try expectLiteral("false"); return false
        case UInt8(ascii: "n"): try expectLiteral("null"); return nil
        default: throw NotFast()
        }
    }

    /// An array of keys, or null.
    private mutating func optionalKeys() throws -> Set<Key>? {
        if base[pos] == UInt8(ascii: "n") {
            try expectLiteral("null")
            return nil
        }
        guard base[pos] == UInt8(ascii: "[") else { throw NotFast() }
        pos += 1
        var keys = Set<Key>()
        skipSpace()
        if pos < end, base[pos] == UInt8(ascii: "]") {
            pos += 1
            return keys
        }
        while true {
            skipSpace()
            guard pos < end, base[pos] == UInt8(ascii: "\"") else { throw NotFast() }
            let key = try text()
            guard ProtocolRules.keyProblem(key) == nil else { throw NotFast() }
            keys.insert(Key(key))
            skipSpace()
            guard pos < end else { throw NotFast() }
            if base[pos] == UInt8(ascii: ",") {
                pos += 1
                continue
            }
            guard base[pos] == UInt8(ascii: "]") else { throw NotFast() }
            pos += 1
            return keys
        }
    }

    private static func equal(_ bytes: UnsafeBufferPointer<UInt8>, _ literal: StaticString) -> Bool {
        bytes.count == literal.utf8CodeUnitCount && memcmp(bytes.baseAddress!, literal.utf8Start, bytes.count) == 0
    }
}
