// End-to-end tests of the Observation mirrors (RemoteRepository, RemoteValue) and of the
// example program built on them: one notification per revision, none for a write that
// changed nothing, typed writes with compare-and-set, following a daemon restart, and a
// write made just after a restart that lost the history.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Observation
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ObservationMirrorTests {
    @Test @MainActor func oneNotificationPerRevisionAndNoneForAWriteThatChangesNothing() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        let ui = RemoteRepository("ui", session: session)
        #expect(try await ui.set("a", to: 1) == .applied(revision: 1), "returns once the mirror shows it")
        #expect(ui.values == ["a": 1] && ui.revision == 1 && ui.contents.isLoaded)

        let notifications = NotificationCounter { _ = ui.values; _ = ui.revision }
        try await session.apply([.set("b", 2), .set("c", 3), .delete("a")], in: "ui")  // one revision, three keys
        #expect(try await ui.set("z", to: 0) == .applied(revision: 3))  // so revision 2 is applied too
        #expect(notifications.count == 2, "the batch notified once, the set once")
        #expect(try await ui.set("z", to: 0) == .unchanged(revision: 3))
        #expect(try await ui.set("y", to: 1) == .applied(revision: 4))
        #expect(notifications.count == 3, "the equal write notified nobody (onChange)")
        #expect(try await ui.set("y", to: 1, force: true) == .applied(revision: 5))
        #expect(notifications.count == 4, "a forced write is a change (didSet)")
        #expect(try await ui.set("y", to: 2, ifRevision: 4) == .conflict)
        #expect(try await ui.set("y", to: 2, ifRevision: 5) == .applied(revision: 6))
        #expect(ui.values == ["b": 2, "c": 3, "z": 0, "y": 2])
        #expect(try ui.value("c", as: Int.self) == 3)

        let win = RemoteRepository("ui", selection: .prefix("win/"), session: session)
        try await until("the first snapshot arrives") { win.contents.isLoaded }
        let winNotifications = NotificationCounter { _ = win.values }
        #expect(try await win.set("win/1", to: "open") == .applied(revision: 7))
        #expect(try await ui.set("other", to: 1) == .applied(revision: 8))
        #expect(try await win.set("win/2", to: "open") == .applied(revision: 9))
        #expect(winNotifications.count == 2, "a keyed mirror is not notified of other keys")
        #expect(win.values == ["win/1": "open", "win/2": "open"])
        await session.close()
    }

    @Test @MainActor func remoteValueIsTypedComparesAndSetsAndFollowsARestart() async throws {
        let d = try await TestDaemon.start()
        let session = ObsSession(socketPath: d.socketPath, backoff: Backoff(initial: .milliseconds(50), maximum: .milliseconds(200)))
        let theme = RemoteValue("theme", in: "ui", as: Theme.self, session: session)
        let light = Theme(name: "light", accent: 3, tags: [])
        #expect(try await theme.set(light) == .applied(revision: 1))
        #expect(theme.value == light && theme.current.exists && theme.current.revision == 1)

        let notifications = NotificationCounter { _ = theme.value }
        let bumped = try await theme.update { current in
            var next = current ?? light
            next.accent += 1
            return next
        }
        #expect(bumped == .applied(revision: 2) && theme.value?.accent == 4 && notifications.count == 1)
        #expect(try await theme.set(light, ifRevision: 1) == .conflict)
        #expect(try await theme.set(Theme(name: "light", accent: 4, tags: [])) == .unchanged(revision: 2))
        #expect(notifications.count == 1)

        #expect(await d.stop() == 0)
        try await until("the mirror sees the daemon gone") { if case .waiting = theme.connection { true } else { false } }
        try await d.launch()
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in
            _ = try await client.set("theme", to: ["name": "odd", "accent": "high", "tags": []], in: "ui")
        }
        try await until("the undecodable value arrives") { theme.current.decodingError != nil }
        #expect(theme.value == nil && theme.current.exists && theme.current.revision == 3)
        #expect(theme.current.decodingError?.description.contains("not a valid Theme") == true)
        #expect(try await theme.delete() == .applied(revision: 4))
        #expect(!theme.current.exists && theme.current.decodingError == nil)
        #expect(notifications.count == 3, "one per revision across the restart: nothing replayed twice")
        try await until("connected") { theme.connection == .connected }
        await session.close()
        try await until("the mirror ends with the session") { theme.failure != nil }
    }

    @Test @MainActor func aWriteRightAfterTheDaemonLostItsHistoryStaysInTheMirror() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath, backoff: Backoff(initial: .milliseconds(20), maximum: .milliseconds(100)))
        let ui = RemoteRepository("ui", session: session)
        for i in 1...30 { try await ui.set("k", to: .int(Int64(i))) }
        #expect(try await ui.set("other", to: 1) == .applied(revision: 31))
        #expect(await d.stop() == 0)
        try await until("the mirror sees the daemon gone") { if case .waiting = ui.connection { true } else { false } }
        try await d.launch()  // in memory: a new epoch, its revisions counting from 0 again
        #expect(try await ui.set("k", to: "new") == .applied(revision: 1))
        #expect(ui["k"] == "new", "returns once the mirror shows it")
        try await until("the resync drops what the old history had") { ui["other"] == nil }
        #expect(ui.values == ["k": "new"] && ui.revision == 1)
        await session.close()
    }
}

