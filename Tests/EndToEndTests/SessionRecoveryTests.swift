// End-to-end tests of how an ObsSession and its watches recover from the connections a
// daemon accepts but does not serve: a refusal at `max-connections` (a real obsd) is retried
// with backoff while watches, mirrors and the example program carry on; a daemon that
// accepts and closes at once (a scripted server) meets a backoff that grows, with the real
// reason published; and a connection lost between a resync's reply and its snapshot
// resumes in the history its position belongs to.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct SessionRecoveryTests {
    @Test @MainActor func aRefusedConnectionIsRetriedAndWatchesAndMirrorsCarryOn() async throws {
        let d = try await TestDaemon.start(["--max-connections", "1"], inMemory: true)
        let holder = try await admittedConnection(d)  // the one connection the daemon admits
        _ = try holder.call(["op": "set", "repo": "r", "key": "k", "value": 1])
        let session = ObsSession(socketPath: d.socketPath, backoff: Backoff(initial: .milliseconds(20), maximum: .milliseconds(200)))
        let states = StateRecorder(session)
        let mirror = RemoteRepository("r", session: session)
        let watching = Task { () async throws -> [WatchEvent] in
            var events = session.watch("r", initial: true).makeAsyncIterator()
            var seen: [WatchEvent] = []
            while seen.count < 2, let event = try await events.next() { seen.append(event) }
            return seen
        }
        try await states.wait { state in
            guard case .waiting(_, let reason) = state else { return false }
            return reason == "too many connections (limit 1) (overloaded)"
        }
        try await waitForRefusals(holder, atLeast: 3)
        #expect(mirror.failure == nil && !mirror.contents.isLoaded)

        holder.close()  // the slot frees: the next attempt is admitted
        try await until("the mirror loads") { mirror.contents.isLoaded }
        #expect(mirror.values == ["k": 1] && mirror.failure == nil)
        #expect(try await mirror.set("k", to: 2) == .applied(revision: 2))
        let events = try await watching.value
        guard events.count == 2, case .snapshot(1, let values, false) = events[0], case .change(let change) = events[1] else {
            throw TestFailure("expected the snapshot and the change, got \(events)")
        }
        #expect(values == ["k": 1] && change.revision == 2 && change.changes.first?.new == 2)
        await session.close()
    }

    @Test func theExampleProgramWaitsOutARefusal() async throws {
        let d = try await TestDaemon.start(["--max-connections", "1"], inMemory: true)
        let holder = try await admittedConnection(d)
        _ = try holder.call(["op": "set", "repo": "ui", "key": "theme", "value": "dark"])
        let example = try LineReadingProcess(BuildProducts.path("obs-mirror"), ["ui", "--socket", d.socketPath, "--count", "1"])
        try await waitForRefusals(holder, atLeast: 3)
        holder.close()
        #expect(try example.line() == #"rev 1: {"theme":"dark"}"#)
        #expect(example.waitForExit() == 0)
    }

    @Test func theBackoffGrowsWhileTheDaemonAcceptsAndClosesAtOnce() async throws {
        let path = TestDaemon.makeTemporaryDirectory() + "/obsd.sock"
        let server = try ScriptedServer(path: path) { _, _ in }  // every connection closed at once
        defer { server.stop() }
        let session = ObsSession(socketPath: path, backoff: Backoff(initial: .milliseconds(10), maximum: .seconds(10), jitter: 0))
        let states = StateRecorder(session)
        for _ in 0..<6 { try await states.wait { if case .waiting = $0 { true } else { false } } }
        await session.close()
        let waits = states.states.compactMap { state -> (Duration, String)? in
            if case .waiting(let delay, let reason) = state { (delay, reason) } else { nil }
        }.prefix(6)
        #expect(waits.map(\.0) == [10, 20, 40, 80, 160, 320].map { .milliseconds($0) }, "every attempt failed: the delay doubles")
        #expect(waits.allSatisfy { $0.1 == "the connection to obsd at \(path) was closed" }, "\(waits.map(\.1))")
        #expect(server.connections >= 6)
    }

    @Test func aConnectionLostBetweenAResyncAndItsSnapshotResyncsAgain() async throws {
        let path = TestDaemon.makeTemporaryDirectory() + "/obsd.sock"
        let resumes = Locked<[JSONObject]>([])  // the subscribe requests after the lost resync
        let server = try ScriptedServer(path: path) { index, connection in
            let hello = try connection.receive()
            try connection.reply(to: hello, [("protocol", 1), ("server", "scripted"), ("maxLine", 1_048_576)])
            switch index {
            case 0:  // history A, at revision 5; then the connection is lost
                let subscribe = try connection.receive()
                try connection.reply(to: subscribe, [("sub", 1), ("rev", 5), ("epoch", "A")])
                try connection.send(#"{"event":"snapshot","sub":1,"repo":"r","rev":5,"values":{"k":"a5"}}"#)
            case 1:  // restarted with history B at revision 9: lost after the resync's reply, before its snapshot
                let resume = try connection.receive()
                try connection.refuse(resume, .compacted, "another history")
                let resync = try connection.receive()
                try connection.reply(to: resync, [("sub", 1), ("rev", 9), ("epoch", "B")])
            default:
                var request = try connection.receive()
                resumes.withLock { $0.append(request) }
                if request["since"] != nil, request["epoch"] == "B" {
                    // History B's revisions after 5 — changes to a state the watch never had.
                    try connection.reply(to: request, [("sub", 1), ("rev", 9), ("epoch", "B")])
                    for rev in 6...9 {
                        try connection.send(#"{"event":"change","sub":1,"repo":"r","rev":\#(rev),"changes":[{"key":"k","new":"b\#(rev)"}]}"#)
                    }
                } else {
                    if request["since"] != nil {
                        try connection.refuse(request, .compacted, "another history")
                        request = try connection.receive()
                    }
                    try connection.reply(to: request, [("sub", 1), ("rev", 9), ("epoch", "B")])
                    try connection.send(#"{"event":"snapshot","sub":1,"repo":"r","rev":9,"values":{"k":"b9"}}"#)
                }
                _ = try? connection.receiveLine(timeout: .seconds(60))  // until the session closes
            }
        }
        defer { server.stop() }
        let session = ObsSession(socketPath: path, backoff: Backoff(initial: .milliseconds(10), maximum: .milliseconds(50)))
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, let first, false) = try await events.next() else { throw TestFailure("expected history A's snapshot") }
        #expect(first == ["k": "a5"])
        let next = try await events.next()
        guard case .snapshot(9, let values, resync: true) = next else { throw TestFailure("expected a resync snapshot, got \(String(describing: next))") }
        #expect(values == ["k": "b9"])
        #expect(events.position == 9 && events.epoch == "B")
        let resumed = resumes.withLock { $0.first }
        #expect(resumed?["since"] == 5 && resumed?["epoch"] == "A", "resumed from history A's position in history A: \(String(describing: resumed))")
        await session.close()
    }
}

/// A raw connection the daemon admitted (a connection just closed may still hold the slot of
/// a daemon at its `max-connections`: refused ones are retried).
func admittedConnection(_ d: TestDaemon) async throws -> WireConnection {
    var refusals = 0
    while true {
        let connection = try d.connect()
        // Not `call`: a refusal answers with id null, not the ping's id.
        try connection.request(["op": "ping"])
        let reply = try connection.receive()
        if reply.ok { return connection }
        connection.close()
        refusals += 1
        guard reply.errorCode == "overloaded", refusals < 200 else { throw TestFailure("cannot get a connection admitted: \(reply)") }
        try await Task.sleep(for: .milliseconds(10))
    }
}

/// Waits until the daemon counts at least `count` refused connections (read on `holder`).
func waitForRefusals(_ holder: WireConnection, atLeast count: Int64) async throws {
    var refused: Int64 = 0
    let found = try await eventually { () async throws -> Bool in  // suspends between looks
        refused = try holder.call(["op": "stats"])["connectionsRefused"]?.int64Value ?? 0
        return refused >= count
    }
    if !found { throw TestFailure("the daemon refused \(refused) connections, expected at least \(count)") }
}
