// End-to-end test support: a Unix-socket server that a test scripts, standing in for a
// daemon in the ways the real one cannot be made to misbehave on demand — accepting and
// closing at once, or losing a connection between a reply and the event that follows it.
// It accepts on a thread of its own and serves each connection on another, through the
// test's closure and a `WireConnection` (whose reads all have deadlines).

import Foundation
import ObsProtocol
import ObservableKit
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

final class ScriptedServer: Sendable {
    let path: String
    private let listener: Int32
    private let accepted = Locked<Int>(0)

    /// Listens on `path`; `serve` gets each connection with its number (0 for the first),
    /// on a thread of its own, and the connection is closed when it returns.
    init(path: String, serve: @escaping @Sendable (_ index: Int, _ connection: WireConnection) throws -> Void) throws {
        self.path = path
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw TestFailure("socket: \(errno)") }
        guard withUnixAddress(path, fd, { bind($0, $1, $2) }) == 0, listen(fd, 64) == 0 else {
            let e = errno
            Glibc.close(fd)
            throw TestFailure("cannot listen on \(path): \(String(cString: strerror(e)))")
        }
        listener = fd
        let accepted = self.accepted
        Thread.detachNewThread {
            while true {
                let client = accept(fd, nil, nil)
                if client < 0 {
                    if errno == EINTR || errno == ECONNABORTED { continue }
                    break  // `stop()` shut the listener down
                }
                _ = fcntl(client, F_SETFD, FD_CLOEXEC)  // (ChildProcess closes inherited descriptors anyway)
                let index = accepted.withLock { count in
                    defer { count += 1 }
                    return count
                }
                let connection = WireConnection(accepted: client)
                Thread.detachNewThread {
                    try? serve(index, connection)
                    connection.close()
                }
            }
            Glibc.close(fd)  // here, once accept returned for good: never a number another test reuses
        }
    }

    /// The number of connections accepted so far.
    var connections: Int { accepted.withLock { $0 } }

    /// Stops accepting (connections being served go on until their closures return).
    func stop() {
        _ = shutdown(listener, Int32(SHUT_RDWR))
    }
}

extension WireConnection {
    /// Answers the request `request` (as read with `receive`) with `ok` and `members`.
    func reply(to request: JSONObject, _ members: [(String, JSONValue)] = []) throws {
        var reply = JSONObject(uniqueMembers: [(name: "id", value: request["id"] ?? .null), (name: "ok", value: true)])
        for (name, value) in members { reply[name] = value }
        try send(JSONValue.object(reply).jsonText)
    }

    /// Answers `request` with the error `code`.
    func refuse(_ request: JSONObject, _ code: ErrorCode, _ message: String) throws {
        let error: JSONValue = .object(JSONObject(uniqueMembers: [(name: "code", value: .string(code.rawValue)), (name: "message", value: .string(message))]))
        let reply = JSONObject(uniqueMembers: [(name: "id", value: request["id"] ?? .null), (name: "ok", value: false), (name: "error", value: error)])
        try send(JSONValue.object(reply).jsonText)
    }
}
