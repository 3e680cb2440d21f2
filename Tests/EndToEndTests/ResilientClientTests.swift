// End-to-end tests of the resilient half of the client library: ObsSession reconnecting
// across daemon restarts, watches resuming with no gap and no duplicate (or resyncing
// when the daemon cannot replay), typed values, and the Observation mirrors.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Observation
import TestSupport
import Testing

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ResilientClientTests {
    @Test func aWatchContinuesAcrossADaemonRestartWithNoGapAndNoDuplicate() async throws {
        let d = try await TestDaemon.start()
        let session = ObsSession(socketPath: d.socketPath, backoff: Backoff(initial: .milliseconds(200), maximum: .milliseconds(400)))
        let states = StateRecorder(session)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(0, let values, false) = try await events.next() else { throw TestFailure("expected the initial snapshot") }
        #expect(values.isEmpty)

        try await writeNumbered("r", 1...20, socket: d.socketPath)
        try await expectChanges(&events, 1...20)

        #expect(await d.stop() == 0)
        try await states.wait { if case .waiting = $0 { true } else { false } }
        try await d.launch()
        // Written at once: most land before the session is back, and must be replayed.
        try await writeNumbered("r", 21...40, socket: d.socketPath)
        try await expectChanges(&events, 21...40)
        try await writeNumbered("r", 41...41, socket: d.socketPath)
        try await expectChanges(&events, 41...41)  // nothing was delivered twice
        try await states.wait { $0 == .connected }
        await session.close()
        #expect(session.connectionState == .closed)
    }

    @Test func aWatchResyncsWithASnapshotWhenTheDaemonCannotReplay() async throws {
        // In memory: the restarted daemon starts again at revision 0, below where the watch was.
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        _ = try await events.next()
        try await writeNumbered("r", 1...3, socket: d.socketPath)
        try await expectChanges(&events, 1...3)
        #expect(await d.stop() == 0)
        try await d.launch()
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in _ = try await client.set("fresh", to: 1, in: "r") }
        guard case .snapshot(let revision, var values, resync: true) = try await events.next() else {
            throw TestFailure("expected a resync snapshot")
        }
        if revision == 0 {  // resynced before the write: the write follows as a change
            guard case .change(let changes) = try await events.next() else { throw TestFailure("expected the write") }
            for change in changes.changes { values[change.key] = change.new }
        }
        #expect(values == ["fresh": 1], "the resync replaced everything: keys of the old daemon are gone")
        await session.close()
    }

    @Test func typedValuesRoundTripAndBadValuesAreErrorsNotNil() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        var changes = session.watch("theme", in: "ui", as: Theme.self).makeAsyncIterator()
        let first = try await changes.next()
        #expect(first?.isSnapshot == true && first?.new == nil && first?.old == nil)

        let light = Theme(name: "light", accent: 3, tags: ["a"])
        let dark = Theme(name: "dark", accent: 9_007_199_254_740_993, tags: [])
        try await session.set("theme", to: light, in: "ui")
        #expect(try await session.get("theme", in: "ui")?.value == ["name": "light", "accent": 3, "tags": ["a"]])
        #expect(try await session.get("theme", in: "ui", as: Theme.self) == Entry(value: light, revision: 1))
        try await session.set("theme", to: dark, in: "ui")
        try await session.delete("theme", in: "ui")
        for (old, new, revision) in [(nil, light, 1), (light, dark, 2), (dark, nil, 3)] as [(Theme?, Theme?, UInt64)] {
            let change = try await changes.next()
            #expect(change?.old == old && change?.new == new && change?.revision == revision && change?.isSnapshot == false)
        }

        try await session.set("theme", to: ["name": "odd", "accent": "high"], in: "ui")
        do {
            _ = try await session.get("theme", in: "ui", as: Theme.self)
            Issue.record("expected undecodable")
        } catch {
            #expect(error.description == #"the value of key "theme" is not a valid Theme: .accent: Expected to decode Int64 but found a string instead."#)
        }
        do {
            _ = try await changes.next()
            Issue.record("expected the typed watch to end with undecodable")
        } catch let error as ObsClientError {
            guard error.code == .undecodable else { throw error }
            #expect(error.key == "theme" && error.typeName == "Theme")
        }
        do {
            try await session.set("ratio", to: Double.nan, in: "ui")
            Issue.record("expected unencodable")
        } catch {
            guard error.code == .unencodable else { throw error }
            #expect(error.typeName == "Double")
        }
        await session.close()
    }

    @Test func sessionCallsWaitForAConnectionAndFailOnceClosed() async throws {
        let directory = TestDaemon.makeTemporaryDirectory()
        let session = ObsSession(socketPath: directory + "/obsd.sock", backoff: Backoff(initial: .milliseconds(20), maximum: .milliseconds(50)))
        let states = StateRecorder(session)
        try await states.wait { if case .waiting(_, let reason) = $0 { reason.contains("is obsd running?") } else { false } }
        async let written = session.set("k", to: "queued until the daemon is up", in: "r")
        let d = try await TestDaemon.start(directory: directory, inMemory: true)
        #expect(try await written.changed)
        #expect(try await session.get("k", in: "r")?.value == "queued until the daemon is up")
        await session.close()
        do {
            _ = try await session.get("k", in: "r")
            Issue.record("expected sessionClosed")
        } catch {
            guard error.code == .sessionClosed else { throw error }
        }
        #expect(await d.stop() == 0)
    }

    @Test func backoffDoublesUpToItsMaximumWithBoundedJitter() {
        let exact = Backoff(initial: .milliseconds(50), maximum: .seconds(1), jitter: 0)
        #expect((0..<7).map { exact.delay(after: $0) } == [50, 100, 200, 400, 800, 1000, 1000].map { .milliseconds($0) })
        let jittered = Backoff(initial: .milliseconds(100), maximum: .seconds(1), jitter: 0.2)
        for _ in 0..<100 {
            let delay = jittered.delay(after: 1)
            #expect(delay <= .milliseconds(200) && delay >= .milliseconds(160))
        }
    }
}

