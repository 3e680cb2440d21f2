// The lease table and the leases' durability, in process (issue 32): keep-alives cost no
// memory however many come; a restart's TTLs start when the daemon serves, not when it began
// loading; a grant is answered once its frame is durable, and one storage fails ends; an
// equal-value `set` that moves a key's lease is answered once that move is durable; an undo
// that attaches a key again to a lease that ended meanwhile has it deleted.

import ObsProtocol
import ObsStore
import ObservableKit
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct LeaseTableTests {
    private let owner = Writer(uid: 1000, gid: 1000, pid: 7)

    /// Two leases with a one-year TTL, three million keep-alives of the second: the deadline
    /// heap holds at most one entry per lease (it held one per keep-alive), and both leases
    /// still end at their deadlines.
    @Test func millionsOfKeepAlivesCostNoMemory() throws {
        let table = LeaseTable(storage: InMemoryStorage())
        let year: Int64 = 31_536_000
        guard case .success(let first) = table.grant(owner: owner, ttl: year, connection: .next(), now: 0, limit: 10),
            case .success(let second) = table.grant(owner: owner, ttl: year, connection: .next(), now: 0, limit: 10)
        else { throw TestFailure("grants refused") }
        let peer = Peer(uid: 1000, gid: 1000, pid: 7, daemonUID: 0)
        for i in 1...3_000_000 { _ = table.keepAlive(second.id, by: peer, now: UInt64(i)) }
        #expect(table.deadlineEntries <= 2, "\(table.deadlineEntries) entries in the deadline heap")
        let yearNanos = UInt64(year) * 1_000_000_000
        #expect(table.expire(now: yearNanos - 1).isEmpty)
        #expect(table.expire(now: yearNanos).map(\.id) == [first.id], "the first ends at its deadline")
        #expect(table.expire(now: yearNanos + 2_999_999).isEmpty, "the second was kept alive until 3,000,000 ns")
        #expect(table.expire(now: yearNanos + 3_000_000).map(\.id) == [second.id])
        #expect(table.deadlineEntries == 0)
    }

    /// A daemon that takes 6 s to load before it serves: a TTL lease of 5 s, restored, is
    /// alive at the first request — its TTL starts in full when the daemon serves.
    @Test func restoredTTLsStartWhenTheDaemonServes() throws {
        let storage = LeasesOnlyStorage(PersistedLeases(nextID: 8, live: [7: .init(id: 7, owner: owner, ttl: 5)]))
        let server = try TestServer(storage: storage)
        server.hub.leases.restore(time: 0, in: server.hub)
        server.advanceTime(by: .seconds(6))  // loading
        server.hub.leases.startClocks(now: server.clock.now)
        let c = try TestConnection(server)
        try c.send(lines(#"{"id":1,"op":"keepalive","lease":7}"#))
        #expect(try c.received().first?["ttl"] == .int(5), "a restored lease expired before the daemon served")
        server.advanceTime(by: .milliseconds(4_999))
        try c.send(lines(#"{"id":2,"op":"grant"}"#))
        #expect(try c.received().first?["lease"] == .int(8), "ids continue after the stored ones")
        server.advanceTime(by: .seconds(6))
        try c.send(lines(#"{"id":3,"op":"keepalive","lease":7}"#))
        #expect(try c.received().first?.errorCode == "not_found", "5 s after the keep-alive it has expired")
    }

    /// A grant is answered once its frame is durable; one storage fails is answered with the
    /// failure, and the lease has ended (a write naming it is `not_found`).
    @Test func aGrantIsAnsweredOnceDurableAndEndsIfStorageFailsIt() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let c = try TestConnection(server)
        try c.send(lines(#"{"id":1,"op":"grant","ttl":60}"#))
        #expect(try c.received().isEmpty, "answered before its grant was durable")
        storage.confirmAll()
        let lease = try #require(try c.received().first?["lease"]?.uint64Value)

        try c.send(lines(#"{"id":2,"op":"grant","ttl":60}"#))
        try server.leaseTable.failed(after: 1, error: StorageError(.full, "test: disk full"))
        let failed = try #require(try c.received().first)
        #expect(failed.errorCode == "internal", "\(failed)")
        try c.send(lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":1,"lease":\#(lease + 1)}"#))
        #expect(try c.received().first?.errorCode == "not_found", "the lease storage failed to grant lives on")
    }

    /// `set` of an equal value naming a lease changes nothing but the key's lease: its reply
    /// waits until that move is durable (it was answered before), and a failure undoes it.
    @Test func anEqualValueSetThatMovesALeaseIsAnsweredOnceTheMoveIsDurable() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let c = try TestConnection(server)
        try c.send(lines(#"{"id":1,"op":"grant","ttl":60}"#, #"{"id":2,"op":"set","repo":"r","key":"k","value":1}"#))
        storage.confirmAll()
        let lease = try #require(try c.received().first?["lease"]?.uint64Value)
        let repository = try #require(server.hub.repositories.existing("r"))

        try c.send(lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":1,"lease":\#(lease)}"#))
        #expect(try c.received().isEmpty, "answered before the attachment was durable")
        #expect(repository.lease(of: "k") == lease)
        storage.confirmAll()
        let reply = try #require(try c.received().first)
        #expect(reply["changed"] == .bool(false) && reply["rev"] == .int(1), "\(reply)")

        // Moved again, to none, and storage fails it: the move is undone, the reply says so.
        try c.send(lines(#"{"id":4,"op":"set","repo":"r","key":"k","value":1}"#))
        repository.failed(after: 2, error: StorageError(.io, "injected"))
        #expect(try c.received().first?.errorCode == "internal")
        #expect(repository.lease(of: "k") == lease, "the undone move is taken back")
    }

    /// k attached to lease M; a write moves it to lease L and is pending; M is revoked (its
    /// end finds k attached to L: nothing to delete); storage then fails the write, and the
    /// undo attaches k to M again — an ended lease: k is deleted a second later, by M's end.
    @Test func anUndoThatAttachesAKeyToAnEndedLeaseHasItDeleted() throws {
        let storage = ManualStorage()
        let server = try TestServer(storage: storage)
        let c = try TestConnection(server)
        try c.send(lines(#"{"id":1,"op":"grant","ttl":60}"#, #"{"id":2,"op":"grant","ttl":60}"#))
        storage.confirmAll()
        let leases = try c.received().compactMap { $0["lease"]?.uint64Value }
        try #require(leases.count == 2)
        let (m, l) = (leases[0], leases[1])
        try c.send(lines(#"{"id":3,"op":"set","repo":"r","key":"k","value":1,"lease":\#(m)}"#))
        storage.confirmAll()
        #expect(try c.received().map(\.errorCode) == [nil])
        let repository = try #require(server.hub.repositories.existing("r"))

        try c.send(lines(#"{"id":4,"op":"set","repo":"r","key":"k","value":2,"lease":\#(l)}"#))
        let revoker = try TestConnection(server)
        try revoker.send(lines(#"{"id":5,"op":"revoke","lease":\#(m)}"#))
        try server.leaseTable.durable(through: .max)
        #expect(try revoker.received().first?["revs"]?.objectValue?.isEmpty == true, "m held no key when it ended")
        repository.failed(after: 1, error: StorageError(.io, "injected"))
        #expect(try c.received().first?.errorCode == "internal")
        #expect(repository.lease(of: "k") == m && repository.revision == 1, "undone: k is 1 again, attached to the ended lease")

        server.advanceTime(by: .seconds(1))
        #expect(repository.revision == 2, "the deletion the undo owed was not made")
        storage.confirmAll()
        try c.send(lines(#"{"id":6,"op":"get","repo":"r","key":"k"}"#))
        #expect(try c.received().last?.errorCode == "not_found")
    }
}

/// Storage that loaded nothing but `leases` (and keeps what it is given, durable at once).
private final class LeasesOnlyStorage: Storage {
    private let leases: Locked<PersistedLeases?>
    init(_ leases: PersistedLeases) { self.leases = Locked(leases) }
    var isImmediate: Bool { true }
    var summary: String { "leases only (test)" }
    var counters: StorageCounters? { nil }
    var notices: [String] { [] }
    func load() -> [LoadedRepository] { [] }
    func loadLeases() -> PersistedLeases { leases.withLock { l in defer { l = nil }; return l ?? PersistedLeases() } }
    func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool { true }
    func discard(_ listener: any DurabilityListener, after sequence: UInt64) {}
    func close() {}
}
