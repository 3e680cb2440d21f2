// End-to-end test of a mirror's first write: it returns once the mirror is loaded, even when
// the first snapshot is applied between the write finding the mirror not loaded and the write
// registering its wait. `await withCheckedContinuation` is a suspension point: in a full run
// (a `.mayBlock` test, so a task with a task executor preference, on the main actor) a trace
// showed the write find the mirror not loaded, the watch's job apply the snapshot and resume
// no waiter, and only then the write's continuation registered — to wait forever, the daemon
// healthy and the snapshot applied: ObservationMirrorTests' first `set` hanging. The test's
// hook holds the write in that window until the snapshot is applied.

import Foundation
@testable import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct MirrorLoadWaitTests {
    @Test @MainActor func aWriteReturnsWhenTheSnapshotIsAppliedJustBeforeItWaits() async throws {
        let path = scriptedSocketPath()
        let atWait = DispatchSemaphore(value: 0)
        // The script answers the subscribe and the write at once and holds the mirror's snapshot
        // back until the write has found the mirror not loaded (the test's hook signals it).
        let server = try scriptedServer(path: path) { _, connection in
            try connection.greet()
            // Replies go in request order; only the snapshot, which follows the subscribe
            // reply, is held back.
            var (subscribedAt, written): (UInt64?, Bool) = (nil, false)
            while subscribedAt == nil || !written {
                let request = try connection.receive(timeout: .seconds(30))
                switch request["op"]?.stringValue {
                case "subscribe":
                    subscribedAt = written ? 1 : 0
                    try connection.reply(to: request, [("sub", 1), ("rev", .number(subscribedAt!)), ("epoch", "A")])
                case "set":
                    try connection.reply(to: request, [("rev", 1), ("changed", true)])
                    written = true
                default: try connection.require(request, false, "a subscribe or a set")
                }
            }
            guard atWait.wait(timeout: .now() + 30) == .success else { throw TestFailure("the write never found the mirror unloaded") }
            try connection.sendSnapshot(repo: "ui", rev: subscribedAt!, subscribedAt == 1 ? [("a", 1)] : [])
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let session = ObsSession(socketPath: path)
        let ui = RemoteRepository("ui", session: session)
        let waited = Locked(false)
        ui.link.beforeWaitingForLoad = { @MainActor [ui] in
            waited.withLock { $0 = true }
            atWait.signal()
            // The snapshot arrives and is applied now, before the write registers its wait.
            try? await until("the snapshot is applied") { ui.contents.isLoaded }
        }
        let outcome = WriteOutcome()
        let write = Task { @MainActor in outcome.result = try await ui.set("a", to: 1) }
        do {
            try await until("the first write returns") { outcome.result != nil }
        } catch {
            let state = "waited: \(waited.withLock { $0 }), loaded: \(ui.contents.isLoaded)"
            ui.stop()  // resumes a write still waiting, so that the test ends with the failure
            _ = try? await write.value
            throw TestFailure("\(error) (\(state))")
        }
        try await write.value
        #expect(outcome.result == .applied(revision: 1))
        #expect(waited.withLock { $0 }, "the write found the mirror not loaded and waited")
        #expect(ui.values == ["a": 1] && ui.contents.isLoaded)
        await session.close()
    }
}

@MainActor final class WriteOutcome {
    var result: RemoteWriteResult?
}
