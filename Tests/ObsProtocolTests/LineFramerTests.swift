// Tests of the line framer: every fragmentation, CR tolerance, empty lines, and the
// max-line rule (error as soon as the limit is crossed, rest discarded, stream usable).

import ObsProtocol
import Testing

/// What the framer produced, in a comparable form.
enum Out: Equatable, CustomStringConvertible {
    case line(String)
    case tooLarge
    var description: String {
        switch self {
        case .line(let s): return "line(\(s.debugDescription))"
        case .tooLarge: return "tooLarge"
        }
    }
}

func frame(_ chunks: [[UInt8]], maxLine: Int) -> [Out] {
    var framer = LineFramer(maxLine: maxLine)
    var out: [Out] = []
    for chunk in chunks {
        chunk.withUnsafeBytes { raw in
            framer.feed(raw) { frame in
                switch frame {
                case .line(let bytes): out.append(.line(String(decoding: bytes, as: UTF8.self)))
                case .tooLarge: out.append(.tooLarge)
                }
            }
        }
    }
    return out
}

/// Every way to split `input` into two or three chunks, plus byte-at-a-time.
func fragmentations(_ input: [UInt8]) -> [[[UInt8]]] {
    var result: [[[UInt8]]] = [[input], input.map { [$0] }]
    for i in 0...input.count {
        result.append([Array(input[..<i]), Array(input[i...])])
        for j in i...input.count {
            result.append([Array(input[..<i]), Array(input[i..<j]), Array(input[j...])])
        }
    }
    return result
}

@Suite struct LineFramerTests {
    @Test func splitsLinesInEveryFragmentation() {
        let input = Array("{\"a\":1}\n\r\n\n{\"b\":2}\r\nxy\n".utf8)
        for chunks in fragmentations(input) {
            #expect(frame(chunks, maxLine: 64) == [.line("{\"a\":1}"), .line("{\"b\":2}"), .line("xy")], "\(chunks)")
        }
    }

    @Test func lineAtTheLimitPassesAndOneByteMoreDoesNot() {
        let exact = Array(repeating: UInt8(ascii: "a"), count: 8)
        for chunks in fragmentations(exact + [10] + exact + [UInt8(ascii: "a"), 10, UInt8(ascii: "b"), 10]) {
            #expect(frame(chunks, maxLine: 8) == [.line("aaaaaaaa"), .tooLarge, .line("b")], "\(chunks)")
        }
    }

    @Test func crCountsTowardsTheLimit() {
        #expect(frame([Array("aaaaaaaa\r\n".utf8)], maxLine: 8) == [.tooLarge])
        #expect(frame([Array("aaaaaaa\r\n".utf8)], maxLine: 8) == [.line("aaaaaaa")])
    }

    @Test func reportsOverlongLineBeforeItsNewlineAndOnlyOnce() {
        var framer = LineFramer(maxLine: 16)
        var out: [Out] = []
        let chunk = Array(repeating: UInt8(ascii: "x"), count: 10)
        for _ in 0..<1000 {
            chunk.withUnsafeBytes { raw in
                framer.feed(raw) { f in if case .tooLarge = f { out.append(.tooLarge) } }
            }
            #expect(framer.bufferedBytes <= 16)
        }
        #expect(out == [.tooLarge])
        #expect(framer.isDiscarding)
        Array("tail\n{\"ok\":1}\n".utf8).withUnsafeBytes { raw in
            framer.feed(raw) { f in if case .line(let b) = f { out.append(.line(String(decoding: b, as: UTF8.self))) } }
        }
        #expect(out == [.tooLarge, .line("{\"ok\":1}")])
    }

    @Test func partialLineIsHeldUntilItsNewline() {
        #expect(frame([Array("abc".utf8)], maxLine: 8) == [])
        #expect(frame([Array("abc".utf8), Array("def\n".utf8)], maxLine: 8) == [.line("abcdef")])
    }
}
