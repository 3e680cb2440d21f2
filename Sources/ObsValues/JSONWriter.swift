// ObsValues — JSON encoding into any byte sink.
//
// `JSONSink` abstracts the output (a `[UInt8]` here; the server conforms NIO's
// `ByteBuffer`), so messages are encoded once, straight into the buffer that is written
// to the socket. Output is compact, UTF-8, with `"`, `\` and control characters escaped;
// doubles use Swift's shortest round-trip form.

import ObservableKit

/// A destination for encoded bytes.
public protocol JSONSink: ~Copyable {
    mutating func writeByte(_ byte: UInt8)
    mutating func writeBytes(_ bytes: UnsafeRawBufferPointer)
}

extension Array: JSONSink where Element == UInt8 {
    @inlinable
    public mutating func writeByte(_ byte: UInt8) { append(byte) }
    @inlinable
    public mutating func writeBytes(_ bytes: UnsafeRawBufferPointer) { append(contentsOf: bytes) }
}

extension JSONSink where Self: ~Copyable {
    /// Writes ASCII text verbatim (punctuation and known field names).
    @inlinable
    public mutating func writeRaw(_ text: StaticString) {
        writeBytes(UnsafeRawBufferPointer(start: text.utf8Start, count: text.utf8CodeUnitCount))
    }

    /// Writes pre-encoded bytes verbatim.
    @inlinable
    public mutating func writeRaw(_ bytes: [UInt8]) {
        bytes.withUnsafeBytes { writeBytes($0) }
    }

    /// Writes an unsigned integer in decimal.
    @inlinable
    public mutating func writeDecimal(_ value: UInt64) {
        var digits: (UInt64, UInt64, UInt64) = (0, 0, 0)  // 24 bytes of scratch
        withUnsafeMutableBytes(of: &digits) { buf in
            var i = buf.count
            var v = value
            repeat {
                i -= 1
                buf[i] = UInt8(ascii: "0") + UInt8(v % 10)
                v /= 10
            } while v != 0
            writeBytes(UnsafeRawBufferPointer(rebasing: buf[i...]))
        }
    }

    /// Writes a signed integer in decimal.
    @inlinable
    public mutating func writeDecimal(_ value: Int64) {
        if value < 0 {
            writeByte(UInt8(ascii: "-"))
            writeDecimal(value.magnitude)
        } else {
            writeDecimal(UInt64(value))
        }
    }

    /// Writes a JSON string literal.
    @inlinable
    public mutating func writeJSONString(_ string: String) {
        var s = string
        s.withUTF8 { writeJSONString(utf8: UnsafeRawBufferPointer($0)) }
    }

    /// Writes a JSON string literal of text given as its (valid) UTF-8 bytes.
    @inlinable
    public mutating func writeJSONString(utf8 bytes: UnsafeRawBufferPointer) {
        writeByte(UInt8(ascii: "\""))
        var runStart = 0
        for i in 0..<bytes.count {
            let b = bytes[i]
            guard b < 0x20 || b == UInt8(ascii: "\"") || b == UInt8(ascii: "\\") else { continue }
            if runStart < i { writeBytes(UnsafeRawBufferPointer(rebasing: bytes[runStart..<i])) }
            writeEscape(b)
            runStart = i + 1
        }
        if runStart < bytes.count { writeBytes(UnsafeRawBufferPointer(rebasing: bytes[runStart...])) }
        writeByte(UInt8(ascii: "\""))
    }

    @usableFromInline
    internal mutating func writeEscape(_ b: UInt8) {
        switch b {
        case UInt8(ascii: "\""): writeRaw("\\\"")
        case UInt8(ascii: "\\"): writeRaw("\\\\")
        case 0x0A: writeRaw("\\n")
        case 0x0D: writeRaw("\\r")
        case 0x09: writeRaw("\\t")
        case 0x08: writeRaw("\\b")
        case 0x0C: writeRaw("\\f")
        default:
            let hex: StaticString = "0123456789abcdef"
            writeRaw("\\u00")
            writeByte(hex.utf8Start[Int(b >> 4)])
            writeByte(hex.utf8Start[Int(b & 0xF)])
        }
    }

    /// Writes a key as a JSON string.
    @inlinable
    public mutating func writeJSONString(_ key: Key) { writeJSONString(key.string) }

    /// Writes any JSON value.
    @inlinable
    public mutating func writeJSON(_ value: JSONValue) {
        switch value {
        case .null: writeRaw("null")
        case .bool(let b): b ? writeRaw("true") : writeRaw("false")
        case .int(let i): writeDecimal(i)
        case .double(let d):
            var text = d.description
            text.withUTF8 { writeBytes(UnsafeRawBufferPointer($0)) }
        case .string(let s): writeJSONString(s)
        case .array(let elements):
            writeByte(UInt8(ascii: "["))
            for (i, e) in elements.enumerated() {
                if i > 0 { writeByte(UInt8(ascii: ",")) }
                writeJSON(e)
            }
            writeByte(UInt8(ascii: "]"))
        case .object(let object):
            writeByte(UInt8(ascii: "{"))
            for (i, m) in object.members.enumerated() {
                if i > 0 { writeByte(UInt8(ascii: ",")) }
                writeJSONString(m.name)
                writeByte(UInt8(ascii: ":"))
                writeJSON(m.value)
            }
            writeByte(UInt8(ascii: "}"))
        }
    }

    // MARK: Object members
    //
    // Messages are written as `{` + first member + `,name:value`... + `}`. `name` is a
    // literal that includes its leading comma when it is not the first member, for
    // example `writeMember(",\"rev\":", rev)`.

    @inlinable
    public mutating func writeMember(_ name: StaticString, _ value: UInt64) {
        writeRaw(name)
        writeDecimal(value)
    }

    @inlinable
    public mutating func writeMember(_ name: StaticString, _ value: Bool) {
        writeRaw(name)
        value ? writeRaw("true") : writeRaw("false")
    }

    @inlinable
    public mutating func writeMember(_ name: StaticString, _ value: String) {
        writeRaw(name)
        writeJSONString(value)
    }

    @inlinable
    public mutating func writeMember(_ name: StaticString, _ value: JSONValue) {
        writeRaw(name)
        writeJSON(value)
    }
}

extension JSONValue {
    /// The compact JSON encoding of the value.
    public func jsonBytes() -> [UInt8] {
        var out: [UInt8] = []
        out.writeJSON(self)
        return out
    }

    /// The compact JSON text of the value.
    public var jsonText: String { String(decoding: jsonBytes(), as: UTF8.self) }
}