struct Theme: Codable, Equatable, Sendable {
    var name: String
    var accent: Int64
    var tags: [String]
}

/// Sets key `k<i % 5>` to `i` for each `i`, one revision each, on a connection of its own.
func writeNumbered(_ repo: String, _ range: ClosedRange<Int>, socket: String) async throws {
    try await ObsConnection.withConnection(socketPath: socket) { client in
        for i in range { try await client.set(Key("k\(i % 5)"), to: .int(Int64(i)), in: repo) }
    }
}

/// Expects the watch's next events to be exactly the changes `writeNumbered` made for `range`.
func expectChanges(_ events: inout Watch.AsyncIterator, _ range: ClosedRange<Int>) async throws {
    for i in range {
        guard case .change(let changes) = try await events.next() else { throw TestFailure("expected the change at revision \(i)") }
        #expect(changes.revision == UInt64(i))
        #expect(changes.changes.count == 1 && changes.changes[0].key == Key("k\(i % 5)") && changes.changes[0].new == .int(Int64(i)))
        #expect(changes.changes[0].old == (i > 5 ? .int(Int64(i - 5)) : nil))
    }
}

/// Records a session's connection states as they are published.
final class StateRecorder: Sendable {
    /// Every state published, and how many of them earlier waits have consumed.
    private let seen = Locked<(states: [ConnectionState], consumed: Int)>(([], 0))

    init(_ session: ObsSession) {
        let seen = self.seen
        Task {
            for await state in session.connectionStates() { seen.withLock { $0.states.append(state) } }
        }
    }

    var states: [ConnectionState] { seen.withLock { $0.states } }

    /// Waits until a state published after those earlier waits consumed matches (consuming
    /// it and those before it). Looks once more after the deadline: a test starved of its
    /// thread past the deadline still sees a state that was published in time.
    func wait(timeout: Duration = .seconds(20), _ matches: @escaping @Sendable (ConnectionState) -> Bool) async throws {
        let found = await eventually(timeout: timeout) { () async -> Bool in  // suspends between looks
            seen.withLock { seen in
                guard let i = seen.states[seen.consumed...].firstIndex(where: matches) else { return false }
                seen.consumed = i + 1
                return true
            }
        }
        if !found { throw TestFailure("no matching connection state within \(timeout); seen: \(states)") }
    }
}
