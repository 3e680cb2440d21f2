// Test support: a raw protocol connection to a daemon — bytes in, JSON lines out — with a
// deadline on every read, so a missing message fails the test instead of hanging it (the
// end-to-end suites, and the cluster suites, which need every field of the contract).

import Foundation
import ObsProtocol

#if canImport(Glibc)
import Glibc
#endif

/// A test's failure with a message.
public struct TestFailure: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

public final class WireConnection: @unchecked Sendable {
    // @unchecked: used by one test task at a time; the descriptor and buffer are not shared.
    /// -1 once closed: a descriptor is closed exactly once, since closing a number twice
    /// can close whatever reused it (a client's event loop, another test's socket).
    private var fd: Int32
    private var buffer: [UInt8] = []
    private var nextID = 0
    /// Events that arrived while `call` waited for a reply; `receive` returns them first.
    private var stashed: [JSONObject] = []

    public init(path: String, receiveBuffer: Int? = nil) throws {
        // Close-on-exec: a process another test spawns must not keep this connection open.
        fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw TestFailure("socket: \(errno)") }
        if var size = receiveBuffer {
            setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        }
        let result = withUnixAddress(path, fd) { connect($0, $1, $2) }
        guard result == 0 else {
            let e = errno
            close()
            throw TestFailure("connect \(path): \(String(cString: strerror(e)))")
        }
    }

    /// The server's end of an accepted connection (a `ScriptedServer`'s).
    public init(accepted descriptor: Int32) {
        fd = descriptor
    }

    public func close() {
        guard fd >= 0 else { return }
        Glibc.close(fd)
        fd = -1
    }

    deinit { close() }

    // MARK: Sending

    public func sendRaw(_ bytes: [UInt8]) throws {
        var offset = 0
        while offset < bytes.count {
            let n = bytes[offset...].withUnsafeBytes { write(fd, $0.baseAddress!, $0.count) }
            guard n > 0 else { throw TestFailure("write failed: \(errno)") }
            offset += n
        }
    }

    public func send(_ line: String) throws { try sendRaw(Array((line + "\n").utf8)) }

    /// Shuts down the sending side (the daemon sees end of file; replies still arrive).
    public func shutdownSending() { _ = shutdown(fd, Int32(SHUT_WR)) }

    /// Sends a request object (adding an `id` when it has none) and returns its id.
    @discardableResult
    public func request(_ object: JSONValue) throws -> JSONValue {
        guard case .object(var o) = object else { throw TestFailure("request must be an object") }
        if o["id"] == nil {
            nextID += 1
            o["id"] = .int(Int64(nextID))
        }
        try send(JSONValue.object(o).jsonText)
        return o["id"]!
    }

    /// Sends a request and returns its reply, checking the id. Events that arrive before
    /// the reply (the contract allows a write's events to precede its reply) are kept for
    /// `receive`, in order.
    public func call(_ object: JSONValue, timeout: Duration = .seconds(10)) throws -> JSONObject {
        let id = try request(object)
        while true {
            let message = try read(timeout: timeout)
            if message["event"] != nil {
                stashed.append(message)
                continue
            }
            guard message["id"] == id else { throw TestFailure("reply id \(String(describing: message["id"])) does not match \(id)") }
            return message
        }
    }

    // MARK: Receiving

    /// The next message (stashed events first), waiting at most `timeout`.
    public func receive(timeout: Duration = .seconds(10)) throws -> JSONObject {
        if !stashed.isEmpty { return stashed.removeFirst() }
        return try read(timeout: timeout)
    }

    private func read(timeout: Duration) throws -> JSONObject {
        guard let line = try receiveLine(timeout: timeout) else { throw TestFailure("connection closed while waiting for a message") }
        guard case .object(let o) = try JSONParser.parse(line) else { throw TestFailure("non-object message") }
        return o
    }

    /// The next line, or `nil` at end of stream.
    public func receiveLine(timeout: Duration = .seconds(10)) throws -> [UInt8]? {
        let deadline = ContinuousClock.now + timeout
        while true {
            if let nl = buffer.firstIndex(of: 10) {
                let line = Array(buffer[..<nl])
                buffer.removeSubrange(...nl)
                return line
            }
            guard try fill(until: deadline) else { return nil }
        }
    }

    /// Reads until end of stream; returns every remaining message.
    public func receiveUntilClosed(timeout: Duration = .seconds(60)) throws -> [JSONObject] {
        var messages: [JSONObject] = []
        while let line = try receiveLine(timeout: timeout) {
            guard case .object(let o) = try JSONParser.parse(line) else { throw TestFailure("non-object message") }
            messages.append(o)
        }
        return messages
    }

    /// Reads more bytes; `false` at end of stream.
    private func fill(until deadline: ContinuousClock.Instant) throws -> Bool {
        let remaining = deadline - ContinuousClock.now
        guard remaining > .zero else { throw TestFailure("timed out waiting for the daemon") }
        var pfd = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        let ms = Int32(max(1, remaining.components.seconds * 1000 + remaining.components.attoseconds / 1_000_000_000_000_000))
        let ready = poll(&pfd, 1, ms)
        if ready < 0 {
            if errno == EINTR { return true }
            throw TestFailure("poll failed: \(errno)")
        }
        if ready == 0 { throw TestFailure("timed out waiting for the daemon") }
        var chunk = [UInt8](repeating: 0, count: 65536)
        let n = chunk.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress!, $0.count) }
        if n < 0 {
            if errno == ECONNRESET { return false }
            throw TestFailure("read failed: \(errno)")
        }
        if n == 0 { return false }
        buffer.append(contentsOf: chunk[..<n])
        return true
    }
}

extension JSONObject {
    /// The `error.code` of an error reply.
    public var errorCode: String? { self["error"]?.objectValue?["code"]?.stringValue }
    public var ok: Bool { self["ok"] == true }
    /// The message without its `id`, to compare replies to different requests.
    public var withoutID: JSONObject {
        var copy = self
        copy["id"] = nil
        return copy
    }
}
