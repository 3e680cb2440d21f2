// The lease table over a real lease journal: what it records — grants, ends and attachments,
// across the journal's rewrites — reads back as the table's state, also when a move is what
// triggers the rewrite (the rewrite holds the table's state first, then the move); a grant
// waiting for its sync holds no lock, and one whose sync fails is taken back.

import Dispatch
import Foundation
import Logging
import ObsProtocol
import ObsStore
import ObservableKit
import TestSupport
import Synchronization
import Testing

@testable import ObsServer

@Suite struct LeaseJournalTableTests {
    @Test func movesAcrossARewriteReadBackAsTheTableHasThem() throws {
        let dir = try temporaryLeaseDirectory()
        let journal = try LeaseJournal(directory: dir, sync: .relaxed(interval: .seconds(1)), logger: Logger(label: "test"))
        let table = LeaseTable(journal: journal)
        let owner = Writer(uid: 1000, gid: 1000, pid: 7)
        let connection = ConnectionID.next()
        guard case .success(let kept) = table.grant(owner: owner, ttl: 60, connection: connection, now: 0, limit: 10),
            case .success(let gone) = table.grant(owner: owner, ttl: 60, connection: connection, now: 0, limit: 10)
        else { throw TestFailure("grants refused") }
        // Enough moves of long keys to take the journal past its rewrite threshold (1 MiB),
        // so that some move is the one that triggers a rewrite; every move must survive.
        let long = String(repeating: "k", count: 1000)
        let keys = (0..<3000).map { Key("\(long)\($0)") }
        for key in keys { table.move(key, of: "r", from: nil, to: kept) }
        table.move(keys[0], of: "r", from: kept, to: gone)
        _ = table.revoke(gone, by: Peer(uid: 1000, gid: 1000, pid: 7, daemonUID: 0))
        journal.close()

        let found = try LeaseJournal(directory: dir, sync: .always, logger: Logger(label: "test")).takeLoaded()
        #expect(found.live.keys.sorted() == [kept] && found.nextID == gone + 1)
        let attached = found.attachments["r"] ?? [:]
        #expect(attached.count == 3000 && keys.dropFirst().allSatisfy { attached[$0] == kept }, "\(attached.count) keys attached")
        #expect(attached[keys[0]] == gone && found.ended[gone]?.reason == .revoked, "the moved key's lease, ended")
    }

    /// Under `sync = always` a grant is synced before it is answered: while that sync waits
    /// for the disk, writes on other loops still attach keys and check leases (they take the
    /// table's and the journal's locks), and the grant then succeeds with its key attached.
    @Test func aGrantWaitingForItsSyncHoldsNoLock() throws {
        let dir = try temporaryLeaseDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let gate = SyncGate()
        let journal = try LeaseJournal(directory: dir, sync: .always, logger: Logger(label: "test"), syncFile: gate.sync)
        let table = LeaseTable(journal: journal)
        let owner = Writer(uid: 1000, gid: 1000, pid: 7)
        let granted = Mutex<Result<UInt64, LeaseRefusal>?>(nil)
        let grantDone = DispatchSemaphore(value: 0)
        DispatchQueue.global().async {
            let result = table.grant(owner: owner, ttl: 60, connection: ConnectionID.next(), now: 0, limit: 10)
            granted.withLock { $0 = result }
            grantDone.signal()
        }
        try #require(gate.entered.wait(timeout: .now() + 30) == .success, "the grant never synced")

        let othersDone = DispatchSemaphore(value: 0)
        DispatchQueue.global().async {
            table.move("k", of: "r", from: nil, to: 1)
            _ = table.check(1, by: Peer(uid: 1000, gid: 1000, pid: 8, daemonUID: 0))
            othersDone.signal()
        }
        let notBlocked = othersDone.wait(timeout: .now() + 10) == .success
        gate.open()
        #expect(notBlocked, "a write's attachment waited for a grant's sync")
        #expect(grantDone.wait(timeout: .now() + 30) == .success)
        if !notBlocked { _ = othersDone.wait(timeout: .now() + 30) }
        guard case .success(let id)? = granted.withLock({ $0 }) else {
            Issue.record("the grant failed: \(String(describing: granted.withLock { $0 }))")
            return
        }
        #expect(id == 1)
        journal.close()
        let found = try LeaseJournal(directory: dir, sync: .always, logger: Logger(label: "test")).takeLoaded()
        #expect(found.live.keys.sorted() == [1] && found.attachments["r"]?["k"] == 1)
    }

    /// A grant whose sync fails is refused and taken back: the uid's count is free again,
    /// and the journal says the lease ended.
    @Test func aGrantWhoseSyncFailsIsRefusedAndTakenBack() throws {
        let dir = try temporaryLeaseDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let failing = Mutex(true)
        let journal = try LeaseJournal(
            directory: dir, sync: .always, logger: Logger(label: "test"),
            syncFile: { fd in
                if failing.withLock({ $0 }) {
                    errno = EIO
                    return -1
                }
                return fdatasync(fd)
            })
        let table = LeaseTable(journal: journal)
        let owner = Writer(uid: 1000, gid: 1000, pid: 7)
        guard case .failure(.unavailable(let message)) = table.grant(owner: owner, ttl: nil, connection: ConnectionID.next(), now: 0, limit: 1) else {
            Issue.record("a grant whose sync failed was not refused as unavailable")
            return
        }
        #expect(message.contains("Input/output error"))
        #expect(table.count == 0)
        failing.withLock { $0 = false }
        guard case .success(let id) = table.grant(owner: owner, ttl: nil, connection: ConnectionID.next(), now: 0, limit: 1) else {
            Issue.record("the uid's one lease was still counted")
            return
        }
        #expect(id == 2, "ids are never reused")
        journal.close()
        let found = try LeaseJournal(directory: dir, sync: .always, logger: Logger(label: "test")).takeLoaded()
        #expect(found.live.keys.sorted() == [2] && found.ended[1]?.reason == .revoked)
    }
}

private func temporaryLeaseDirectory() throws -> String {
    TemporaryDirectory.make(prefix: "obsd-lease-table-")
}

/// A sync that waits, the first time, until the test opens the gate (and says it started).
private final class SyncGate: Sendable {
    let entered = DispatchSemaphore(value: 0)
    private let opened = DispatchSemaphore(value: 0)
    private let first = Mutex(true)

    var sync: @Sendable (Int32) -> Int32 {
        { [self] fd in
            if first.withLock({ f in defer { f = false }; return f }) {
                entered.signal()
                opened.wait()
            }
            return fdatasync(fd)
        }
    }

    func open() { opened.signal() }
}
