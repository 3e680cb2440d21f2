// Tests of the JSON value type, parser and writer against the contract's rules.

import ObsProtocol
import ObservableKit
import Testing

@Suite struct JSONParserTests {
    @Test func parsesEveryKindOfValue() throws {
        let v = try JSONParser.parse(#" {"a": [1, -2, 3.5, 1e2, true, false, null, "x\ny"], "b": {}} "#)
        guard case .object(let o) = v else { Issue.record("not an object"); return }
        #expect(o["a"] == [1, -2, 3.5, 100.0, true, false, nil, "x\ny"])
        #expect(o["b"] == .object(JSONObject()))
    }

    @Test func integersInInt64RangeStayExact() throws {
        #expect(try JSONParser.parse("9223372036854775807") == .int(.max))
        #expect(try JSONParser.parse("-9223372036854775808") == .int(.min))
        if case .int = try JSONParser.parse("9007199254740993") {} else { Issue.record("2^53+1 must stay an integer") }
        #expect(try JSONParser.parse("9007199254740993").jsonText == "9007199254740993")
        #expect(try JSONParser.parse("-0") == .int(0))
        // Up to 18 digits are read as they are scanned; from 19 on, with overflow checks.
        #expect(try JSONParser.parse("999999999999999999") == .int(999_999_999_999_999_999))
        #expect(try JSONParser.parse("-999999999999999999") == .int(-999_999_999_999_999_999))
        #expect(try JSONParser.parse("1000000000000000000") == .int(1_000_000_000_000_000_000))
        #expect(try JSONParser.parse("[12,-3]") == [12, -3])
        #expect(try JSONParser.parse("12E1") == .double(120), "an exponent makes a double, whatever its case")
        #expect(try JSONParser.parse("12.0") == .double(12))
    }

    @Test func otherNumbersBecomeDoubles() throws {
        guard case .double(let d) = try JSONParser.parse("9223372036854775808") else {
            Issue.record("2^63 must become a double"); return
        }
        #expect(d == 9223372036854775808.0)
        guard case .double = try JSONParser.parse("1.0") else { Issue.record("1.0 is a double"); return }
        #expect(try JSONParser.parse("123456789012345678901234567890").doubleValue == 1.2345678901234568e29)
    }

    @Test(arguments: [
        "", " ", "{", "[1,]", "{\"a\":1,}", "01", "1.", ".5", "-", "1e", "+1", "tru", "nul", "\"abc", "[1 2]",
        "{\"a\" 1}", "{1:2}", "\"\\x\"", "\"\\u12\"", "\"\\u12G4\"", "NaN", "Infinity", "1e400", "-1e400", "{} {}",
        "\"a\u{01}b\"", "'a'",
    ])
    func rejectsInvalidJSON(_ text: String) {
        #expect(throws: JSONParseError.self) { try JSONParser.parse(text) }
    }

    @Test func rejectsInvalidUTF8AndRawControlCharacters() {
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0xC3, 0x28, 0x22]) }
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0xFF, 0x22]) }
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0xED, 0xA0, 0x80, 0x22]) }  // encoded surrogate
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0x22, 0x00, 0x22]) }  // raw NUL
        #expect(throws: JSONParseError.self) { try JSONParser.parse([0xEF, 0xBB, 0xBF, 0x31]) }  // BOM
    }

    @Test func escapesDecodeAndLoneSurrogatesAreRejected() throws {
        #expect(try JSONParser.parse(#""\u00e9\n\t\"\\\/""#) == .string("é\n\t\"\\/"))
        #expect(try JSONParser.parse(#""\ud83d\ude00""#) == .string("😀"))
        #expect(try JSONParser.parse(#""\u0000""#) == .string("\u{0}"))
        for lone in [#""\ud800""#, #""\udc00""#, #""\ud800\u0041""#, #""\ud800x""#] {
            #expect(throws: JSONParseError.self) { try JSONParser.parse(lone) }
        }
    }

    @Test func nestingIsBounded() throws {
        let ok = String(repeating: "[", count: 100) + String(repeating: "]", count: 100)
        _ = try JSONParser.parse(ok)
        let deep = String(repeating: "[", count: 100_000) + String(repeating: "]", count: 100_000)
        let error = #expect(throws: JSONParseError.self) { try JSONParser.parse(deep) }
        #expect(error?.reason.contains("nesting") == true)
        let objects = String(repeating: "{\"a\":", count: 600) + "1" + String(repeating: "}", count: 600)
        #expect(throws: JSONParseError.self) { try JSONParser.parse(objects) }
    }

    @Test func hugeNumberLiteralsAreRejectedCleanly() {
        let long = String(repeating: "9", count: 100_000)
        let error = #expect(throws: JSONParseError.self) { try JSONParser.parse(long) }
        #expect(error?.reason.contains("longer") == true)
    }

    @Test func repeatedMemberNamesKeepTheLast() throws {
        let v = try JSONParser.parse(#"{"a":1,"b":2,"a":3}"#)
        #expect(v.objectValue?.count == 2)
        #expect(v.objectValue?["a"] == 3)
        // Past the linear-scan threshold too.
        let many = (0..<40).map { "\"k\($0)\":\($0)" }.joined(separator: ",")
        let w = try JSONParser.parse("{\(many),\"k7\":700}")
        #expect(w.objectValue?.count == 40)
        #expect(w.objectValue?["k7"] == 700)
    }

    @Test func largeArraysParse() throws {
        let text = "[" + Array(repeating: "1", count: 1_000_000).joined(separator: ",") + "]"
        #expect(try JSONParser.parse(text).arrayValue?.count == 1_000_000)
    }
}

