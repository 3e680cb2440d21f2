// End-to-end tests of the ObsClient library against the real daemon.

import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.timeLimit(.minutes(3))) struct ClientLibraryTests {
    @Test func everyOperation() async throws {
        let d = try await TestDaemon.start()
        try await ObsClient.withConnection(socketPath: d.socketPath) { client in
            let info = try await client.hello(client: "tests")
            #expect(info.protocolVersion == 1 && info.maxLine == 1 << 20 && info.server.hasPrefix("obsd/"))
            try await client.ping()
            #expect(try await client.get("ui", "theme") == nil)
            let created = try await client.set("ui", "theme", "light")
            #expect(created == WriteReply(revision: 1, changed: true, old: nil))
            #expect(try await client.set("ui", "theme", "light") == WriteReply(revision: 1, changed: false, old: "light"))
            #expect(try await client.set("ui", "theme", "light", force: true).changed)
            #expect(try await client.get("ui", "theme") == Entry(value: "light", revision: 2))
            do throws(ObsClientError) {
                try await client.set("ui", "theme", "dark", ifRev: 1)
                Issue.record("expected a conflict")
            } catch {
                #expect(error.code == .conflict)
                #expect(error.description.contains("revision 2"))
            }
            #expect(try await client.batch("ui", [.set("a", 1), .set("b", 2), .delete("theme")]) == BatchReply(revision: 3, changed: true))
            let listing = try await client.list("ui", values: true)
            #expect(listing.keys == ["a", "b"] && listing.values == ["a": 1, "b": 2] && listing.revision == 3)
            #expect(try await client.list("ui", prefix: "b").keys == ["b"])
            #expect(try await client.delete("ui", "a") == WriteReply(revision: 4, changed: true, old: 1))
            #expect(try await client.repos() == [RepositoryInfo(name: "ui", revision: 4, keys: 1, epoch: listing.epoch)])
            #expect(!listing.epoch.isEmpty)
            let stats = try await client.stats()
            #expect(stats["connections"] == 1 && stats["repos"] == 1)
            do throws(ObsClientError) {
                _ = try await client.get("bad name", "k")
                Issue.record("expected bad_request")
            } catch {
                #expect(error.code == .badRequest)
            }
        }
    }

    @Test func subscriptionSequenceWithSnapshotSinceOnceAndCancel() async throws {
        let d = try await TestDaemon.start()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        try await client.set("s", "theme", "light")
        let initial = try await client.subscribe("s", .key("theme"), initial: true)
        var it = initial.makeAsyncIterator()
        guard case .snapshot(1, let values) = try await it.next() else { Issue.record("snapshot first"); return }
        #expect(values == ["theme": "light"])
        try await client.set("s", "theme", "dark")
        guard case .change(let c) = try await it.next() else { Issue.record("change"); return }
        #expect(c == ChangeEvent(subscription: initial.id, repository: "s", revision: 2, changes: [Change(key: "theme", old: "light", new: "dark")]))
        try await initial.cancel()
        #expect(try await it.next() == nil, "the sequence finishes after cancel")

        let replay = try await client.subscribe("s", since: 0)
        var r = replay.makeAsyncIterator()
        #expect(try await r.next()?.revision == 1)
        #expect(try await r.next()?.revision == 2)
        guard case .synced(2) = try await r.next() else { Issue.record("synced"); return }

        let once = try await client.subscribe("s", .key("theme"), once: true)
        try await client.set("s", "theme", "x")
        try await client.set("s", "theme", "y")
        var o = once.makeAsyncIterator()
        #expect(try await o.next()?.revision == 3)
        #expect(try await o.next() == nil, "once ends after its change")

        do throws(ObsClientError) {
            _ = try await client.subscribe("s", since: 99)
            Issue.record("expected compacted")
        } catch {
            #expect(error.code == .compacted)
        }
        await client.close()
    }

    @Test func connectionErrorsAreClear() async throws {
        do throws(ObsClientError) {
            _ = try await ObsClient.connect(socketPath: "/tmp/obsd-test-no-such-dir/obsd.sock")
            Issue.record("expected cannotConnect")
        } catch {
            #expect(error.description == "cannot connect to obsd at /tmp/obsd-test-no-such-dir/obsd.sock: no such file — is obsd running?")
        }
        let d = try await TestDaemon.start()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        let sub = try await client.subscribe("x")
        #expect(await d.stop() == 0)
        do {
            for try await _ in sub {}
            Issue.record("the stream should fail when the daemon goes away")
        } catch let error as ObsClientError {
            guard case .connectionClosed = error else { Issue.record("unexpected \(error)"); return }
        }
        do throws(ObsClientError) {
            try await client.ping()
            Issue.record("expected connectionClosed")
        } catch {
            guard case .connectionClosed = error else { Issue.record("unexpected \(error)"); return }
        }
    }

    @Test func aClientDroppedWithoutCloseClosesItsConnection() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let observer = try await ObsClient.connect(socketPath: d.socketPath)
        try await connectSubscribeAndDrop(d.socketPath)
        let closed = await eventually { () async -> Bool in (try? await observer.stats())?["connections"] == 1 }
        #expect(closed, "the dropped client's connection and subscription are gone")
        #expect(try await observer.stats()["subscriptions"] == 0)
        await observer.close()
    }

    @Test func aSubscriptionBeingIteratedKeepsItsClientOpen() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        var events = try await iteratorWhoseClientIsDropped(d.socketPath)
        try await ObsClient.withConnection(socketPath: d.socketPath) { client in _ = try await client.set("r", "k", 1) }
        guard case .change(let change) = try await events.next() else { throw TestFailure("expected the change") }
        #expect(change.revision == 1)
    }

    @Test func concurrentCallsOnOneConnectionEachGetTheirReply() async throws {
        let d = try await TestDaemon.start()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        try await withThrowingTaskGroup(of: Void.self) { group in
            for i in 0..<200 {
                group.addTask {
                    let key = Key("k\(i)")
                    try await client.set("p", key, .int(Int64(i)))
                    #expect(try await client.get("p", key)?.value == .int(Int64(i)))
                }
            }
            try await group.waitForAll()
        }
        #expect(try await client.list("p").keys.count == 200)
        await client.close()
    }

    @Test func abandonedSubscriptionsDoNotStallTheConnection() async throws {
        // Each abandoned subscription leaves thousands of unread events; together more than
        // the client's read-pause threshold (8192). Reading must go on regardless.
        let d = try await TestDaemon.start()
        let client = try await ObsClient.connect(socketPath: d.socketPath)
        let writer = try await ObsClient.connect(socketPath: d.socketPath)
        var next = 0
        for _ in 0..<4 {
            do {
                let abandoned = try await client.subscribe("a")
                for _ in 0..<3_000 {
                    next += 1
                    try await writer.set("a", "k", .int(Int64(next)))
                }
                _ = abandoned.id
            }
        }
        try await client.ping()
        let fresh = try await client.subscribe("a", .key("k"))
        try await writer.set("a", "k", "last")
        var it = fresh.makeAsyncIterator()
        guard case .change(let c) = try await it.next() else { Issue.record("expected a change"); return }
        #expect(c.changes.first?.new == "last")
        await client.close()
        await writer.close()
    }
}

/// Connects, subscribes, and lets go of both without closing anything.
private func connectSubscribeAndDrop(_ socketPath: String) async throws {
    let client = try await ObsClient.connect(socketPath: socketPath)
    _ = try await client.subscribe("r")
}

/// An iterator of a subscription whose client nobody else holds.
private func iteratorWhoseClientIsDropped(_ socketPath: String) async throws -> Subscription.AsyncIterator {
    let client = try await ObsClient.connect(socketPath: socketPath)
    return try await client.subscribe("r").makeAsyncIterator()
}
