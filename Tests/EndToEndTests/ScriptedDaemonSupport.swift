// End-to-end test support: the pieces a `ScriptedServer` script of a daemon is made of —
// answering a session's `hello`, reading the next request as the test expects it (a
// mismatch fails the script, and so the test, with what arrived), serving what follows until
// the client closes, and the lines of events written as the contract spells them. Used by
// the catch-up and sync tests of the client library and obsctl, which need every form of
// resume (a replay, a diff, a snapshot, an older daemon's `compacted`) on demand.
//
// A script runs with SIGPIPE blocked on its thread (`scriptedServer`): a client may close
// its connection while the script still writes (obsctl ends after `--once` and sends an
// `unsubscribe` as it goes), and a write to it must fail the script, not kill the test run.

import Foundation
import ObsProtocol
import ObservableKit
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A `ScriptedServer` on `path` whose scripts run with SIGPIPE blocked on their threads (a
/// write to a connection the client closed fails with EPIPE instead).
func scriptedServer(path: String, _ serve: @escaping @Sendable (_ index: Int, _ connection: WireConnection) throws -> Void) throws -> ScriptedServer {
    try ScriptedServer(path: path) { index, connection in
        var pipe = sigset_t()
        sigemptyset(&pipe)
        sigaddset(&pipe, SIGPIPE)
        var old = sigset_t()
        pthread_sigmask(SIG_BLOCK, &pipe, &old)
        defer {
            // A SIGPIPE a failed write left pending on this thread is taken before unblocking.
            var pending = sigset_t()
            sigpending(&pending)
            if sigismember(&pending, SIGPIPE) == 1 {
                var taken: Int32 = 0
                sigwait(&pipe, &taken)
            }
            pthread_sigmask(SIG_SETMASK, &old, nil)
        }
        try serve(index, connection)
    }
}

extension WireConnection {
    /// Answers the `hello` an `ObsSession` starts each connection with.
    func greet() throws {
        let hello = try receive()
        guard hello["op"] == "hello" else { throw TestFailure("expected hello, got \(JSONValue.object(hello).jsonText)") }
        try reply(to: hello, [("protocol", 1), ("server", "obsd/scripted"), ("maxLine", 1_048_576)])
    }

    /// The next request, which must be op `op` (see `require`).
    func expect(_ op: String, timeout: Duration = .seconds(30)) throws -> JSONObject {
        let request = try receive(timeout: timeout)
        try require(request, request["op"]?.stringValue == op, "expected \(op)")
        return request
    }

    /// Fails the script unless `condition` holds for `request` — refusing the request with
    /// `forbidden` first, so that the client under test fails at once with `what` (a watch
    /// or obsctl ends, a mirror records it) rather than waiting for the test's time limit.
    func require(_ request: JSONObject, _ condition: Bool, _ what: String) throws {
        guard !condition else { return }
        let failure = "script: \(what), got \(JSONValue.object(request).jsonText)"
        try? refuse(request, .forbidden, failure)
        throw TestFailure(failure)
    }

    /// Serves the requests that follow until the client closes the connection: each one
    /// `handle` does not take (false) is answered `ok` (an `unsubscribe` as the client ends).
    func serveUntilClosed(_ handle: (JSONObject) throws -> Bool = { _ in false }) throws {
        while let line = try receiveLine(timeout: .seconds(150)) {
            guard case .object(let request) = try JSONParser.parse(line) else { throw TestFailure("a request that is not an object") }
            if try !handle(request) { try reply(to: request) }
        }
    }

    /// Sends `lines` in one write: a client that ends the connection once it has read some
    /// of them (obsctl with --once) cannot make a later write of the script fail (SIGPIPE).
    func send(lines: [String]) throws {
        try sendRaw(Array(lines.map { $0 + "\n" }.joined().utf8))
    }

    func sendChange(sub: UInt64 = 1, repo: String, rev: UInt64, _ key: String, old: JSONValue? = nil, new value: JSONValue?) throws {
        try send(ScriptedEvent.change(sub: sub, repo: repo, rev: rev, key, old: old, new: value))
    }

    func sendSnapshot(sub: UInt64 = 1, repo: String, rev: UInt64, _ values: [(String, JSONValue)]) throws {
        try send(ScriptedEvent.snapshot(sub: sub, repo: repo, rev: rev, values))
    }

    func sendCatchUp(sub: UInt64 = 1, repo: String, from: UInt64, rev: UInt64, values: [(String, JSONValue)], deleted: [String]) throws {
        try send(ScriptedEvent.catchUp(sub: sub, repo: repo, from: from, rev: rev, values: values, deleted: deleted))
    }

    func sendPosition(_ event: String, sub: UInt64 = 1, repo: String, rev: UInt64) throws {
        try send(ScriptedEvent.position(event, sub: sub, repo: repo, rev: rev))
    }
}

/// Event lines as the contract spells them.
enum ScriptedEvent {
    static func line(_ members: [(String, JSONValue)]) -> String {
        JSONValue.object(JSONObject(uniqueMembers: members.map { (name: $0.0, value: $0.1) })).jsonText
    }

    /// `{"event":"change","sub":…,"repo":…,"rev":…,"changes":[{"key":…,"old":…,"new":…}]}` (nil: absent).
    static func change(sub: UInt64 = 1, repo: String, rev: UInt64, _ key: String, old: JSONValue? = nil, new value: JSONValue?) -> String {
        var change: [(name: String, value: JSONValue)] = [(name: "key", value: .string(key))]
        if let old { change.append((name: "old", value: old)) }
        if let value { change.append((name: "new", value: value)) }
        return line([("event", "change"), ("sub", .number(sub)), ("repo", .string(repo)), ("rev", .number(rev)), ("changes", [.object(JSONObject(uniqueMembers: change))])])
    }

    static func snapshot(sub: UInt64 = 1, repo: String, rev: UInt64, _ values: [(String, JSONValue)]) -> String {
        let object = JSONObject(uniqueMembers: values.map { (name: $0.0, value: $0.1) })
        return line([("event", "snapshot"), ("sub", .number(sub)), ("repo", .string(repo)), ("rev", .number(rev)), ("values", .object(object))])
    }

    static func catchUp(sub: UInt64 = 1, repo: String, from: UInt64, rev: UInt64, values: [(String, JSONValue)], deleted: [String]) -> String {
        let object = JSONObject(uniqueMembers: values.map { (name: $0.0, value: $0.1) })
        return line([
            ("event", "catchup"), ("sub", .number(sub)), ("repo", .string(repo)), ("from", .number(from)), ("rev", .number(rev)),
            ("values", .object(object)), ("deleted", .array(deleted.map { .string($0) })),
        ])
    }

    /// `synced` or `progress`.
    static func position(_ event: String, sub: UInt64 = 1, repo: String, rev: UInt64) -> String {
        line([("event", .string(event)), ("sub", .number(sub)), ("repo", .string(repo)), ("rev", .number(rev))])
    }
}

/// What a script saw, for the test to check afterwards.
final class ScriptLog: Sendable {
    private let requests = Locked<[JSONObject]>([])

    func record(_ request: JSONObject) { requests.withLock { $0.append(request) } }
    var all: [JSONObject] { requests.withLock { $0 } }
    /// The requests of op `op`, in order.
    func of(_ op: String) -> [JSONObject] { all.filter { $0["op"]?.stringValue == op } }
}

/// A script's socket path in a fresh directory.
func scriptedSocketPath() -> String { TestDaemon.makeTemporaryDirectory() + "/obsd.sock" }