@Suite struct JSONEqualityTests {
    @Test func numbersCompareByValue() {
        #expect(JSONValue.int(1) == .double(1.0))
        #expect(JSONValue.double(1.0) == .int(1))
        #expect(JSONValue.int(1) != .double(1.5))
        #expect(JSONValue.double(0) == .double(-0.0))
        #expect(JSONValue.int(9007199254740993) != .double(9007199254740992))
        #expect(JSONValue.int(.max) != .double(9223372036854775808.0))
    }

    @Test func objectsIgnoreMemberOrder() throws {
        #expect(try JSONParser.parse(#"{"a":1,"b":[1,{"c":2,"d":3}]}"#) == JSONParser.parse(#"{"b":[1.0,{"d":3,"c":2}],"a":1}"#))
        #expect(try JSONParser.parse(#"{"a":1}"#) != JSONParser.parse(#"{"a":1,"b":2}"#))
        #expect(try JSONParser.parse(#"{"a":1}"#) != JSONParser.parse(#"{"b":1}"#))
        let many = (0..<30).map { "\"k\($0)\":\($0)" }
        #expect(try JSONParser.parse("{\(many.joined(separator: ","))}") == JSONParser.parse("{\(many.reversed().joined(separator: ","))}"))
    }

    @Test func arraysAreOrdered() {
        #expect(JSONValue.array([1, 2]) != .array([2, 1]))
    }

    @Test func stringsCompareByCodePoints() {
        #expect(JSONValue.string("\u{E9}") != .string("e\u{301}"))
        #expect(JSONValue.string("é") == .string("é"))
    }

    @Test func typesDoNotMix() {
        #expect(JSONValue.null != .bool(false))
        #expect(JSONValue.string("1") != .int(1))
        #expect(JSONValue.array([]) != .object(JSONObject()))
    }
}

@Suite struct JSONWriterTests {
    @Test func writesIntegersOfEveryLength() {
        var samples: [UInt64] = [0, 9, 10, 99, 100, 101, 1000, 1009, UInt64.max, UInt64.max - 1]
        var power: UInt64 = 1
        for _ in 0..<19 {
            power *= 10
            samples += [power - 1, power, power + 1, power / 2 + 7]
        }
        for value in samples {
            var out: [UInt8] = []
            out.writeDecimal(value)
            #expect(String(decoding: out, as: UTF8.self) == String(value))
        }
        var out: [UInt8] = []
        out.writeDecimal(Int64.min)
        #expect(String(decoding: out, as: UTF8.self) == String(Int64.min))
    }

    @Test(arguments: [
        #"null"#, #"true"#, #"-12"#, #"1.5"#, #"1e+100"#, #""a\"b\\c\n\u0001é😀""#, #"[1,[2,{}]]"#,
        #"{"z":1,"a":{"b":null}}"#, #"9223372036854775807"#, #"-9223372036854775808"#,
    ])
    func roundTrips(_ text: String) throws {
        let v = try JSONParser.parse(text)
        let again = try JSONParser.parse(v.jsonText)
        #expect(again == v)
        #expect(v.jsonText == (try JSONParser.parse(v.jsonText)).jsonText)
    }

