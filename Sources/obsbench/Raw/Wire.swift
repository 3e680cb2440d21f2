// obsbench — the two protocols the load generator speaks, reduced to what it checks:
// - requests encoded once per key ahead of the run (everything before the value), so a
//   request costs a copy and a few digits;
// - a scanner that finds the next frame in received bytes, says what it is and pulls out
//   its one number — no JSON tree, no RESP object, no allocation.
// obsd: line-delimited JSON (shared contract, docs/PROTOCOL.md); lines found with memchr,
// an event recognised by its first bytes, its value read after `"new":`.
// Redis: RESP2 replies and pushes (SUBSCRIBE, PUBLISH, SET), walked by their length prefixes.

#if canImport(Glibc)
import Glibc
#endif

enum Dialect: Sendable {
    case obsd, redis
}

/// What one received frame is.
enum Frame: Equatable {
    /// The bytes end inside the frame: read more.
    case incomplete
    /// An empty line (obsd allows them): nothing.
    case blank
    /// A success reply: obsd `"ok":true`, RESP `+OK`, a SUBSCRIBE confirmation.
    case ok
    /// A RESP integer reply (PUBLISH: how many subscribers got the message).
    case integer(Int)
    /// An event with its value: an obsd `change` (`"new":N`), a RESP `message` (payload N).
    case value(Int)
    /// The obsd `overflow` event: the server let this connection go.
    case overflow
    /// An error reply or anything a benchmark connection should never get.
    case unexpected
}

/// A frame and where the next one starts.
struct Scanned {
    let frame: Frame
    let next: UnsafePointer<UInt8>
}

enum Wire {
    /// The next frame in `p..<end`.
    @inline(__always)
    static func scan(_ dialect: Dialect, _ p: UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>) -> Scanned {
        dialect == .obsd ? scanLine(p, end) : scanRESP(p, end)
    }

    // MARK: obsd lines

    @inline(__always)
    static func scanLine(_ p: UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>) -> Scanned {
        guard p < end, let newline = memchr(p, 0x0A, end - p) else { return Scanned(frame: .incomplete, next: p) }
        var last = UnsafePointer(newline.assumingMemoryBound(to: UInt8.self))
        let next = last + 1
        if last > p && last[-1] == 0x0D { last -= 1 }
        return Scanned(frame: classifyLine(p, last), next: next)
    }

