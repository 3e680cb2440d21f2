// ObsValues — the values every layer of obsd shares, below the wire protocol and the store:
// JSON values (this file), the parser and writer, their canonical encoding, a writer's
// credentials and a lease's end. No I/O.
//
// This file owns `JSONValue`: any JSON value, with the contract's rules — integers in
// the int64 range are kept exactly, other numbers as doubles; two values are equal when
// they are equal as JSON (objects regardless of member order, `1 == 1.0`, strings by
// their code points).

import ObservableKit

/// A JSON value.
public enum JSONValue: Sendable {
    case null
    case bool(Bool)
    /// An integer literal within the int64 range, kept exactly.
    case int(Int64)
    /// Any other number. Always finite.
    case double(Double)
    case string(String)
    case array([JSONValue])
    case object(JSONObject)
}

/// A JSON object: members in their original order, names unique (the last of repeated
/// names wins when parsing).
public struct JSONObject: Sendable {
    public private(set) var members: [(name: String, value: JSONValue)]

    public init() { members = [] }

    /// An object from members whose names are already unique.
    public init(uniqueMembers: [(name: String, value: JSONValue)]) {
        members = uniqueMembers
    }

    public var count: Int { members.count }
    public var isEmpty: Bool { members.isEmpty }

    /// The value of member `name` (compared by bytes), if present.
    public subscript(name: String) -> JSONValue? {
        get {
            for m in members where sameUTF8(m.name, name) { return m.value }
            return nil
        }
        set {
            if let i = members.firstIndex(where: { sameUTF8($0.name, name) }) {
                if let newValue { members[i].value = newValue } else { members.remove(at: i) }
            } else if let newValue {
                members.append((name, newValue))
            }
        }
    }
}

// MARK: - Equality

extension JSONValue: Equatable {
    /// Equality as JSON: numbers by numeric value, objects regardless of member order,
    /// strings and member names by their Unicode code points (not canonical equivalence).
    public static func == (lhs: JSONValue, rhs: JSONValue) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): return true
        case (.bool(let a), .bool(let b)): return a == b
        case (.int(let a), .int(let b)): return a == b
        case (.double(let a), .double(let b)): return a == b
        case (.int(let a), .double(let b)), (.double(let b), .int(let a)):
            return Int64(exactly: b) == a
        case (.string(let a), .string(let b)): return sameUTF8(a, b)
        case (.array(let a), .array(let b)): return a == b
        case (.object(let a), .object(let b)): return a == b
        default: return false
        }
    }
}

extension JSONObject: Equatable {
    /// Equal when both have the same member names with equal values, in any order.
    public static func == (lhs: JSONObject, rhs: JSONObject) -> Bool {
        guard lhs.count == rhs.count else { return false }
        if lhs.count <= 8 {
            for m in lhs.members {
                guard let other = rhs[m.name], other == m.value else { return false }
            }
            return true
        }
        var byName = [Key: JSONValue](minimumCapacity: rhs.count)
        for m in rhs.members { byName[Key(m.name)] = m.value }
        for m in lhs.members {
            guard let other = byName[Key(m.name)], other == m.value else { return false }
        }
        return true
    }
}

// MARK: - Accessors

extension JSONValue {
    /// The string, if this is a string.
    public var stringValue: String? {
        if case .string(let s) = self { return s }
        return nil
    }

    /// The boolean, if this is a boolean.
    public var boolValue: Bool? {
        if case .bool(let b) = self { return b }
        return nil
    }

    /// The object, if this is an object.
    public var objectValue: JSONObject? {
        if case .object(let o) = self { return o }
        return nil
    }

    /// The array, if this is an array.
    public var arrayValue: [JSONValue]? {
        if case .array(let a) = self { return a }
        return nil
    }

    /// The number as an exact signed integer, if it is one (`3` and `3.0` both are).
    public var int64Value: Int64? {
        switch self {
        case .int(let i): return i
        case .double(let d): return Int64(exactly: d)
        default: return nil
        }
    }

    /// The number as an exact non-negative integer of up to 64 bits, if it is one.
    public var uint64Value: UInt64? {
        switch self {
        case .int(let i): return i >= 0 ? UInt64(i) : nil
        case .double(let d): return UInt64(exactly: d)
        default: return nil
        }
    }

    /// The number as a double, if this is a number.
    public var doubleValue: Double? {
        switch self {
        case .int(let i): return Double(i)
        case .double(let d): return d
        default: return nil
        }
    }

    /// Whether this is `null`.
    public var isNull: Bool {
        if case .null = self { return true }
        return false
    }

    /// A short name of the value's JSON type, for error messages.
    public var typeName: String {
        switch self {
        case .null: return "null"
        case .bool: return "boolean"
        case .int, .double: return "number"
        case .string: return "string"
        case .array: return "array"
        case .object: return "object"
        }
    }

    /// A JSON number for an unsigned 64-bit integer: exact up to `Int64.max`.
    public static func number(_ u: UInt64) -> JSONValue {
        u <= UInt64(Int64.max) ? .int(Int64(u)) : .double(Double(u))
    }
}

// MARK: - Literals

extension JSONValue: ExpressibleByNilLiteral, ExpressibleByBooleanLiteral, ExpressibleByIntegerLiteral,
    ExpressibleByFloatLiteral, ExpressibleByStringLiteral, ExpressibleByArrayLiteral,
    ExpressibleByDictionaryLiteral
{
    public init(nilLiteral: ()) { self = .null }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(integerLiteral value: Int64) { self = .int(value) }
    public init(floatLiteral value: Double) { self = .double(value) }
    public init(stringLiteral value: String) { self = .string(value) }
    public init(arrayLiteral elements: JSONValue...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, JSONValue)...) {
        var object = JSONObject()
        for (name, value) in elements { object[name] = value }
        self = .object(object)
    }
}

extension JSONValue: CustomStringConvertible {
    /// The compact JSON text of the value.
    public var description: String { String(decoding: jsonBytes(), as: UTF8.self) }
}

/// Whether two strings have the same UTF-8 bytes (code-point equality, not Swift's
/// canonical equivalence). Compares contiguous storage directly; element by element
/// through `UTF8View` (many times slower) only for strings without it. On the request
/// path for every member lookup.
package func sameUTF8(_ a: String, _ b: String) -> Bool {
    let fast = a.utf8.withContiguousStorageIfAvailable { pa in
        b.utf8.withContiguousStorageIfAvailable { pb in
            pa.count == pb.count && (pa.isEmpty || memcmp(pa.baseAddress!, pb.baseAddress!, pa.count) == 0)
        }
    }
    if let fast, let result = fast { return result }
    return a.utf8.elementsEqual(b.utf8)
}