    @Test func keepsMemberOrderAndEscapesControls() throws {
        #expect(try JSONParser.parse(#"{"z":1,"a":2}"#).jsonText == #"{"z":1,"a":2}"#)
        #expect(JSONValue.string("\u{1F}\t").jsonText == #""\u001f\t""#)
        #expect(JSONValue.double(1).jsonText == "1.0")
        #expect(JSONValue.number(UInt64.max).jsonText == "1.8446744073709552e+19")
    }
}

@Suite struct CanonicalJSONTests {
    static let accepted = [
        "0", "-0", "-1", "9223372036854775807", "-9223372036854775808", "9223372036854775808", "1.50", "1e2", "-0.0", "1E+2",
        #""""#, #""a""#, #""é""#, #""\u00e9""#, #""\/""#, #""\"\\\b\f\n\r\t""#, #""\ud83d\ude00""#, #""😀""#, "true", "false", "null",
        "[]", "{}", " [ 1 , 2 ] ", #"{"a":1}"#, #"{ "a" : [1, {"b": null}] , "c":"d" }"#, #"{"a":1,"a":2}"#,
        #"{"a":1,"b":2,"a":3}"#, #"[{"x":1,"x":1.0}]"#, #"{"\u0061":1,"a":2}"#, "[[[[]]]]", #"{"k":"v\u0000"}"#,
    ]
    static let refused = [
        "", " ", "01", "-", "1.", ".5", "1e", "[1,]", "{\"a\"}", "{\"a\":}", "{,}", "[", "]", "\"unterminated", "\"\u{01}\"",
        #""\x""#, #""\ud800""#, #""\udc00x""#, "tru", "nul", "[1 2]", "{\"a\":1 \"b\":2}", "1 2", "1e400", "[\"\\u12\"]",
    ]

    @Test(arguments: accepted) func canonicalBytesAreTheTreesEncoding(_ text: String) throws {
        let tree = try JSONParser.parse(text)
        let canonical = try Array(text.utf8).withUnsafeBytes { try CanonicalJSON(validating: $0) }
        #expect(String(decoding: canonical.bytes, as: UTF8.self) == tree.jsonText)
        #expect(canonical.isPlain == CanonicalJSON(tree).isPlain)
        #expect(canonical == CanonicalJSON(tree))
    }

    @Test(arguments: refused) func whatTheParserRefusesTheCanonicalizerRefuses(_ text: String) {
        #expect(throws: JSONParseError.self) { try JSONParser.parse(text) }
        #expect(throws: JSONParseError.self) { try Array(text.utf8).withUnsafeBytes { try CanonicalJSON(validating: $0) } }
    }

    @Test func equalityIsJSONEquality() throws {
        func c(_ text: String) throws -> CanonicalJSON { try Array(text.utf8).withUnsafeBytes { try CanonicalJSON(validating: $0) } }
        #expect(try c("1") == c("1.0"), "numbers by value")
        #expect(try c(#"{"a":1,"b":2}"#) == c(#"{"b":2,"a":1}"#), "objects regardless of member order")
        #expect(try c(#"{"a":1}"#) != c(#"{"a":2}"#))
        #expect(try c(#""é""#) != c(#""e\u0301""#), "strings by code points")
        #expect(try c("[1,2]") != c("[2,1]"))
        #expect(try c("-0") == c("0"))
        #expect(try c("9007199254740993") != c("9007199254740992.0"))
        #expect(try c("[1,2]").isPlain && !c("[1.5]").isPlain && !c(#"{"a":1,"b":2}"#).isPlain && c(#"{"a":{"b":1}}"#).isPlain)
    }

    @Test func deepNestingIsBoundedAsByTheParser() throws {
        let deep = String(repeating: "[", count: 600) + String(repeating: "]", count: 600)
        #expect(throws: JSONParseError.self) { try Array(deep.utf8).withUnsafeBytes { try CanonicalJSON(validating: $0) } }
        let many = "{" + (0..<5000).map { #""k\#($0)":\#($0)"# }.joined(separator: ",") + #","k7":"last"}"#
        let canonical = try Array(many.utf8).withUnsafeBytes { try CanonicalJSON(validating: $0) }
        #expect(String(decoding: canonical.bytes, as: UTF8.self) == (try JSONParser.parse(many)).jsonText, "a repeated name among thousands")
    }
}