    @inline(__always)
    static func classifyLine(_ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>) -> Frame {
        let n = e - p
        if n == 0 { return .blank }
        if starts(p, e, #"{"event":""#) {
            if starts(p + 10, e, #"change""#) {
                guard let value = newValue(p, e) else { return .unexpected }
                return .value(value)
            }
            return starts(p + 10, e, #"overflow""#) ? .overflow : .unexpected
        }
        return isSuccess(p, e) ? .ok : .unexpected
    }

    @inline(__always)
    static func starts(_ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>, _ prefix: StaticString) -> Bool {
        let n = prefix.utf8CodeUnitCount
        return e - p >= n && memcmp(p, prefix.utf8Start, n) == 0
    }

    /// The first occurrence of `needle` in `p..<e`.
    static func find(_ needle: StaticString, _ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>) -> UnsafePointer<UInt8>? {
        let n = needle.utf8CodeUnitCount
        let first = Int32(needle.utf8Start[0])
        var q = p
        while e - q >= n {
            guard let hit = memchr(q, first, e - q) else { return nil }
            let h = UnsafePointer(hit.assumingMemoryBound(to: UInt8.self))
            if e - h < n { return nil }
            if memcmp(h, needle.utf8Start, n) == 0 { return h }
            q = h + 1
        }
        return nil
    }

    /// A reply's `"ok":true`. Our requests carry no id or a number, so the first `"ok":`
    /// is the reply's own; obsd writes it right after `{"id":null,`, tried first.
    @inline(__always)
    static func isSuccess(_ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>) -> Bool {
        if starts(p, e, #"{"id":null,"ok":"#) { return starts(p + 16, e, "true") }
        guard let ok = find(#""ok":"#, p, e) else { return false }
        return starts(ok + 5, e, "true")
    }

    /// The unsigned integer after `"new":` in a `change` event of one change. obsd ends
    /// such an event with `"new":N}]}`, read from the end; any other layout is searched.
    @inline(__always)
    static func newValue(_ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>) -> Int? {
        if e - p > 10, e[-1] == 0x7D, e[-2] == 0x5D, e[-3] == 0x7D {  // }]}
            var q = e - 3
            while q - p > 6, q[-1] &- 48 < 10 { q -= 1 }
            if q < e - 3, q - p >= 6, starts(q - 6, e, #""new":"#) {
                return digitsValue(q, e - 3)
            }
        }
        guard let marker = find(#""new":"#, p, e) else { return nil }
        var q = marker + 6
        let start = q
        while q < e, q[0] &- 48 < 10 { q += 1 }
        return digitsValue(start, q)
    }

    /// The value of the decimal digits `p..<e` (1 to 18 of them).
    @inline(__always)
    static func digitsValue(_ p: UnsafePointer<UInt8>, _ e: UnsafePointer<UInt8>) -> Int? {
        let n = e - p
        guard n > 0, n <= 18 else { return nil }
        var value = 0
        for i in 0..<n {
            let d = p[i] &- 48
            guard d < 10 else { return nil }
            value = value &* 10 &+ Int(d)
        }
        return value
    }

    // MARK: RESP2

    private enum Number {
        case value(Int), incomplete, malformed
    }

    /// `[-]digits\r\n` at `c`; on success `c` moves past it.
    @inline(__always)
    private static func number(_ c: inout UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>) -> Number {
        var q = c
        let negative = q < end && q[0] == 0x2D
        if negative { q += 1 }
        let start = q
        var value = 0
        while q < end, q[0] &- 48 < 10 {
            value = value &* 10 &+ Int(q[0] &- 48)
            q += 1
        }
        if end - q < 2 { return .incomplete }
        guard q > start, q - start <= 18, q[0] == 0x0D, q[1] == 0x0A else { return .malformed }
        c = q + 2
        return .value(negative ? -value : value)
    }

    private enum Bulk {
        case bytes(UnsafePointer<UInt8>, Int), incomplete, malformed
    }

    /// `$L\r\n` then L bytes and `\r\n` at `c`: the bytes; `c` moves past them.
    @inline(__always)
    private static func bulk(_ c: inout UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>) -> Bulk {
        guard c < end else { return .incomplete }
        guard c[0] == 0x24 else { return .malformed }  // `$`
        var q = c + 1
        switch number(&q, end) {
        case .incomplete: return .incomplete
        case .malformed: return .malformed
        case .value(let length):
            guard length >= 0 else { return .malformed }
            if end - q < length &+ 2 { return .incomplete }
            guard q[length] == 0x0D, q[length &+ 1] == 0x0A else { return .malformed }
            c = q + length + 2
            return .bytes(q, length)
        }
    }

    @inline(__always)
    private static func equals(_ p: UnsafePointer<UInt8>, _ n: Int, _ text: StaticString) -> Bool {
        n == text.utf8CodeUnitCount && memcmp(p, text.utf8Start, n) == 0
    }

    @inline(__always)
    static func scanRESP(_ p: UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>) -> Scanned {
        let incomplete = Scanned(frame: .incomplete, next: p)
        let malformed = Scanned(frame: .unexpected, next: end)
        guard p < end else { return incomplete }
        var c = p + 1
        switch p[0] {
        case 0x3A:  // `:` integer
            switch number(&c, end) {
            case .value(let n): return Scanned(frame: .integer(n), next: c)
            case .incomplete: return incomplete
            case .malformed: return malformed
            }
        case 0x2B, 0x2D:  // `+` simple string, `-` error
            guard let newline = memchr(c, 0x0A, end - c) else { return incomplete }
            let next = UnsafePointer(newline.assumingMemoryBound(to: UInt8.self)) + 1
            return Scanned(frame: p[0] == 0x2B && starts(p, end, "+OK\r") ? .ok : .unexpected, next: next)
        case 0x2A:  // `*` a push: ["message", channel, payload] or ["subscribe", channel, count]
            switch number(&c, end) {
            case .incomplete: return incomplete
            case .malformed: return malformed
            case .value(let n): if n != 3 { return malformed }
            }
            let kind: (UnsafePointer<UInt8>, Int)
            switch bulk(&c, end) {
            case .incomplete: return incomplete
            case .malformed: return malformed
            case .bytes(let b, let n): kind = (b, n)
            }
            switch bulk(&c, end) {  // the channel: one per connection, not checked
            case .incomplete: return incomplete
            case .malformed: return malformed
            case .bytes: break
            }
            if equals(kind.0, kind.1, "message") {
                switch bulk(&c, end) {
                case .incomplete: return incomplete
                case .malformed: return malformed
                case .bytes(let b, let n):
                    guard let value = digitsValue(b, b + n) else { return Scanned(frame: .unexpected, next: c) }
                    return Scanned(frame: .value(value), next: c)
                }
            }
            guard equals(kind.0, kind.1, "subscribe") else { return malformed }
            guard c < end else { return incomplete }
            guard c[0] == 0x3A else { return malformed }
            c += 1
            switch number(&c, end) {
            case .value: return Scanned(frame: .ok, next: c)
            case .incomplete: return incomplete
            case .malformed: return malformed
            }
        default:
            return malformed
        }
    }
}

/// Write requests for a fixed set of keys, each encoded up to its value once, at start.
struct RequestTable: ~Copyable {
    enum Verb {
        /// obsd `set`, or Redis `PUBLISH` to the key as a channel.
        case publish
        /// obsd `set`, or Redis `SET`.
        case set
    }

    let dialect: Dialect
    let keyCount: Int
    private var arena: Bytes
    /// Key i's request head is arena[offsets[i] ..< offsets[i + 1]].
    private let offsets: UnsafeMutablePointer<Int>

    init(dialect: Dialect, verb: Verb, repo: String, keys: [String]) {
        self.dialect = dialect
        keyCount = keys.count
        arena = Bytes(capacity: keys.count * 48)
        offsets = .allocate(capacity: keys.count + 1)
        for (i, key) in keys.enumerated() {
            offsets[i] = arena.count
            let head: String
            switch (dialect, verb) {
            case (.obsd, _): head = #"{"op":"set","repo":"\#(repo)","key":"\#(key)","value":"#
            case (.redis, .publish): head = "*3\r\n$7\r\nPUBLISH\r\n$\(key.utf8.count)\r\n\(key)\r\n"
            case (.redis, .set): head = "*3\r\n$3\r\nSET\r\n$\(key.utf8.count)\r\n\(key)\r\n"
            }
            arena.append(Array(head.utf8))
        }
        offsets[keys.count] = arena.count
    }

    deinit {
        arena.release()
        offsets.deallocate()
    }

    /// Appends the request writing `value` (≥ 0) to key number `key`.
    @inline(__always)
    func appendWrite(key: Int, value: Int, into out: inout Bytes) {
        let start = offsets[key]
        let headLength = offsets[key &+ 1] &- start
        let digits = decimalDigits(value)
        out.reserve(headLength &+ digits &+ 16)
        var o = out.base + out.count
        o.update(from: arena.base + start, count: headLength)
        o += headLength
        if dialect == .redis {
            o[0] = 0x24  // $
            let lengthDigits = decimalDigits(digits)
            writeDecimal(digits, digits: lengthDigits, at: o + 1)
            o += 1 &+ lengthDigits
            o[0] = 0x0D
            o[1] = 0x0A
            writeDecimal(value, digits: digits, at: o + 2)
            o += 2 &+ digits
            o[0] = 0x0D
            o[1] = 0x0A
            o += 2
        } else {
            writeDecimal(value, digits: digits, at: o)
            o += digits
            o[0] = 0x7D  // }
            o[1] = 0x0A
            o += 2
        }
        out.count = o - out.base
    }

    /// The request subscribing to `key` (one key; for obsd, in `repo`).
    static func subscribe(_ dialect: Dialect, repo: String, key: String) -> [UInt8] {
        switch dialect {
        case .obsd: Array((#"{"id":1,"op":"subscribe","repo":"\#(repo)","keys":["\#(key)"]}"# + "\n").utf8)
        case .redis: Array("*2\r\n$9\r\nSUBSCRIBE\r\n$\(key.utf8.count)\r\n\(key)\r\n".utf8)
        }
    }
}
