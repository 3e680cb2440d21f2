// End-to-end test support: a Unix-socket proxy in front of a real obsd that forwards both
// ways, notes the highest `progress` revision it forwarded to a client, and cuts every
// connection on demand (the client sees end of file after everything forwarded before) —
// a connection lost at a moment the test chooses, without restarting the daemon. Its
// descriptors are shut down, never closed (a test's few stay open until the process ends):
// closing a number twice could close whatever reused it.

import Foundation
import ObsProtocol
import ObservableKit
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

final class CuttingProxy: Sendable {
    let path: String
    private let listener: Int32
    private struct State {
        var progress: UInt64 = 0
        var connections = 0
        /// The descriptors of live connections (client side, daemon side).
        var open: [(client: Int32, daemon: Int32)] = []
    }
    private let state = Locked(State())

    init(path: String, to target: String) throws {
        self.path = path
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0, withUnixAddress(path, fd, { bind($0, $1, $2) }) == 0, listen(fd, 16) == 0 else {
            throw TestFailure("cannot listen on \(path): \(errno)")
        }
        listener = fd
        let state = self.state
        Thread.detachNewThread {
            while true {
                let client = accept(fd, nil, nil)
                if client < 0 {
                    if errno == EINTR || errno == ECONNABORTED { continue }
                    break
                }
                _ = fcntl(client, F_SETFD, FD_CLOEXEC)
                let daemon = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
                guard withUnixAddress(target, daemon, { connect($0, $1, $2) }) == 0 else {
                    Glibc.close(client)
                    Glibc.close(daemon)
                    continue
                }
                state.withLock {
                    $0.connections += 1
                    $0.open.append((client, daemon))
                }
                Thread.detachNewThread { Self.pump(from: client, to: daemon, state: nil) }
                Thread.detachNewThread { Self.pump(from: daemon, to: client, state: state) }
            }
            Glibc.close(fd)
        }
    }

    /// The highest revision of a `progress` event forwarded to a client.
    var progress: UInt64 { state.withLock { $0.progress } }
    /// The connections accepted so far.
    var connections: Int { state.withLock { $0.connections } }

    /// Cuts every live connection: each client reads what was forwarded, then end of file.
    func cut() {
        let open = state.withLock { s in
            defer { s.open = [] }
            return s.open
        }
        for (client, daemon) in open {
            shutdown(client, Int32(SHUT_RDWR))
            shutdown(daemon, Int32(SHUT_RDWR))
        }
    }

    func stop() {
        shutdown(listener, Int32(SHUT_RDWR))
        cut()
    }

    /// Copies bytes until either side ends; from the daemon, notes `progress` events per line.
    private static func pump(from source: Int32, to sink: Int32, state: Locked<State>?) {
        var buffer = [UInt8](repeating: 0, count: 65536)
        var line: [UInt8] = []
        while true {
            let n = buffer.withUnsafeMutableBytes { read(source, $0.baseAddress!, $0.count) }
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { break }
            if let state {
                for byte in buffer[..<n] {
                    guard byte == 10 else {
                        line.append(byte)
                        continue
                    }
                    if let o = try? JSONParser.parse(String(decoding: line, as: UTF8.self)).objectValue, o["event"] == "progress",
                        let rev = o["rev"]?.uint64Value
                    {
                        state.withLock { $0.progress = max($0.progress, rev) }
                    }
                    line.removeAll(keepingCapacity: true)
                }
            }
            var offset = 0
            while offset < n {
                let w = buffer[offset..<n].withUnsafeBytes { write(sink, $0.baseAddress!, $0.count) }
                if w <= 0 { break }
                offset += w
            }
            if offset < n { break }
        }
        shutdown(sink, Int32(SHUT_WR))
        shutdown(source, Int32(SHUT_RD))
    }
}