/// Counts the notifications of everything `read` reads, re-registering after each one
/// (inside the notification, so that no change can slip between two registrations).
@MainActor final class NotificationCounter {
    private(set) var count = 0
    private let read: @MainActor () -> Void

    init(_ read: @escaping @MainActor () -> Void) {
        self.read = read
        track()
    }

    private func track() {
        withObservationTracking(read) { [weak self] in
            MainActor.assumeIsolated {
                self?.count += 1
                self?.track()
            }
        }
    }
}

/// Waits until `condition` holds, re-checking whenever something it reads changes. It gives
/// up once `timeout` has passed *and* it has woken up on its own (every 200 ms) as many times
/// as fit in `timeout`: while other tests hold every thread of the shared pool, neither this
/// wait nor the client work it waits for runs, and the wall clock alone would blame the
/// client for the starvation (a fresh clone's `make test` on a busy machine).
@MainActor func until(_ what: String, timeout: Duration = .seconds(20), _ condition: @escaping @MainActor () -> Bool) async throws {
    let deadline = ContinuousClock.now + timeout
    let looksWanted = Int(timeout / .milliseconds(200))
    let looks = Locked(0)
    while !condition() {
        guard ContinuousClock.now < deadline || looks.withLock({ $0 }) < looksWanted else {
            throw TestFailure("timed out waiting until \(what)")
        }
        let resumed = Locked(false)
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let resume: @Sendable () -> Void = {
                if resumed.withLock({ done in defer { done = true }; return !done }) { continuation.resume() }
            }
            withObservationTracking { _ = condition() } onChange: { resume() }
            Task {  // wake up now and then to check the deadline
                try? await Task.sleep(for: .milliseconds(200))
                looks.withLock { $0 += 1 }
                resume()
            }
        }
    }
}

/// A child process whose standard output is read line by line, with a deadline per line.
final class LineReadingProcess {
    private let process: ChildProcess
    private let outPath: String
    private var consumed = 0

    init(_ executable: String, _ arguments: [String]) throws {
        outPath = TestDaemon.makeTemporaryDirectory() + "/stdout"
        process = try ChildProcess(executable, arguments, stdout: .file(outPath))
    }

    deinit {
        process.stop()
        try? FileManager.default.removeItem(atPath: (outPath as NSString).deletingLastPathComponent)
    }

    func line(timeout: Duration = .seconds(20)) throws -> String {
        let deadline = ContinuousClock.now + timeout
        while true {
            let running = process.isRunning  // before reading: a line written just before exiting is still read
            let bytes = Array((FileManager.default.contents(atPath: outPath) ?? Data()).dropFirst(consumed))
            if let newline = bytes.firstIndex(of: 10) {
                consumed += newline + 1
                return String(decoding: bytes[..<newline], as: UTF8.self)
            }
            guard ContinuousClock.now < deadline else {
                throw TestFailure("no line within \(timeout); got \(String(decoding: bytes, as: UTF8.self))")
            }
            guard running else { throw TestFailure("output ended; got \(String(decoding: bytes, as: UTF8.self))") }
            usleep(10_000)
        }
    }

    /// Waits for the process to exit on its own (SIGTERM after `timeout`); its status.
    func waitForExit(timeout: Duration = .seconds(20)) -> Int32 {
        if process.wait(timeout: timeout) == nil { process.stop() }
        return process.terminationStatus
    }
}
