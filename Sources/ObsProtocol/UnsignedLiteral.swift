// ObsProtocol — the unsigned integer fields of a request (`ifRev`, `since`, `sub`, `lease`)
// read from their number literal as written, not from the double a tree keeps for integers
// beyond the int64 range: every integer in 0…2^64−1 exactly, whatever its spelling (`3.0`,
// `1e19`, `1.8446744073709551615e19`); anything else — beyond 2^64−1, negative, fractional —
// judged by its exact decimal value, never after rounding to a double.

/// A number literal given for an unsigned field, as the general decoder found it.
struct UnsignedLiteral: Sendable, Equatable {
    /// The literal as written (for messages).
    let text: String
    /// Its value, when it is an integer in 0…2^64−1 (`-0` is 0); nil otherwise.
    let value: UInt64?

    /// The fields the decoder reads as unsigned integers, at the top level and in `ops`.
    static func isUnsignedField(_ name: String) -> Bool {
        name == "ifRev" || name == "since" || name == "sub" || name == "lease"
    }

    init(_ bytes: UnsafeBufferPointer<UInt8>) {
        text = String(decoding: bytes, as: UTF8.self)
        value = Self.exactValue(bytes)
    }

    /// The exact value of a valid JSON number literal, if it is an integer in 0…2^64−1:
    /// its digits times ten to its exponent, computed in decimal.
    static func exactValue(_ bytes: UnsafeBufferPointer<UInt8>) -> UInt64? {
        let zero = UInt8(ascii: "0")
        var i = 0
        let negative = bytes.first == UInt8(ascii: "-")
        if negative { i += 1 }
        // The significant digits (integer part, then fraction), and the power of ten they
        // are scaled by.
        var digits: [UInt8] = []
        var scale = 0
        while i < bytes.count, bytes[i] >= zero, bytes[i] <= zero + 9 {
            digits.append(bytes[i] - zero)
            i += 1
        }
        if i < bytes.count, bytes[i] == UInt8(ascii: ".") {
            i += 1
            while i < bytes.count, bytes[i] >= zero, bytes[i] <= zero + 9 {
                digits.append(bytes[i] - zero)
                scale -= 1
                i += 1
            }
        }
        if i < bytes.count, bytes[i] | 0x20 == UInt8(ascii: "e") {
            i += 1
            var exponentNegative = false
            if i < bytes.count, bytes[i] == UInt8(ascii: "+") || bytes[i] == UInt8(ascii: "-") {
                exponentNegative = bytes[i] == UInt8(ascii: "-")
                i += 1
            }
            // Saturated: a literal is at most `JSONParser.maxNumberLength` bytes, so beyond a
            // million the exponent decides alone (too large, or a fraction).
            var exponent = 0
            while i < bytes.count, bytes[i] >= zero, bytes[i] <= zero + 9 {
                exponent = min(exponent * 10 + Int(bytes[i] - zero), 1_000_000)
                i += 1
            }
            scale += exponentNegative ? -exponent : exponent
        }
        guard let first = digits.firstIndex(where: { $0 != 0 }) else { return 0 }  // zero, `-0` included
        guard !negative else { return nil }
        var significant = digits[first...]
        if scale < 0 {
            // The digits the negative scale divides off must all be zeros.
            let trailingZeros = significant.reversed().prefix { $0 == 0 }.count
            guard trailingZeros >= -scale else { return nil }
            significant = significant.dropLast(-scale)
            scale = 0
        }
        guard significant.count + scale <= 20 else { return nil }  // 2^64 has 20 digits
        var value: UInt64 = 0
        for digit in significant + repeatElement(0, count: scale) {
            let (m, o1) = value.multipliedReportingOverflow(by: 10)
            let (s, o2) = m.addingReportingOverflow(UInt64(digit))
            if o1 || o2 { return nil }
            value = s
        }
        return value
    }
}
