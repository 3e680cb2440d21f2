// ObsProtocol — splitting a byte stream into protocol lines.
//
// The contract's framing rules: a message is one line ended by `\n`; a `\r` before the
// `\n` is dropped; empty lines are ignored; a line longer than the limit (bytes before
// the `\n`) is reported once, as soon as it crosses the limit — so a client that never
// sends the newline still gets its error — and the rest of it is discarded up to the
// next `\n`. Memory stays bounded by the limit whatever the input. Used by the daemon
// and the client; independent of any networking library.

#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

/// Splits a byte stream into lines, enforcing a maximum line length.
public struct LineFramer: Sendable {
    /// A complete line, or the notice that a line exceeded the limit.
    public enum Frame {
        /// A line without its `\n` and optional `\r`. Valid only during the callback.
        case line(UnsafeRawBufferPointer)
        /// A line exceeded `maxLine`; it is being discarded up to its `\n`.
        case tooLarge
    }

    /// The longest accepted line, in bytes before the `\n`.
    public let maxLine: Int
    private var partial: [UInt8] = []
    private var discarding = false

    public init(maxLine: Int) {
        precondition(maxLine > 0, "maxLine must be positive")
        self.maxLine = maxLine
    }

    /// Bytes of an incomplete line held back, waiting for its end.
    public var bufferedBytes: Int { partial.count }

    /// Whether the framer is discarding the rest of an over-long line.
    public var isDiscarding: Bool { discarding }

    /// Feeds the next chunk of the stream; calls `body` for every frame it completes, in order.
    public mutating func feed(_ chunk: UnsafeRawBufferPointer, _ body: (Frame) throws -> Void) rethrows {
        guard let base = chunk.baseAddress?.assumingMemoryBound(to: UInt8.self) else { return }
        let count = chunk.count
        var start = 0
        while start < count {
            let newline = Self.findNewline(base + start, count - start).map { $0 + start }
            guard let end = newline else {
                try absorbTail(UnsafeRawBufferPointer(start: base + start, count: count - start), body)
                return
            }
            let segment = UnsafeRawBufferPointer(start: base + start, count: end - start)
            start = end + 1
            if discarding {
                discarding = false
                continue
            }
            if partial.isEmpty {
                if segment.count > maxLine {
                    try body(.tooLarge)
                } else {
                    try Self.emit(segment, body)
                }
            } else if partial.count + segment.count > maxLine {
                partial.removeAll(keepingCapacity: false)
                try body(.tooLarge)
            } else {
                partial.append(contentsOf: segment)
                defer { partial.removeAll(keepingCapacity: partial.capacity <= 64 * 1024) }
                try partial.withUnsafeBytes { try Self.emit($0, body) }
            }
        }
    }

    /// Ends the stream: a last line that its sender ended with the stream instead of a `\n`
    /// is complete too, and goes to `body` like any other.
    public mutating func finish(_ body: (Frame) throws -> Void) rethrows {
        defer {
            partial.removeAll(keepingCapacity: false)
            discarding = false
        }
        guard !discarding, !partial.isEmpty else { return }
        try partial.withUnsafeBytes { try Self.emit($0, body) }
    }

    /// Handles bytes after the last newline of a chunk.
    private mutating func absorbTail(_ tail: UnsafeRawBufferPointer, _ body: (Frame) throws -> Void) rethrows {
        if discarding { return }
        if partial.count + tail.count > maxLine {
            partial.removeAll(keepingCapacity: false)
            discarding = true
            try body(.tooLarge)
        } else {
            partial.append(contentsOf: tail)
        }
    }

    private static func emit(_ line: UnsafeRawBufferPointer, _ body: (Frame) throws -> Void) rethrows {
        var n = line.count
        if n > 0, line[n - 1] == UInt8(ascii: "\r") { n -= 1 }
        if n == 0 { return }
        try body(.line(UnsafeRawBufferPointer(rebasing: line[..<n])))
    }

    private static func findNewline(_ p: UnsafePointer<UInt8>, _ n: Int) -> Int? {
        guard let hit = memchr(p, 0x0A, n) else { return nil }
        return UnsafeRawPointer(hit) - UnsafeRawPointer(p)
    }
}
