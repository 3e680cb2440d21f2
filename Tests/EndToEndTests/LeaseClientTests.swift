// End-to-end: the client library's leases against the real obsd — a TTL lease kept alive
// while its value lives and expiring once dropped, revoke, `set(…, lease:)`; holds released
// by release(), by dropping the handle and by cancelling withHold's task, and written again
// after the daemon restarts (durable and in memory); the mirrors' lease ends; and a quiet
// watch resuming from `progress` after the busy repository's history moved past its last
// event (through a proxy that cuts the connection once a progress event went by). The TTL
// lease's keep-alive is its own suite, run alone (LeaseKeepAliveTests, below).

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

/// Runs on its own, after the other suites (the Makefile's ALONE_SUITES): the client keeps a
/// lease alive from a task of Swift's cooperative pool, and the other end-to-end tests' blocking
/// waits can hold both of that pool's threads (two on a 2-CPU machine) for longer than a TTL —
/// a 5 s TTL still expired in one of three full runs. That is a statement about the test
/// process, not the library; alone, the test says what the library does.
@Suite(.mayBlock, .timeLimit(.minutes(3))) struct LeaseKeepAliveTests {
    @Test func aTTLLeaseLivesWhileItsValueDoesAndRevokeEndsIt() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        var lease: Lease? = try await session.grant(ttl: .seconds(3))
        let id = try #require(lease?.id)
        #expect(lease?.ttl == .seconds(3))
        try await session.set("worker", to: "busy", in: "jobs", lease: id)
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "jobs", "keys": ["worker"]]).ok)
        // Over two TTLs later the key is still there: the lease was kept alive.
        try await Task.sleep(for: .seconds(7))
        #expect(try d.value("jobs", "worker") == "busy", "kept alive for over two TTLs")
        #expect(lease?.hasEnded == false)
        lease = nil  // no more keep-alives: it expires within its TTL
        let end = try watcher.receive(timeout: .seconds(10))
        #expect(end["lease"] == ["id": .int(Int64(id.rawValue)), "end": "expired"])

        let second = try await session.grant(ttl: .seconds(30))
        try await session.set("a", to: 1, in: "x", lease: second.id)
        try await session.set("b", to: 1, in: "y", lease: second.id)
        #expect(try await second.revoke() == ["x": 2, "y": 2])
        #expect(second.hasEnded)
        await second.waitUntilEnded()
        do {
            try await second.keepAlive()
            Issue.record("a revoked lease cannot be kept alive")
        } catch {
            #expect(error.code == .notFound)
        }
        do {
            _ = try await session.grant(ttl: .milliseconds(0))
            Issue.record("a TTL below a second is refused")
        } catch {
            #expect(error.code == .badRequest)
        }
        await session.close()
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct LeaseClientTests {
    @Test func aConnectionBoundLeaseEndsWithItsConnection() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let connection = try await ObsConnection.connect(socketPath: d.socketPath)
        let lease = try await connection.grant()
        #expect(lease.ttl == nil)
        try await connection.set("k", to: 1, in: "r", lease: lease.id)
        #expect(try await connection.lease(of: "k", in: "r") == lease.id)
        #expect(try await connection.keepAlive(lease.id) == nil, "no TTL: none reported")
        await connection.close()
        await lease.waitUntilEnded()
        #expect(try await eventually { () async throws in try d.value("r", "k") == nil })
    }

    @Test func aHoldIsReleasedByReleaseByDroppingItAndByCancellation() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "svc"]).ok)

        let hold = try await session.hold("a", as: true, in: "svc")
        #expect(hold.isHeld && hold.lease != nil && hold.failure == nil)
        #expect(try d.value("svc", "a") == true)
        await hold.release()
        #expect(try d.value("svc", "a") == nil, "gone once release returns")
        #expect(!hold.isHeld)

        var dropped: Hold? = try await session.hold("b", as: 1, in: "svc")
        #expect(dropped?.isHeld == true)
        dropped = nil
        #expect(try await eventually { () async throws in try d.value("svc", "b") == nil }, "dropping the handle releases the key")

        let started = AsyncStream.makeStream(of: Void.self)
        let task = Task {
            try await session.withHold("c", as: 2, in: "svc") { _ in
                started.continuation.yield()
                try await Task.sleep(for: .seconds(600))
            }
        }
        for await _ in started.stream { break }
        #expect(try d.value("svc", "c") == 2)
        task.cancel()
        _ = await task.result
        #expect(try d.value("svc", "c") == nil, "cancelled: released")
        let ends = try (1...6).map { _ in try watcher.receive() }.compactMap { $0["lease"]?.objectValue?["end"] }
        #expect(ends == ["revoked", "revoked", "revoked"])

        do {
            _ = try await session.hold("k", as: 1, in: "bad name")
            Issue.record("a bad repository name fails the hold")
        } catch {
            #expect(error.code == .badRequest)
        }
        await session.close()
    }

    @Test(arguments: [false, true]) func aHoldIsWrittenAgainAfterTheDaemonRestarts(inMemory: Bool) async throws {
        let d = try await TestDaemon.start(inMemory: inMemory)
        let fast = Backoff(initial: .milliseconds(20), maximum: .milliseconds(100))
        let session = ObsSession(socketPath: d.socketPath, backoff: fast)
        let hold = try await session.hold("indexer/up", as: true, in: "svc")
        #expect(hold.lease != nil)
        let observer = ObsSession(socketPath: d.socketPath, backoff: fast)
        var events = observer.watch("svc", initial: true).makeAsyncIterator()
        guard case .snapshot(_, let values, false)? = try await events.next() else { throw TestFailure("expected the snapshot") }
        #expect(values == ["indexer/up": true])

        await d.stop()
        try await d.launch()
        // The key comes back once the session reconnected (absent in between).
        #expect(try await eventually { () async throws in try d.value("svc", "indexer/up") == true })
        #expect(await eventually { () async in hold.isHeld && hold.lease != nil })
        if !inMemory {
            // The watch resumes (since + epoch): the restart's deletion, then the hold's write.
            // (Whether that deletion says `closed`, and whether the new lease's id is a new one,
            // is the daemon's: DaemonLeaseRestartTests.)
            guard case .change(let closed)? = try await events.next(), case .change(let again)? = try await events.next() else {
                throw TestFailure("expected the deletion and the write again")
            }
            #expect(closed.changes == [Change(key: "indexer/up", old: true, new: JSONValue?.none)])
            #expect(again.changes == [Change(key: "indexer/up", old: JSONValue?.none, new: true)])
        }
        await hold.release()
        #expect(try d.value("svc", "indexer/up") == nil)
        await session.close()
        await observer.close()
    }

    @Test @MainActor func theMirrorsSayWhichKeysWentAwayByALeasesEnd() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        let svc = RemoteRepository("svc", options: .default, session: session)
        let up = RemoteValue("up", in: "svc", as: Bool.self, options: .default, session: session)
        try await until("loaded") { svc.contents.isLoaded && up.current.isLoaded }
        let holder = try d.connect()
        let lease = try #require(try holder.call(["op": "grant"])["lease"]?.uint64Value)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "up", "value": true, "lease": .int(Int64(lease))]).ok)
        try await until("the key shows") { svc["up"] == true && up.value == true }
        holder.close()
        try await until("the key goes") { svc["up"] == nil && up.current.exists == false }
        #expect(svc.leaseEnd(of: "up") == LeaseEnd(lease: lease, reason: .closed))
        #expect(up.current.leaseEnd == LeaseEnd(lease: lease, reason: .closed))
        try await session.set("up", to: false, in: "svc")
        try await until("written again") { svc["up"] == false && up.value == false }
        #expect(svc.contents.leaseEnds.isEmpty && up.current.leaseEnd == nil)
        await session.close()
    }

    @Test func aQuietWatchResumesFromProgressAfterTheHistoryMovedOn() async throws {
        let d = try await TestDaemon.start(["--history-limit", "10"], inMemory: true)
        let proxy = try CuttingProxy(path: d.directory + "/proxy.sock", to: d.socketPath)
        let session = ObsSession(socketPath: proxy.path, backoff: Backoff(initial: .milliseconds(20), maximum: .milliseconds(100)))
        var events = session.watch("busy", selecting: .keys(["quiet"]), initial: true).makeAsyncIterator()
        guard case .snapshot(0, _, false)? = try await events.next() else { throw TestFailure("expected the snapshot") }
        let writer = try d.connect()
        for i in 1...50 { #expect(try writer.call(["op": "set", "repo": "busy", "key": "noisy", "value": .int(Int64(i))]).ok) }
        // Once the daemon told the watch "complete through 50", cut its connection: revision 0
        // is long out of the history (it keeps 41…50), and only the progress event moved the
        // watch's position past it.
        #expect(await eventually(timeout: .seconds(10)) { () async in proxy.progress >= 50 })
        proxy.cut()
        #expect(try writer.call(["op": "set", "repo": "busy", "key": "quiet", "value": 1])["rev"] == 51)
        guard case .change(let change)? = try await events.next() else { throw TestFailure("expected the change, not a resync snapshot") }
        #expect(change.revision == 51 && change.changes.first?.new == 1)
        #expect(proxy.connections >= 2, "it did reconnect")
        await session.close()
        proxy.stop()
    }
}
