// End-to-end tests of the client library's resume that never fails and of a mirror's `sync`,
// against scripted daemons (ScriptedServer) that produce every form on demand: after a lost
// connection a `Watch` resumes with `since` + `epoch` + `catchup` and hands on a replay as
// changes, a diff as a `catchUp` event, a snapshot as a resync — and, from an older daemon
// that answers `compacted`, subscribes again with `initial`; a connection lost in the middle
// of a catch-up resumes from the position the watch had. A `RemoteRepository` applies a
// diff in place, notifying the observers of the keys it changed and nobody else, and a
// snapshot after a resume as a reset. `sync()` returns only once the events its reply
// follows are applied, asks again on the resumed subscription after a reconnection, and
// against a daemon without `sync` waits for the repository's revision through `progress`.
// None of it needs the real daemon to implement catch-up or sync.

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Observation
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct CatchUpClientTests {
    /// A session on `path` that reconnects at once.
    func session(_ path: String) -> ObsSession {
        ObsSession(socketPath: path, backoff: Backoff(initial: .milliseconds(10), maximum: .milliseconds(50)))
    }

    /// The first connection of the scripts below: a watch's initial subscription at revision 5
    /// of history A — `{"k":"a5","j":1,"gone":true}` — after which the connection is lost.
    static func firstConnection(_ connection: WireConnection, _ log: ScriptLog) throws {
        try connection.greet()
        let subscribe = try connection.expect("subscribe")
        log.record(subscribe)
        try connection.reply(to: subscribe, [("sub", 1), ("rev", 5), ("epoch", "A")])
        try connection.sendSnapshot(repo: "r", rev: 5, [("gone", true), ("j", 1), ("k", "a5")])
    }

    /// Checks the resume request: since 5 in epoch A, with catchup, progress, and no initial.
    static func expectResume(_ request: JSONObject, on connection: WireConnection) throws {
        let resumes = request["since"] == 5 && request["epoch"] == "A" && request["catchup"] == true && request["initial"] == nil
            && request["progress"] == true && request["once"] == nil
        try connection.require(request, resumes, "not a resume from 5 in A with catchup")
    }

    @Test func aResumeTheHistoryCanReplayIsHandedOnAsChanges() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            if index == 0 { return try Self.firstConnection(connection, log) }
            try connection.greet()
            let resume = try connection.expect("subscribe")
            log.record(resume)
            try Self.expectResume(resume, on: connection)
            try connection.reply(to: resume, [("sub", 1), ("rev", 7), ("epoch", "A"), ("catchup", "replay")])
            try connection.sendChange(repo: "r", rev: 6, "k", old: "a5", new: "a6")
            try connection.sendChange(repo: "r", rev: 7, "gone", old: true, new: nil)
            try connection.sendPosition("synced", repo: "r", rev: 7)
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let session = session(path)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, _, false) = try await events.next() else { throw TestFailure("expected the first snapshot") }
        guard case .change(let six) = try await events.next(), case .change(let seven) = try await events.next() else {
            throw TestFailure("expected the replayed changes")
        }
        #expect(six.revision == 6 && six.changes == [Change(key: "k", old: "a5", new: "a6")])
        #expect(seven.revision == 7 && seven.changes == [Change(key: "gone", old: true, new: nil)])
        #expect(events.position == 7 && events.epoch == "A")
        #expect(log.of("subscribe").count == 2)
        await session.close()
    }

    @Test func aResumePastTheHistoryIsHandedOnAsOneCatchUp() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            if index == 0 { return try Self.firstConnection(connection, log) }
            try connection.greet()
            let resume = try connection.expect("subscribe")
            log.record(resume)
            try Self.expectResume(resume, on: connection)
            try connection.reply(to: resume, [("sub", 1), ("rev", 9), ("epoch", "A"), ("catchup", "diff")])
            try connection.sendCatchUp(repo: "r", from: 5, rev: 9, values: [("j", 1), ("k", "a9"), ("new", [1, 2])], deleted: ["gone", "never"])
            try connection.sendPosition("synced", repo: "r", rev: 9)
            try connection.sendChange(repo: "r", rev: 10, "k", old: "a9", new: "a10")
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let session = session(path)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, _, false) = try await events.next() else { throw TestFailure("expected the first snapshot") }
        let next = try await events.next()
        guard case .catchUp(let diff) = next else { throw TestFailure("expected a catch-up, got \(String(describing: next))") }
        #expect(diff.from == 5 && diff.revision == 9)
        #expect(diff.values == ["j": 1, "k": "a9", "new": [1, 2]] && diff.deleted == ["gone", "never"])
        #expect(events.position == 9 && events.epoch == "A", "a catch-up moves the position like the changes it stands for")
        guard case .change(let live) = try await events.next() else { throw TestFailure("expected the live change") }
        #expect(live.revision == 10)
        #expect(log.of("subscribe").count == 2, "no relist: the resume was the only request")
        await session.close()
    }

    @Test func aResumeIntoAnotherHistoryIsHandedOnAsAResync() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            if index == 0 { return try Self.firstConnection(connection, log) }
            try connection.greet()
            let resume = try connection.expect("subscribe")
            log.record(resume)
            try Self.expectResume(resume, on: connection)
            try connection.reply(to: resume, [("sub", 1), ("rev", 3), ("epoch", "B"), ("catchup", "snapshot")])
            try connection.sendSnapshot(repo: "r", rev: 3, [("k", "b3")])
            try connection.sendPosition("synced", repo: "r", rev: 3)
            try connection.sendChange(repo: "r", rev: 4, "k", old: "b3", new: "b4")
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let session = session(path)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, _, false) = try await events.next() else { throw TestFailure("expected the first snapshot") }
        let next = try await events.next()
        guard case .snapshot(3, let values, resync: true) = next else { throw TestFailure("expected a resync, got \(String(describing: next))") }
        #expect(values == ["k": "b3"])
        #expect(events.position == 3 && events.epoch == "B")
        guard case .change(let live) = try await events.next() else { throw TestFailure("expected the live change") }
        #expect(live.revision == 4)
        await session.close()
    }

    @Test func anOlderDaemonsCompactedIsFollowedByASubscriptionWithASnapshot() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            if index == 0 { return try Self.firstConnection(connection, log) }
            try connection.greet()
            let resume = try connection.expect("subscribe")
            try Self.expectResume(resume, on: connection)
            try connection.refuse(resume, .compacted, "revision 5 is no longer in the history")
            let fresh = try connection.expect("subscribe")
            log.record(fresh)
            try connection.require(
                fresh, fresh["initial"] == true && fresh["since"] == nil && fresh["catchup"] == nil && fresh["epoch"] == nil,
                "not a subscription with a snapshot")
            try connection.reply(to: fresh, [("sub", 2), ("rev", 12), ("epoch", "A")])
            try connection.sendSnapshot(sub: 2, repo: "r", rev: 12, [("k", "a12")])
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let session = session(path)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, _, false) = try await events.next() else { throw TestFailure("expected the first snapshot") }
        let next = try await events.next()
        guard case .snapshot(12, let values, resync: true) = next else { throw TestFailure("expected a resync, got \(String(describing: next))") }
        #expect(values == ["k": "a12"] && events.position == 12)
        #expect(log.of("subscribe").count == 2, "the first subscription and the one after compacted")
        await session.close()
    }

    @Test func aConnectionLostInTheMiddleOfACatchUpResumesFromThePositionItHad() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            switch index {
            case 0: return try Self.firstConnection(connection, log)
            case 1:  // a diff announced, lost before its event
                try connection.greet()
                let resume = try connection.expect("subscribe")
                log.record(resume)
                try Self.expectResume(resume, on: connection)
                try connection.reply(to: resume, [("sub", 1), ("rev", 9), ("epoch", "A"), ("catchup", "diff")])
            case 2:  // a snapshot of history B announced, lost before its event
                try connection.greet()
                let resume = try connection.expect("subscribe")
                log.record(resume)
                try Self.expectResume(resume, on: connection)
                try connection.reply(to: resume, [("sub", 1), ("rev", 2), ("epoch", "B"), ("catchup", "snapshot")])
            default:
                try connection.greet()
                let resume = try connection.expect("subscribe")
                log.record(resume)
                try Self.expectResume(resume, on: connection)  // still from 5 in A: nothing of either arrived
                try connection.reply(to: resume, [("sub", 1), ("rev", 9), ("epoch", "A"), ("catchup", "diff")])
                try connection.sendCatchUp(repo: "r", from: 5, rev: 9, values: [("k", "a9")], deleted: [])
                try connection.sendPosition("synced", repo: "r", rev: 9)
                try connection.serveUntilClosed()
            }
        }
        defer { server.stop() }
        let session = session(path)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(5, _, false) = try await events.next() else { throw TestFailure("expected the first snapshot") }
        let next = try await events.next()
        guard case .catchUp(let diff) = next else { throw TestFailure("expected the catch-up, got \(String(describing: next))") }
        #expect(diff.values == ["k": "a9"] && events.position == 9 && events.epoch == "A")
        #expect(log.of("subscribe").count == 4)
        await session.close()
    }

    // MARK: The mirror

    /// A mirror loaded from the first connection — `{"a":1,"b":2,"c":3,"d":4}` at revision 5 of
    /// history A — which the script drops once `resume` is signalled, then serves the resume
    /// with `afterResume`.
    static func mirrorScript(
        _ log: ScriptLog, resume: DispatchSemaphore, afterResume: @escaping @Sendable (WireConnection, JSONObject) throws -> Void
    ) -> @Sendable (Int, WireConnection) throws -> Void {
        { index, connection in
            try connection.greet()
            let subscribe = try connection.expect("subscribe")
            log.record(subscribe)
            if index == 0 {
                try connection.require(
                    subscribe, subscribe["initial"] == true && subscribe["coalesce"] == true && subscribe["echo"] == false,
                    "not a mirror's subscription")
                try connection.reply(to: subscribe, [("sub", 1), ("rev", 5), ("epoch", "A")])
                try connection.sendSnapshot(repo: "m", rev: 5, [("a", 1), ("b", 2), ("c", 3), ("d", 4)])
                resume.wait()  // the test watches the keys now: lose the connection
                return
            }
            try Self.expectResume(subscribe, on: connection)
            try afterResume(connection, subscribe)
            try connection.serveUntilClosed()
        }
    }

    /// Counts the notifications of the observers of each of `keys` read through the
    /// mirror's subscript, and of the observers of its values.
    @MainActor struct KeyObservers {
        let counters: [Key: NotificationCounter]
        let values: NotificationCounter

        init(_ mirror: RemoteRepository, _ keys: [Key]) {
            counters = Dictionary(uniqueKeysWithValues: keys.map { key in (key, NotificationCounter { _ = mirror[key] }) })
            values = NotificationCounter { _ = mirror.values }
        }

        /// The keys notified at least once.
        var notified: Swift.Set<Key> { Swift.Set(counters.filter { $0.value.count > 0 }.keys) }
        var counts: [Key: Int] { counters.mapValues(\.count) }
    }

    @Test @MainActor func aMirrorAppliesACatchUpInPlaceAndNotifiesOnlyTheKeysItChanged() async throws {
        let path = scriptedSocketPath(), log = ScriptLog(), resume = DispatchSemaphore(value: 0)
        let server = try scriptedServer(
            path: path,
            Self.mirrorScript(log, resume: resume) { connection, request in
                try connection.reply(to: request, [("sub", 1), ("rev", 9), ("epoch", "A"), ("catchup", "diff")])
                // b changed, c was written back to the value it had, e is new, a was deleted, zz
                // created and deleted again after 5.
                try connection.sendCatchUp(repo: "m", from: 5, rev: 9, values: [("b", 20), ("c", 3), ("e", 5)], deleted: ["a", "zz"])
                try connection.sendPosition("synced", repo: "m", rev: 9)
            })
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        #expect(mirror.values == ["a": 1, "b": 2, "c": 3, "d": 4])
        let observers = KeyObservers(mirror, ["a", "b", "c", "d", "e", "zz"])
        resume.signal()
        try await until("the catch-up is applied") { mirror.failure != nil || mirror.revision == 9 }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        #expect(mirror.values == ["b": 20, "c": 3, "d": 4, "e": 5], "the state at 9, from the state at 5 and the diff")
        #expect(observers.notified == ["a", "b", "e"], "only the keys it changed: \(observers.counts)")
        #expect(observers.counts["a"] == 1 && observers.counts["b"] == 1 && observers.counts["e"] == 1)
        #expect(observers.values.count == 1, "one step")
        #expect(mirror["zz"] == nil && mirror.failure == nil)
        #expect(log.of("subscribe").count == 2, "no relist")
        await session.close()
    }

    @Test @MainActor func aMirrorReplacesItsStateWithASnapshotAfterAResumeAndNotifiesWhatDiffers() async throws {
        let path = scriptedSocketPath(), log = ScriptLog(), resume = DispatchSemaphore(value: 0)
        let server = try scriptedServer(
            path: path,
            Self.mirrorScript(log, resume: resume) { connection, request in
                try connection.reply(to: request, [("sub", 1), ("rev", 2), ("epoch", "B"), ("catchup", "snapshot")])
                try connection.sendSnapshot(repo: "m", rev: 2, [("b", 2), ("c", 30), ("f", 6)])
                try connection.sendPosition("synced", repo: "m", rev: 2)
            })
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        let observers = KeyObservers(mirror, ["a", "b", "c", "d", "f"])
        resume.signal()
        try await until("the snapshot replaces the state") { mirror.failure != nil || mirror.revision == 2 }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        #expect(mirror.values == ["b": 2, "c": 30, "f": 6], "the keys it does not list are gone")
        #expect(observers.notified == ["a", "c", "d", "f"], "every key whose value differs, and no other: \(observers.counts)")
        #expect(observers.values.count == 1)
        await session.close()
    }

    @Test @MainActor func aMirrorOfAnOlderDaemonStartsOverFromASnapshot() async throws {
        let path = scriptedSocketPath(), log = ScriptLog(), resume = DispatchSemaphore(value: 0)
        let server = try scriptedServer(
            path: path,
            Self.mirrorScript(log, resume: resume) { connection, request in
                try connection.refuse(request, .compacted, "revision 5 is no longer in the history")
                let fresh = try connection.expect("subscribe")
                log.record(fresh)
                try connection.require(
                    fresh, fresh["initial"] == true && fresh["since"] == nil && fresh["catchup"] == nil, "not a subscription with a snapshot")
                try connection.reply(to: fresh, [("sub", 2), ("rev", 30), ("epoch", "A")])
                try connection.sendSnapshot(sub: 2, repo: "m", rev: 30, [("a", 1), ("b", 2), ("c", 33)])
            })
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        let observers = KeyObservers(mirror, ["a", "b", "c", "d"])
        resume.signal()
        try await until("the snapshot replaces the state") { mirror.failure != nil || mirror.revision == 30 }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        #expect(mirror.values == ["a": 1, "b": 2, "c": 33])
        #expect(observers.notified == ["c", "d"], "\(observers.counts)")
        #expect(log.of("subscribe").count == 3)
        await session.close()
    }

    // MARK: sync

    @Test @MainActor func syncReturnsOnlyOnceTheEventsItsReplyFollowsAreApplied() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let events: UInt64 = 2000
        let server = try scriptedServer(path: path) { _, connection in
            try connection.greet()
            let subscribe = try connection.expect("subscribe")
            try connection.reply(to: subscribe, [("sub", 1), ("rev", 0), ("epoch", "A")])
            try connection.sendSnapshot(repo: "m", rev: 0, [])
            try connection.serveUntilClosed { request in
                guard request["op"] == "sync" else { return false }
                log.record(request)
                // Other writers' revisions, sent just before the reply that follows them.
                for rev in 1...events { try connection.sendChange(repo: "m", rev: rev, "k", new: .number(rev)) }
                try connection.reply(to: request, [("rev", .number(events))])
                return true
            }
        }
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        let revision = try await within("sync") { try await mirror.sync() }
        #expect(revision == events)
        #expect(mirror["k"] == .number(events) && mirror.revision == events, "every event before the reply is applied when sync returns")
        #expect(log.all.first?["sub"] == 1, "the mirror's subscription")
        await session.close()
    }

    @Test @MainActor func syncAcrossAReconnectionAsksAgainOnTheResumedSubscription() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        let server = try scriptedServer(path: path) { index, connection in
            try connection.greet()
            let subscribe = try connection.expect("subscribe")
            if index == 0 {
                try connection.reply(to: subscribe, [("sub", 1), ("rev", 2), ("epoch", "A")])
                try connection.sendSnapshot(repo: "m", rev: 2, [("k", 2)])
                log.record(try connection.expect("sync"))
                return  // lost before the reply
            }
            try connection.require(
                subscribe, subscribe["since"] == 2 && subscribe["epoch"] == "A" && subscribe["catchup"] == true, "not a resume from 2 in A")
            try connection.reply(to: subscribe, [("sub", 4), ("rev", 4), ("epoch", "A"), ("catchup", "replay")])
            try connection.sendChange(sub: 4, repo: "m", rev: 3, "k", old: 2, new: 3)
            try connection.sendChange(sub: 4, repo: "m", rev: 4, "k", old: 3, new: 4)
            try connection.sendPosition("synced", sub: 4, repo: "m", rev: 4)
            try connection.serveUntilClosed { request in
                guard request["op"] == "sync" else { return false }
                log.record(request)
                try connection.sendChange(sub: 4, repo: "m", rev: 5, "k", old: 4, new: 5)
                try connection.reply(to: request, [("rev", 5)])
                return true
            }
        }
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        let revision = try await within("sync") { try await mirror.sync() }
        #expect(revision == 5 && mirror["k"] == 5 && mirror.revision == 5)
        #expect(log.all.map { $0["sub"] } == [1, 4], "asked on the first subscription, then on the one that resumed it")
        await session.close()
    }

    @Test @MainActor func syncAgainstADaemonWithoutItWaitsUntilTheMirrorReachesTheRepositorysRevision() async throws {
        let path = scriptedSocketPath(), log = ScriptLog()
        // Each probe finds the repository `writes` revisions further, which reach the mirror
        // only after the probe ended: other writers' changes, then progress through them.
        let writes: UInt64 = 1000
        let server = try scriptedServer(path: path) { _, connection in
            try connection.greet()
            let subscribe = try connection.expect("subscribe")
            try connection.reply(to: subscribe, [("sub", 1), ("rev", 3), ("epoch", "A")])
            try connection.sendSnapshot(repo: "m", rev: 3, [("k", 3)])
            var revision: UInt64 = 3
            try connection.serveUntilClosed { request in
                log.record(request)
                switch request["op"]?.stringValue {
                case "sync":
                    try connection.refuse(request, .unknownOp, "unknown op \"sync\"")
                case "subscribe":  // the probe: it selects nothing
                    try connection.require(request, request["keys"] == [], "not a probe that selects nothing")
                    try connection.reply(to: request, [("sub", .number(1 + UInt64(log.of("subscribe").count))), ("rev", .number(revision + writes + 1)), ("epoch", "A")])
                case "unsubscribe":
                    try connection.reply(to: request)
                    try connection.send(lines: (revision + 1...revision + writes).map { ScriptedEvent.change(repo: "m", rev: $0, "k", new: .number($0)) })
                    revision += writes + 1  // the last one changed a key the mirror does not select
                    try connection.sendPosition("progress", repo: "m", rev: revision)
                default: return false
                }
                return true
            }
        }
        defer { server.stop() }
        let session = session(path)
        let mirror = RemoteRepository("m", session: session)
        try await until("the mirror loads") { mirror.failure != nil || mirror.contents.isLoaded }
        try #require(mirror.failure == nil, "\(String(describing: mirror.failure))")
        #expect(try await within("sync") { try await mirror.sync() } == 3 + writes + 1)
        #expect(mirror["k"] == .number(3 + writes) && mirror.revision == 3 + writes + 1, "the mirror shows the changes, and is known current")
        #expect(try await within("sync") { try await mirror.sync() } == 3 + 2 * (writes + 1))
        #expect(mirror["k"] == .number(3 + 2 * writes + 1) && mirror.revision == 3 + 2 * (writes + 1))
        #expect(log.of("sync").count == 1, "a daemon that does not know sync is not asked again on the connection")
        #expect(log.of("subscribe").count == 2 && log.of("unsubscribe").count == 2, "a probe each, unsubscribed")
        await session.close()
    }

    @Test @MainActor func aRemoteValueSyncsToo() async throws {
        let path = scriptedSocketPath()
        let server = try scriptedServer(path: path) { _, connection in
            try connection.greet()
            let subscribe = try connection.expect("subscribe")
            try connection.reply(to: subscribe, [("sub", 1), ("rev", 1), ("epoch", "A")])
            try connection.sendSnapshot(repo: "m", rev: 1, [("k", 1)])
            try connection.serveUntilClosed { request in
                guard request["op"] == "sync" else { return false }
                try connection.sendChange(repo: "m", rev: 2, "k", old: 1, new: 2)
                try connection.reply(to: request, [("rev", 3)])
                return true
            }
        }
        defer { server.stop() }
        let session = session(path)
        let value = RemoteValue("k", in: "m", as: Int.self, session: session)
        try await until("the value loads") { value.current.isLoaded }
        #expect(try await within("sync") { try await value.sync() } == 3)
        #expect(value.value == 2)
        await session.close()
    }
}

/// What `body` returns, or a failure once `timeout` passed (`body` is then cancelled): a call
/// that should return does not hold the test up to its time limit when it does not.
func within<T: Sendable>(_ what: String, _ timeout: Duration = .seconds(20), _ body: @escaping @Sendable () async throws -> T) async throws -> T {
    let first = try await withThrowingTaskGroup(of: T?.self, returning: T?.self) { group in
        group.addTask { try await body() }
        group.addTask {
            try await Task.sleep(for: timeout)
            return nil
        }
        let first = try await group.next() ?? nil
        group.cancelAll()
        return first
    }
    guard let first else { throw TestFailure("\(what) did not return within \(timeout)") }
    return first
}
