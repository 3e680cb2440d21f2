// In-process tests of the daemon's shared state: which repository objects the hub hands out,
// that none is ever used after the hub let go of it, and that concurrent connections and
// creations never pass their limits.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Testing
import TestSupport

@testable import ObsServer

/// A write as a session makes it, decided at once (a local store).
func write(_ hub: Hub, _ repository: Repository, _ ops: [WriteOp<CanonicalJSON>], maxRepositories: Int = 1000, maxKeys: Int = 1000) -> WriteDecision? {
    WriteOps(ops).withRawOps { raw in
        let input = WriteInput(
            ops: raw,
            context: WriteContext(
                limits: WriteLimits(maxKeys: maxKeys, maxRevisionBytes: 1 << 20), maxRepositories: maxRepositories,
                peer: Peer(uid: 0, gid: 0, pid: 1, daemonUID: 0), writer: Writer(uid: 0, gid: 0, pid: 1), origin: ConnectionID.next(), time: 0,
                single: ops.count == 1))
        return hub.sequencer.submit(input, to: repository, scratch: WriteScratch(), route: { AnswerRoute(loop: hub.shards[0].loop) { _, _, _ in } }, token: 0)
    }
}

@Suite(.mayBlock) struct HubTests {
    @Test func aRepositoryWhoseFirstRevisionWasUndoneIsStillTheOneTheHubHandsOut() throws {
        let server = try TestServer(storage: ManualStorage())
        let hub = server.hub
        let set: (Int64) -> [WriteOp<CanonicalJSON>] = { [.set("k", CanonicalJSON(.int($0)))] }
        let held = hub.repositories.hold("r")
        _ = write(hub, held, set(1))
        let first = try #require(hub.repositories.existing("r"))
        // Storage fails revision 1: the repository is back at revision 0.
        held.failed(after: 0, error: StorageError(.full, "test: disk full"))
        #expect(held.revision == 0)
        // Someone else uses the repository meanwhile and lets go of it.
        _ = hub.repositories.hold("r")
        hub.repositories.release("r")
        // The holder writes again: into the repository the hub still has.
        _ = write(hub, held, set(2))
        hub.repositories.release("r")
        let now = try #require(hub.repositories.existing("r"), "the hub kept the repository")
        #expect(now === first)
        #expect(now.get("k").entry?.value == CanonicalJSON(.int(2)), "the write is where readers look")
    }

