// End-to-end: a catch-up of a million keys to a client that reads slowly. The daemon sends it
// as the client reads it — its memory grows by the connection's queue and the catch-up's key
// list, not by a copy of the values — and every value in it is the value at the reply's
// revision, however the keys are written while it streams.

import Foundation
import ObsProtocol
import ObsValues
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(10))) struct LargeCatchUpTests {
    static let keys = 1_000_000
    static let value = String(repeating: "x", count: 200)

    /// The daemon's resident memory, in bytes.
    private func resident(_ pid: pid_t) throws -> Int {
        let status = try String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)
        guard let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmRSS:") }),
            let kb = Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "")
        else { throw TestFailure("no VmRSS in /proc/\(pid)/status") }
        return kb * 1024
    }

    @Test func aMillionKeyCatchUpStreamsToASlowReaderWithinTheQueueLimits() async throws {
        let queueBytes = 16 << 20
        let d = try await TestDaemon.start(["--history-limit", "2", "--queue-bytes", "\(queueBytes)"], inMemory: true)
        let writer = try d.connect()
        // A million keys of 200-byte values (4,096 per batch, 8 batches in flight, each line
        // written as text: a million JSON values made by the test would take minutes), then a
        // thousand of them deleted.
        let batch = 4096
        var pending = 0
        var first = 0
        while first < Self.keys {
            var line = #"{"op":"batch","repo":"big","ops":["#
            for i in first..<min(Self.keys, first + batch) {
                if i > first { line += "," }
                line += #"{"op":"set","key":"k\#(String(format: "%07d", i))","value":"\#(Self.value)"}"#
            }
            try writer.send(line + "]}")
            pending += 1
            first += batch
            if pending == 8 {
                #expect(try writer.receive(timeout: .seconds(60)).ok)
                pending -= 1
            }
        }
        for _ in 0..<pending { #expect(try writer.receive(timeout: .seconds(60)).ok) }
        let epoch = try #require(try writer.call(["op": "list", "repo": "big", "prefix": "none"])["epoch"]?.stringValue)
        let deletes = (0..<1000).map { i -> JSONValue in ["op": "delete", "key": .string(String(format: "k%07d", i * 1000))] }
        #expect(try writer.call(["op": "batch", "repo": "big", "ops": .array(deletes)]).ok)

        let before = try resident(d.process.pid)
        let reader = try RawReader(path: d.socketPath, receiveBuffer: 64 << 10)
        try reader.send(#"{"id":1,"op":"subscribe","repo":"big","since":0,"catchup":true,"epoch":"\#(epoch)"}"#)
        // While it streams, keys are written: the catch-up still holds their values at its revision.
        var written = false
        var peak = before
        var received: [UInt8] = []
        received.reserveCapacity(Self.keys * 216 + (1 << 20))
        var newlines = 0
        while newlines < 4 {  // the reply, the catch-up, `synced`, and the change of the keys written
            guard let chunk = try reader.read(max: 256 << 10) else { throw TestFailure("the daemon closed the connection") }
            received.append(contentsOf: chunk)
            newlines += chunk.count { $0 == UInt8(ascii: "\n") }
            if !written, received.count > 32 << 20 {
                written = true
                let batch: JSONValue = [
                    "op": "batch", "repo": "big", "ops": [["op": "set", "key": "k0999999", "value": "new"], ["op": "delete", "key": "k0500001"]],
                ]
                #expect(try writer.call(batch).ok)
            }
            peak = max(peak, try resident(d.process.pid))
            try await Task.sleep(for: .milliseconds(2))  // a slow reader
        }
        let growth = peak - before
        let values = Self.keys * Self.value.utf8.count
        // The queue, the key list (the keys' bytes and 16 per key) and allocator slack; a copy
        // of the values alone would be 200 MB.
        #expect(growth < queueBytes + Self.keys * 32 + (32 << 20), "obsd grew by \(growth >> 20) MiB sending \(values >> 20) MiB of values")
        let lines = received.split(separator: UInt8(ascii: "\n"))
        #expect(lines.count == 4)
        let reply = String(decoding: lines[0], as: UTF8.self)
        #expect(reply.contains(#""catchup":"diff""#), "\(reply)")
        let catchUp = lines[1]
        #expect(String(decoding: catchUp.prefix(60), as: UTF8.self).hasPrefix(#"{"event":"catchup","sub":1,"repo":"big","from":0,"#))
        // Each member is "k…":"xxx…" — and every key that exists is there once, with its value
        // at the reply's revision.
        #expect(occurrences(of: #"":"x"#, in: catchUp) == Self.keys - 1000, "every key that exists (all changed since 0), once")
        #expect(occurrences(of: #""k0999999":"xxx"#, in: catchUp) == 1 && occurrences(of: #""k0500001":"xxx"#, in: catchUp) == 1)
        #expect(occurrences(of: #""k0999999":"new""#, in: catchUp) == 0, "not the value written while it streamed")
        #expect(String(decoding: catchUp.suffix(40), as: UTF8.self).hasSuffix(#""k0998000","k0999000"]}"#))
        let synced = String(decoding: lines[2], as: UTF8.self)
        let change = String(decoding: lines[3], as: UTF8.self)
        #expect(synced.contains(#""event":"synced""#) && change.contains(#""key":"k0500001""#) && change.contains(#""key":"k0999999""#), "\(synced) \(change.prefix(300))")
    }
}

/// How many times `pattern` occurs in `bytes` (memchr and memcmp: the catch-up is 200 MB,
/// too much for a loop over its bytes in a debug build).
private func occurrences(of pattern: String, in bytes: ArraySlice<UInt8>) -> Int {
    let needle = Array(pattern.utf8)
    return bytes.withUnsafeBytes { raw in
        needle.withUnsafeBytes { n in
            var count = 0
            var at = 0
            while raw.count - at >= n.count {
                guard let found = memchr(raw.baseAddress! + at, Int32(n[0]), raw.count - at - n.count + 1) else { break }
                let offset = raw.baseAddress!.distance(to: UnsafeRawPointer(found))
                if memcmp(raw.baseAddress! + offset, n.baseAddress!, n.count) == 0 { count += 1 }
                at = offset + 1
            }
            return count
        }
    }
}

/// A socket read in chunks as the test asks (no line buffering: the catch-up is one line of
/// 200 MB).
private final class RawReader {
    private let fd: Int32

    init(path: String, receiveBuffer: Int) throws {
        fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw TestFailure("socket: \(errno)") }
        var size = Int32(receiveBuffer)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            let bytes = Array(path.utf8)
            raw.copyBytes(from: bytes.prefix(raw.count - 1))
        }
        let rc = withUnsafePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) } }
        guard rc == 0 else { throw TestFailure("connect \(path): \(errno)") }
    }

    deinit { close(fd) }

    func send(_ line: String) throws {
        let bytes = Array((line + "\n").utf8)
        guard bytes.withUnsafeBytes({ write(fd, $0.baseAddress!, $0.count) }) == bytes.count else { throw TestFailure("write: \(errno)") }
    }

    /// At most `max` bytes, waiting up to 60 s; nil at end of stream.
    func read(max: Int) throws -> [UInt8]? {
        var poll = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard Glibc.poll(&poll, 1, 60_000) == 1 else { throw TestFailure("nothing to read for 60 s") }
        var buffer = [UInt8](repeating: 0, count: max)
        let n = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress!, max) }
        guard n >= 0 else { throw TestFailure("read: \(errno)") }
        return n == 0 ? nil : Array(buffer.prefix(n))
    }
}
