// Tests of the unsigned integer fields — `ifRev`, `since`, `sub`, `lease` — on both decoding
// paths: every integer in 0…2^64−1 exactly, whatever its spelling (`3.0`, `1e19`); beyond
// 2^64−1, negative or fractional, a `bad_request` naming the field. A member name written with
// an escape sends the line to the general decoder, the plain name to the fast path: each
// spelling gets the same answer on both.

import ObsProtocol
import ObservableKit
import Testing

/// How a spelling of a number reads as an unsigned field: its value, or nil (refused).
private let spellings: [(text: String, value: UInt64?)] = [
    ("0", 0), ("7", 7), ("-0", 0), ("0.0", 0), ("0e5", 0),
    ("9223372036854775807", UInt64(Int64.max)), ("9223372036854775808", 1 << 63), ("9223372036854775809", (1 << 63) + 1),
    ("18446744073709551614", UInt64.max - 1), ("18446744073709551615", UInt64.max),
    ("3.0", 3), ("1e19", 10_000_000_000_000_000_000), ("1E+19", 10_000_000_000_000_000_000), ("100e-2", 1), ("1.5e1", 15),
    ("1.8446744073709551615e19", UInt64.max), ("18446744073709551615.000", UInt64.max), ("9223372036854775809.0", (1 << 63) + 1),
    // Beyond 2^64−1, negative, fractional: refused, exactly as written (never rounded first).
    ("18446744073709551616", nil), ("1.8446744073709552e19", nil), ("1e20", nil), ("99999999999999999999999", nil),
    ("-1", nil), ("-9223372036854775809", nil), ("-1e19", nil), ("1.5", nil), ("1e-1", nil), ("18446744073709551615.5", nil),
    ("9223372036854775808.5", nil), ("0.5e1", 5), ("5e-1", nil),
]

/// A request line naming `field` (spelled `name`) with `number`, and what it decodes to with
/// value `v`.
private struct Form: Sendable {
    let field: String
    let line: @Sendable (_ name: String, _ number: String) -> String
    let expected: @Sendable (UInt64) -> Request?
}

private let forms: [Form] = [
    Form(field: "ifRev", line: { #"{"id":1,"op":"set","repo":"r","key":"k","value":1,"\#($0)":\#($1)}"# }) {
        Request(id: 1, command: .set(repo: "r", key: "k", value: CanonicalJSON(.int(1)), ifRev: $0, force: false))
    },
    Form(field: "ifRev", line: { #"{"id":1,"op":"delete","repo":"r","key":"k","\#($0)":\#($1)}"# }) {
        Request(id: 1, command: .delete(repo: "r", key: "k", ifRev: $0))
    },
    Form(field: "since", line: { #"{"id":1,"op":"subscribe","repo":"r","\#($0)":\#($1)}"# }) {
        Request(id: 1, command: .subscribe(SubscribeRequest(repo: "r", since: $0)))
    },
    Form(field: "sub", line: { #"{"id":1,"op":"unsubscribe","\#($0)":\#($1)}"# }) { Request(id: 1, command: .unsubscribe(sub: $0)) },
    Form(field: "lease", line: { #"{"id":1,"op":"set","repo":"r","key":"k","value":1,"\#($0)":\#($1)}"# }) {
        $0 == 0 ? nil : Request(id: 1, command: .set(repo: "r", key: "k", value: CanonicalJSON(.int(1)), ifRev: nil, force: false), leases: ["k": $0])
    },
    Form(field: "lease", line: { #"{"id":1,"op":"keepalive","\#($0)":\#($1)}"# }) { $0 == 0 ? nil : Request(id: 1, command: .lease(.keepalive(lease: $0))) },
    Form(field: "ifRev", line: { #"{"id":1,"op":"batch","repo":"r","ops":[{"op":"delete","key":"a"},{"op":"set","key":"k","value":1,"\#($0)":\#($1)}]}"# }) {
        Request(id: 1, command: .batch(repo: "r", ops: [.delete("a", ifRevision: nil), .set("k", CanonicalJSON(.int(1)), ifRevision: $0, force: false)]))
    },
    Form(field: "lease", line: { #"{"id":1,"op":"batch","repo":"r","ops":[{"op":"set","key":"k","value":1,"\#($0)":\#($1)}]}"# }) {
        $0 == 0 ? nil : Request(id: 1, command: .batch(repo: "r", ops: [.set("k", CanonicalJSON(.int(1)), ifRevision: nil, force: false)]), leases: ["k": $0])
    },
]

/// The field's name with its first letter escaped (`\u0069fRev`): only the general decoder reads it.
private func escaped(_ name: String) -> String {
    let first = name.unicodeScalars.first!.value
    return "\\u00" + String(first, radix: 16) + name.dropFirst()
}

/// What `Request.decode(line:)` answers to `text`.
private func answer(_ text: String) -> Result<Request, RequestFailure> {
    Array(text.utf8).withUnsafeBytes { raw in Result { () throws(RequestFailure) in try Request.decode(line: raw) } }
}

@Suite struct UnsignedFieldTests {
    @Test(arguments: spellings) func everySpellingReadsTheSameOnBothPathsAndExactly(_ spelling: (text: String, value: UInt64?)) throws {
        for form in forms {
            let plain = form.line(form.field, spelling.text)
            let general = form.line(escaped(form.field), spelling.text)
            let (fast, slow) = (answer(plain), answer(general))
            #expect(fast == slow, "\(plain): the fast path answers \(fast), the general decoder \(slow)")
            // Exactly the value written, or a bad_request naming the field.
            let expected = spelling.value.flatMap(form.expected)
            switch fast {
            case .success(let request):
                #expect(request == expected, "\(plain) reads as \(request)")
            case .failure(let failure):
                #expect(expected == nil, "\(plain) is refused: \(failure.error)")
                #expect(failure.id == 1 && failure.error.code == .badRequest, "\(plain): \(failure.error)")
                #expect(failure.error.message.contains("\"\(form.field)\"") && failure.error.message.contains(spelling.text), "\(failure.error.message)")
            }
            // Whatever the fast path takes, it reads as the general decoder does.
            Array(plain.utf8).withUnsafeBytes { raw in
                if let scanned = Request.scan(raw) { #expect(Result { () throws(RequestFailure) in scanned } == answer(general), "\(plain)") }
            }
        }
    }

    @Test func theMessageSaysWhatTheFieldTakes() {
        #expect(
            failure(#"{"id":1,"op":"set","repo":"r","key":"k","value":1,"ifRev":18446744073709551616}"#)?.error.message
                == #"field "ifRev" must be a non-negative integer below 2^64, not 18446744073709551616"#)
        #expect(
            failure(#"{"id":1,"op":"subscribe","repo":"r","since":1.8446744073709552e19}"#)?.error.message
                == #"field "since" must be a non-negative integer below 2^64, not 1.8446744073709552e19"#)
        #expect(
            failure(#"{"id":1,"op":"revoke","lease":18446744073709551616}"#)?.error.message
                == #"field "lease" must be a lease id (an integer from 1), not 18446744073709551616"#)
    }
}