    /// A refusal names the state it was checked against, and an undo of that state voids it:
    /// a conflict with a pending write that storage then fails is never shown as durable. (The
    /// session used to read the repository's current state after the check; an undo in between
    /// made that the durable state, and the robustness suite saw `conflict: key "q/1" is at
    /// revision 6450` for a revision 6450 that was undone — seed 580200557009.)
    @Test func aRefusalOfAPendingStateIsVoidedWhenThatStateIsUndone() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let hub = server.hub
        let repository = hub.repositories.hold("r")
        defer { hub.repositories.release("r") }
        _ = write(hub, repository, [.set("k", CanonicalJSON(.int(1)))])
        storage.confirmAll()
        guard case .success(let pending) = write(hub, repository, [.set("k", CanonicalJSON(.int(2)))]) else {
            Issue.record("the second write was not applied")
            return
        }
        #expect(!repository.isDurable(pending.sequence), "storage has not confirmed it")
        // Checked against the pending revision 2: a conflict, which names that state.
        guard case .failure(.refused(.conflict, let checked)) = write(hub, repository, [.set("k", CanonicalJSON(.int(3)), ifRevision: 1)]) else {
            Issue.record("ifRev 1 against revision 2 is not a conflict")
            return
        }
        #expect(checked == pending.sequence)
        repository.failed(after: 1, error: StorageError(.full, "test: disk full"))
        guard case .failed = repository.awaitDurable(checked, on: hub.shards[0]) else {
            Issue.record("a refusal of an undone state may be shown")
            return
        }
        // What reading the state after the check would have named: the durable one.
        #expect(repository.revision == 1)
    }

    @Test func concurrentConnectionsAndCreationsNeverPassTheirLimits() async throws {
        var limits = Limits.testing
        limits.maxConnections = 10
        let server = try TestServer(limits: limits)
        let hub = server.hub
        let peer = Peer(uid: 0, gid: 0, pid: 1, daemonUID: 0)
        let admitted = Locked(0)
        await withTaskGroup(of: Void.self) { group in
            for _ in 0..<200 {
                group.addTask {
                    let entry = ConnectedPeer(peer: peer, since: .now, subscriptions: SubscriptionTally()) {}
                    if hub.peers.admit(.next(), entry) == nil { admitted.withLock { $0 += 1 } }
                }
            }
        }
        #expect(admitted.withLock { $0 } == 10)
        #expect(hub.stats.connections.load(ordering: .relaxed) == 10)

        let created = Locked(0)
        await withTaskGroup(of: Void.self) { group in
            for i in 0..<100 {
                group.addTask {
                    let repository = hub.repositories.hold("r\(i)")
                    defer { hub.repositories.release("r\(i)") }
                    if case .success? = write(hub, repository, [.set("k", CanonicalJSON(1))], maxRepositories: 7, maxKeys: 10) {
                        created.withLock { $0 += 1 }
                    }
                }
            }
        }
        #expect(created.withLock { $0 } == 7)
        #expect(hub.repositories.count == 7 && hub.repositories.listed().count == 7)
    }

    @Test func placeholdersOfRepositoriesNobodyWroteAreDroppedWhenUnused() throws {
        let server = try TestServer()
        _ = server.hub.repositories.hold("ghost")
        server.hub.repositories.release("ghost")
        #expect(server.hub.repositories.existing("ghost") == nil)
    }

    /// A loop keeps its own count of the subscriptions to a repository it routes, and the
    /// repository reads it (the loop never calls the repository or the hub): every way a
    /// subscription ends — an unsubscribe, a closing connection, an overflow in delivery —
    /// leaves the counts right, and a placeholder goes with its last subscription.
    @Test func subscriptionEndsAreCountedByTheirLoopsAndAPlaceholderGoesWithTheLast() throws {
        var limits = Limits.testing
        limits.queueEvents = 3
        let server = try TestServer(limits: limits, loops: 2)
        let hub = server.hub
        let first = try TestConnection(server, loop: 0)
        let second = try TestConnection(server, loop: 1)
        let third = try TestConnection(server, loop: 1)
        try first.send(lines(#"{"id":1,"op":"subscribe","repo":"ghost"}"#, #"{"id":2,"op":"subscribe","repo":"ghost","keys":["k"]}"#))
        try second.send(lines(#"{"id":1,"op":"subscribe","repo":"ghost"}"#))
        try third.send(lines(#"{"id":1,"op":"subscribe","repo":"ghost"}"#))
        #expect(try first.received().map { $0["sub"] } == [1, 2])
        #expect(try second.received().map { $0["sub"] } == [1])
        #expect(try third.received().map { $0["sub"] } == [1])
        let ghost = try #require(hub.repositories.existing("ghost"))
        #expect(ghost.subscriberCount == 4)

        try first.send(lines(#"{"id":3,"op":"unsubscribe","sub":1}"#))
        #expect(try first.received().map { $0["ok"] } == [true])
        #expect(ghost.subscriberCount == 3)
        first.close()
        #expect(ghost.subscriberCount == 2)
        second.close()
        #expect(ghost.subscriberCount == 1)
        #expect(hub.repositories.existing("ghost") === ghost, "the other loop still routes it")

        // `third` subscribes to a written repository too, reads nothing, and overflows: its
        // loop's delivery ends both of its subscriptions, the placeholder's last.
        let writer = try TestConnection(server, loop: 0)
        try writer.send(lines(#"{"id":1,"op":"set","repo":"r","key":"k","value":0}"#))
        #expect(try writer.received().map { $0["ok"] } == [true])
        try third.send(lines(#"{"id":2,"op":"subscribe","repo":"r"}"#))
        #expect(try third.received().map { $0["sub"] } == [2])
        let written = try #require(hub.repositories.existing("r"))
        #expect(written.subscriberCount == 1)
        try third.setWritable(false)
        for n in 1...5 { try writer.send(lines(#"{"id":\#(n + 1),"op":"set","repo":"r","key":"k","value":\#(n)}"#)) }
        #expect(try writer.received().count == 5)
        #expect(hub.stats.overflows.load(ordering: .relaxed) == 1)
        #expect(written.subscriberCount == 0)
        #expect(ghost.subscriberCount == 0)
        #expect(hub.repositories.existing("ghost") == nil, "the placeholder went with its last subscription")
        #expect(hub.repositories.existing("r") === written, "a written repository stays")
    }
}

@Suite(.mayBlock) struct MessageSizeTests {
    @Test func aReplyPastTheMessageLimitIsRefusedBeforeItIsBuilt() {
        let value = CanonicalJSON(.string(String(repeating: "v", count: 1000)))
        let entries = (0..<3000).map { (key: Key("k\($0)"), value: value) }
        let refusal = Session.tooLargeToSend(entries, values: true, what: "this list", limit: 2 << 20)
        #expect(refusal?.code == .tooLarge)
        #expect(refusal?.message.contains("this list would take more than 2 MiB") == true)
        #expect(Session.tooLargeToSend(entries, values: false, what: "this list", limit: 2 << 20) == nil, "keys alone fit")
        #expect(Session.tooLargeToSend(entries, values: true, what: "this list") == nil, "3 MB is far below 1 GiB")
    }
}
