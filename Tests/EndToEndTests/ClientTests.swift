// End-to-end tests of the ObsClient library against the real daemon.

import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ClientLibraryTests {
    @Test func everyOperation() async throws {
        let d = try await TestDaemon.start()
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in
            let info = try await client.hello(client: "tests")
            #expect(info.protocolVersion == 1 && info.maxLine == 1 << 20 && info.server.hasPrefix("obsd/"))
            try await client.ping()
            #expect(try await client.get("theme", in: "ui") == nil)
            let created = try await client.set("theme", to: "light", in: "ui")
            #expect(created == WriteReply(revision: 1, changed: true, old: nil))
            #expect(try await client.set("theme", to: "light", in: "ui") == WriteReply(revision: 1, changed: false, old: "light"))
            #expect(try await client.set("theme", to: "light", in: "ui", force: true).changed)
            #expect(try await client.get("theme", in: "ui") == Entry(value: "light", revision: 2))
            do throws(ObsClientError) {
                try await client.set("theme", to: "dark", in: "ui", ifRevision: 1)
                Issue.record("expected a conflict")
            } catch {
                #expect(error.code == .conflict)
                #expect(error.description.contains("revision 2"))
            }
            #expect(try await client.apply([.set("a", 1), .set("b", 2), .delete("theme")], in: "ui") == BatchReply(revision: 3, changed: true))
            let listing = try await client.list("ui", includingValues: true)
            #expect(listing.keys == ["a", "b"] && listing.values == ["a": 1, "b": 2] && listing.revision == 3)
            #expect(try await client.list("ui", prefix: "b").keys == ["b"])
            #expect(try await client.delete("a", in: "ui") == WriteReply(revision: 4, changed: true, old: 1))
            #expect(try await client.repositories() == [RepositoryInfo(name: "ui", revision: 4, keys: 1, epoch: listing.epoch)])
            #expect(!listing.epoch.isEmpty)
            let stats = try await client.statistics()
            #expect(stats.connections == 1 && stats.repositories == 1)
            do throws(ObsClientError) {
                _ = try await client.get("k", in: "bad name")
                Issue.record("expected bad_request")
            } catch {
                #expect(error.code == .badRequest)
            }
        }
    }

    @Test func subscriptionSequenceWithSnapshotSinceOnceAndCancel() async throws {
        let d = try await TestDaemon.start()
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        try await client.set("theme", to: "light", in: "s")
        let initial = try await client.subscribe(to: "s", selecting: .key("theme"), initial: true)
        var it = initial.makeAsyncIterator()
        guard case .snapshot(1, let values) = try await it.next() else { Issue.record("snapshot first"); return }
        #expect(values == ["theme": "light"])
        try await client.set("theme", to: "dark", in: "s")
        guard case .change(let c) = try await it.next() else { Issue.record("change"); return }
        #expect(c == ChangeEvent(subscription: initial.id, repository: "s", revision: 2, changes: [Change(key: "theme", old: "light", new: "dark")]))
        try await initial.cancel()
        #expect(try await it.next() == nil, "the sequence finishes after cancel")

        let replay = try await client.subscribe(to: "s", since: 0)
        var r = replay.makeAsyncIterator()
        #expect(try await r.next()?.revision == 1)
        #expect(try await r.next()?.revision == 2)
        guard case .synced(2) = try await r.next() else { Issue.record("synced"); return }

        let once = try await client.subscribe(to: "s", selecting: .key("theme"), once: true)
        try await client.set("theme", to: "x", in: "s")
        try await client.set("theme", to: "y", in: "s")
        var o = once.makeAsyncIterator()
        #expect(try await o.next()?.revision == 3)
        #expect(try await o.next() == nil, "once ends after its change")

        do throws(ObsClientError) {
            _ = try await client.subscribe(to: "s", since: 99)
            Issue.record("expected compacted")
        } catch {
            #expect(error.code == .compacted)
        }
        await client.close()
    }

    @Test func connectionErrorsAreClear() async throws {
        do throws(ObsClientError) {
            _ = try await ObsConnection.connect(socketPath: "/tmp/obsd-test-no-such-dir/obsd.sock")
            Issue.record("expected cannotConnect")
        } catch {
            #expect(error.description == "cannot connect to obsd at /tmp/obsd-test-no-such-dir/obsd.sock: no such file — is obsd running?")
        }
        let d = try await TestDaemon.start()
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        let sub = try await client.subscribe(to: "x")
        #expect(await d.stop() == 0)
        do {
            for try await _ in sub {}
            Issue.record("the stream should fail when the daemon goes away")
        } catch let error as ObsClientError {
            guard error.code == .connectionClosed else { Issue.record("unexpected \(error)"); return }
        }
        do throws(ObsClientError) {
            try await client.ping()
            Issue.record("expected connectionClosed")
        } catch {
            guard error.code == .connectionClosed else { Issue.record("unexpected \(error)"); return }
        }
    }

    @Test func aClientDroppedWithoutCloseClosesItsConnection() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let observer = try await ObsConnection.connect(socketPath: d.socketPath)
        try await connectSubscribeAndDrop(d.socketPath)
        let closed = await eventually { () async -> Bool in (try? await observer.statistics())?.connections == 1 }
        #expect(closed, "the dropped client's connection and subscription are gone")
        #expect(try await observer.statistics().subscriptions == 0)
        await observer.close()
    }

    @Test func aSubscriptionBeingIteratedKeepsItsClientOpen() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        var events = try await iteratorWhoseClientIsDropped(d.socketPath)
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in _ = try await client.set("k", to: 1, in: "r") }
        guard case .change(let change) = try await events.next() else { throw TestFailure("expected the change") }
        #expect(change.revision == 1)
    }

    @Test func concurrentCallsOnOneConnectionEachGetTheirReply() async throws {
        let d = try await TestDaemon.start()
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        try await withThrowingTaskGroup(of: Void.self) { group in
            for i in 0..<200 {
                group.addTask {
                    let key = Key("k\(i)")
                    try await client.set(key, to: .int(Int64(i)), in: "p")
                    #expect(try await client.get(key, in: "p")?.value == .int(Int64(i)))
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
        let client = try await ObsConnection.connect(socketPath: d.socketPath)
        let writer = try await ObsConnection.connect(socketPath: d.socketPath)
        var next = 0
        for _ in 0..<4 {
            do {
                let abandoned = try await client.subscribe(to: "a")
                for _ in 0..<3_000 {
                    next += 1
                    try await writer.set("k", to: .int(Int64(next)), in: "a")
                }
                _ = abandoned.id
            }
        }
        try await client.ping()
        let fresh = try await client.subscribe(to: "a", selecting: .key("k"))
        try await writer.set("k", to: "last", in: "a")
        var it = fresh.makeAsyncIterator()
        guard case .change(let c) = try await it.next() else { Issue.record("expected a change"); return }
        #expect(c.changes.first?.new == "last")
        await client.close()
        await writer.close()
    }
}

/// Connects, subscribes, and lets go of both without closing anything.
private func connectSubscribeAndDrop(_ socketPath: String) async throws {
    let client = try await ObsConnection.connect(socketPath: socketPath)
    _ = try await client.subscribe(to: "r")
}

/// An iterator of a subscription whose client nobody else holds.
private func iteratorWhoseClientIsDropped(_ socketPath: String) async throws -> Subscription.AsyncIterator {
    let client = try await ObsConnection.connect(socketPath: socketPath)
    return try await client.subscribe(to: "r").makeAsyncIterator()
}
