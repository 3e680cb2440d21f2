// In-process tests of the daemon's shared state: which repository objects the hub hands
// out, and that none is ever used after the hub let go of it.

import NIOEmbedded
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import Testing

@testable import ObsServer

/// An object whose identity stands for a connection.
final class NSObjectLike: Sendable {}

let writeLimits = WriteLimits(maxKeys: 1000, maxRepositories: 1000, maxRevisionBytes: 1 << 20)

@Suite struct HubTests {
    @Test func aRepositoryWhoseFirstRevisionWasUndoneIsStillTheOneTheHubHandsOut() throws {
        let storage = ManualStorage()
        let hub = try makeHub(storage: storage)
        let set: (Int64) -> [WriteOp<CanonicalJSON>] = { [.set("k", CanonicalJSON(.int($0)))] }
        _ = try hub.using("r") { try $0.write(set(1), now: 0, limits: writeLimits) }
        let first = try #require(hub.existing("r"))
        try hub.using("r") { held in
            // Storage fails revision 1: the repository is back at revision 0.
            held.undo(after: 0, error: StorageError(.full, "test: disk full"))
            #expect(held.revision == 0)
            // Someone else uses the repository meanwhile and lets go of it.
            hub.using("r") { _ in }
            // The holder writes again: into the repository the hub still has.
            _ = try held.write(set(2), now: 0, limits: writeLimits)
        }
        let now = try #require(hub.existing("r"), "the hub kept the repository")
        #expect(now === first)
        #expect(now.get("k").entry?.value == CanonicalJSON(.int(2)), "the write is where readers look")
    }

    @Test func concurrentConnectionsAndCreationsNeverPassTheirLimits() async throws {
        var limits = Limits.testing
        limits.maxConnections = 10
        // A thread-safe loop: the hub (and so its loop) is used and released from whatever
        // threads the tasks below run on.
        let loop = NIOAsyncTestingEventLoop()
        let hub = try makeHub(limits: limits, loop: loop)
        let peer = Peer(uid: 0, gid: 0, pid: 1)
        let admitted = Locked(0)
        let owners = (0..<200).map { _ in NSObjectLike() }
        await withTaskGroup(of: Void.self) { group in
            for owner in owners {
                group.addTask {
                    let entry = ConnectedPeer(peer: peer, since: .now, subscriptions: SubscriptionTally()) {}
                    if hub.admit(ObjectIdentifier(owner), entry) == nil { admitted.withLock { $0 += 1 } }
                }
            }
        }
        #expect(admitted.withLock { $0 } == 10)
        #expect(hub.stats.connections.load(ordering: .relaxed) == 10)

        let repositoryLimits = WriteLimits(maxKeys: 10, maxRepositories: 7, maxRevisionBytes: 1 << 20)
        let created = Locked(0)
        await withTaskGroup(of: Void.self) { group in
            for i in 0..<100 {
                group.addTask {
                    let result = hub.using("r\(i)") { repo in
                        Result { () throws(WriteRefusal) in try repo.write([.set("k", CanonicalJSON(1))], now: 0, limits: repositoryLimits) }
                    }
                    if case .success = result { created.withLock { $0 += 1 } }
                }
            }
        }
        #expect(created.withLock { $0 } == 7)
        #expect(hub.repositoryCount == 7 && hub.listed().count == 7)
        await loop.shutdownGracefully()
    }

    @Test func placeholdersOfRepositoriesNobodyWroteAreDroppedWhenUnused() throws {
        let hub = try makeHub()
        hub.using("ghost") { _ in }
        #expect(hub.existing("ghost") == nil)
    }
}

@Suite struct MessageSizeTests {
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
