// Tests of leases in the store: grants, ends and the attachments writes move ride in the log
// with the revisions — what is durable reads back after a crash and after a checkpoint, and
// an attachment is never found without the write that moved it (nor that write without it);
// the snapshot keeps the live leases and the ended ones a key is still attached to; the
// journal an earlier obsd kept beside its log is migrated once (its owed deletions with it)
// and removed, and a damaged one refuses start-up naming it; a revision's lease end survives
// the log's encoding and the snapshot's.

import Foundation
import Logging
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

/// The lease table as storage sees it: a listener numbering its frames, recording how far
/// they are durable.
private final class Table: DurabilityListener {
    let next = Locked<UInt64>(0)
    let durable = Locked<UInt64>(0)
    func durable(through sequence: UInt64) { durable.withLock { $0 = max($0, sequence) } }
    func failed(after sequence: UInt64, error: StorageError) {}
    func append(_ frame: LogFrame, to storage: DiskStorage) -> Bool {
        storage.append(frame, sequence: next.withLock { $0 += 1; return $0 }, listener: self)
    }
}

/// A store in `dir` that takes no checkpoint on its own (the tests crash it or stop it when
/// they choose).
private func storeWithoutCheckpoints(_ dir: String) throws -> DiskStorage {
    var o = options(dir)
    o.checkpointInterval = .seconds(3600)
    return try lockedByNoOtherProcess { try DiskStorage(options: o, logger: testLogger) }
}

@Suite(.mayBlock) struct LeaseStorageTests {
    private let alice = Writer(uid: 1000, gid: 1000, pid: 42)


    private func set(_ key: Key, _ value: JSONValue, rev: UInt64, old: JSONValue? = nil) -> RevisionRecord {
        RevisionRecord(
            repo: "r", changeSet: ChangeSet(revision: rev, changes: [Change(key: key, old: old.map { CanonicalJSON($0) }, new: CanonicalJSON(value))]),
            time: 1_700_000_000, writer: alice)
    }

    /// Grants, a revision attaching keys, attachments moved alone, an end: all read back, from
    /// the log after a crash and from the snapshot after a clean stop.
    @Test func leasesAndAttachmentsReadBackFromTheLogAndTheSnapshot() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try storeWithoutCheckpoints(dir)
        let table = Table()
        let repo = ListenerStub()
        #expect(table.append(.leaseGranted(.init(id: 1, owner: alice, ttl: nil)), to: storage))
        #expect(table.append(.leaseGranted(.init(id: 2, owner: alice, ttl: 30)), to: storage))
        #expect(table.append(.leaseGranted(.init(id: 3, owner: alice, ttl: 5)), to: storage))
        let first = RevisionRecord(
            repo: "r",
            changeSet: ChangeSet(
                revision: 1, changes: ["a", "b", "c", "d"].map { Change(key: Key($0), old: nil, new: CanonicalJSON(.int(1))) }),
            time: 1_700_000_000, writer: alice)
        #expect(storage.append(.revision(RevisionFrame(first, epoch: repo.epoch, moves: [("a", nil, 1), ("b", nil, 2), ("c", nil, 3), ("d", nil, 3)])), sequence: 1, listener: repo))
        // An equal value written naming another lease: no revision, the attachment moves.
        #expect(storage.append(.attachments(repo: "r", revision: 1, moves: [("b", 2, 1)]), sequence: 2, listener: repo))
        #expect(table.append(.leaseEnded(id: 3, reason: .expired, owner: alice), to: storage))
        // Its end deleted c; d stays attached to it (a kill came before its deletion).
        let deletion = RevisionRecord(
            repo: "r", changeSet: ChangeSet(revision: 2, changes: [Change(key: "c", old: CanonicalJSON(.int(1)), new: nil)]), time: 1_700_000_000,
            writer: alice, leaseEnd: LeaseEnd(lease: 3, reason: .expired))
        #expect(storage.append(.revision(RevisionFrame(deletion, epoch: repo.epoch, moves: [("c", 3, nil)])), sequence: 3, listener: repo))
        flushed(storage)
        #expect(waitFor { repo.durable == 3 })
        let crashed = try crashCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()

        for (place, directory) in [("the log", crashed), ("the snapshot", dir)] {
            let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(directory), logger: testLogger) }
            defer { reopened.close() }
            let loaded = try #require(try reopened.load().first)
            #expect(loaded.attachments == ["a": 1, "b": 1, "d": 3], "from \(place)")
            let leases = reopened.loadLeases()
            #expect(leases.live == [1: .init(id: 1, owner: alice, ttl: nil), 2: .init(id: 2, owner: alice, ttl: 30)], "from \(place)")
            #expect(leases.ended[3] == PersistedLeases.Ended(reason: .expired, owner: alice), "from \(place): still named by d")
            #expect(leases.nextID == 4, "from \(place)")
        }
    }

    /// A revision that never became durable takes the attachments it moved with it, and one
    /// that did keeps them: a group cut off the log (a crash before its sync) leaves neither.
    @Test func anAttachmentIsDurableExactlyWhenItsWriteIs() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try storeWithoutCheckpoints(dir)
        let table = Table()
        let repo = ListenerStub()
        #expect(table.append(.leaseGranted(.init(id: 1, owner: alice, ttl: nil)), to: storage))
        #expect(storage.append(.revision(RevisionFrame(set("k", "v0", rev: 1), epoch: repo.epoch)), sequence: 1, listener: repo))
        flushed(storage)
        #expect(waitFor { repo.durable == 1 })
        #expect(storage.append(.revision(RevisionFrame(set("k", "v1", rev: 2, old: "v0"), epoch: repo.epoch, moves: [("k", nil, 1)])), sequence: 2, listener: repo))
        flushed(storage)
        #expect(waitFor { repo.durable == 2 })
        let crashed = try crashCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()
        // The same directory, its last group never written: the write and its attachment are gone.
        try zeroLastGroup(crashed)
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(crashed), logger: testLogger) }
        defer { reopened.close() }
        let loaded = try #require(try reopened.load().first)
        #expect(loaded.state.revision == 1 && loaded.state[Key("k")]?.value == CanonicalJSON(.string("v0")))
        #expect(loaded.attachments.isEmpty, "the attachment of a write that never happened: \(loaded.attachments)")
    }

    /// An earlier obsd's journal is folded in once: its leases, attachments and the deletions
    /// it owed (a repository no further than the revision before them); then it is removed and
    /// everything is in the snapshot.
    @Test func anEarlierObsdsJournalIsMigratedOnce() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        let repo = ListenerStub()
        let values = RevisionRecord(
            repo: "r", changeSet: ChangeSet(revision: 1, changes: ["a", "b", "c"].map { Change(key: Key($0), old: nil, new: CanonicalJSON(.int(1))) }),
            time: 1_700_000_000, writer: alice)
        #expect(storage.append(values, listener: repo))
        flushed(storage)
        #expect(waitFor { repo.durable == 1 })
        storage.close()
        var journal = LeaseJournalRecord.magic
        LeaseJournalRecord.grant(.init(id: 1, owner: alice, ttl: 30), into: &journal)
        LeaseJournalRecord.grant(.init(id: 2, owner: alice, ttl: nil), into: &journal)
        LeaseJournalRecord.attach(repo: "r", key: "a", lease: 1, into: &journal)
        LeaseJournalRecord.attach(repo: "r", key: "b", lease: 2, into: &journal)
        LeaseJournalRecord.attach(repo: "r", key: "gone", lease: 1, into: &journal)
        LeaseJournalRecord.end(2, .revoked, into: &journal)
        // Lease 2's end deleted b in the revision after 1 — not durable: still owed.
        LeaseJournalRecord.deletion(.init(lease: 2, reason: .revoked, owner: alice, repo: "r", before: 1, keys: ["b"]), into: &journal)
        LeaseJournalRecord.next(9, into: &journal)
        try Data(journal).write(to: URL(fileURLWithPath: dir + "/leases"))

        for round in 1...2 {
            let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
            defer { reopened.close() }
            let loaded = try #require(try reopened.load().first)
            #expect(loaded.attachments == ["a": 1, "b": 2], "round \(round): b owed to the revoked lease, a key that is gone left out")
            let leases = reopened.loadLeases()
            #expect(leases.live == [1: .init(id: 1, owner: alice, ttl: 30)] && leases.nextID == 9, "round \(round)")
            #expect(leases.ended[2] == PersistedLeases.Ended(reason: .revoked, owner: alice), "round \(round)")
            #expect(!FileManager.default.fileExists(atPath: dir + "/leases"))
            #expect(reopened.notices.contains { $0.contains("leases") && $0.contains("earlier obsd") } == (round == 1), "\(reopened.notices)")
        }
    }

    @Test func aDamagedJournalRefusesStartUpNamingIt() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var journal = LeaseJournalRecord.magic
        LeaseJournalRecord.grant(.init(id: 1, owner: alice, ttl: 30), into: &journal)
        let damaged = journal.count - 3
        LeaseJournalRecord.grant(.init(id: 2, owner: alice, ttl: 30), into: &journal)
        journal[damaged] ^= 0xFF
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
        try Data(journal).write(to: URL(fileURLWithPath: dir + "/leases"))
        #expect {
            _ = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        } throws: { error in
            "\(error)".contains(dir + "/leases") && "\(error)".contains("damaged")
        }
    }

    @Test func aRevisionsLeaseEndSurvivesTheLogAndTheSnapshot() throws {
        let end = LeaseEnd(lease: 7, reason: .closed)
        let record = RevisionRecord(
            repo: "svc", changeSet: ChangeSet(revision: 4, changes: [Change(key: "up", old: CanonicalJSON(.bool(true)), new: nil)]), time: 1_700_000_000,
            writer: alice, leaseEnd: end)
        var frame: [UInt8] = []
        LogRecord.appendFrame(.revision(RevisionFrame(record, epoch: "0123456789abcdef0123456789abcdef")), to: &frame)
        let decoded = try frame.withUnsafeBytes { raw -> RevisionRecord in
            guard case .frame(let payload, _) = WriteAheadLog.frame(in: raw, at: 0), case .revision(let view) = try LogRecord.Entry(UnsafeRawBufferPointer(rebasing: raw[payload]))
            else { throw TestFailure("not a revision") }
            return try view.record()
        }
        #expect(decoded.leaseEnd == end && decoded.writer == alice && decoded.changes == record.changes)

        var body: [UInt8] = []
        StoredRevision.appendHead(revision: 4, time: 1, weight: 10, writer: nil, leaseEnd: end, to: &body)
        LogRecord.encode(record.changes, into: &body)
        let stored = body.withUnsafeBytes { raw -> RevisionRecord? in
            var reader = PayloadReader(raw)
            return StoredRevision.fields(&reader)?.record(repo: "svc")
        }
        #expect(stored?.leaseEnd == end && stored?.writer == nil)
    }

    /// Zeroes the last group of the last segment of the log in `dir`, from its group-start frame
    /// on — what a crash before the group's sync leaves: its pages never written.
    private func zeroLastGroup(_ dir: String) throws {
        let directory = WriteAheadLog.Directory(path: dir + "/wal")
        let path = directory.file(try #require(try directory.segments().last))
        var bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
        var at = WriteAheadLog.headerSize
        var lastGroup: Int?
        while true {
            let frame = bytes.withUnsafeBytes { WriteAheadLog.frame(in: $0, at: at) }
            guard case .frame(let payload, let next) = frame else { break }
            if bytes.withUnsafeBytes({ WriteAheadLog.isGroupStart(UnsafeRawBufferPointer(rebasing: $0[payload])) }) { lastGroup = at }
            at = next
        }
        let start = try #require(lastGroup)
        for i in start..<at { bytes[i] = 0 }
        try Data(bytes).write(to: URL(fileURLWithPath: path))
    }
}

/// Lease ids across `obsd --repair-log` (found by the robustness suite, `repair-lease`): the
/// grants the repair cut away had ids the table must never hand out again.
@Suite(.mayBlock) struct LeaseRepairTests {
    private let alice = Writer(uid: 1000, gid: 1000, pid: 42)

    @Test func aRepairThatCutGrantsAwayHandsOutNoneOfTheirIds() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try storeWithoutCheckpoints(dir)
        let table = Table()
        for id in 1...6 as ClosedRange<UInt64> {
            #expect(table.append(.leaseGranted(.init(id: id, owner: alice, ttl: 30)), to: storage))
            flushed(storage)
            #expect(waitFor { table.durable.withLock { $0 } >= id })
        }
        let crashed = try crashCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        storage.close()
        let segment = crashed + "/wal/" + (try #require(segments(crashed).last))
        let starts = try walRecordStarts(segment)
        try #require(starts.count >= 6, "\(starts)")
        #expect(truncate(segment, off_t(starts[3] - 16)) == 0)  // the grants of ids 4…6 cut away

        var repair = options(crashed)
        repair.repairLog = true
        let repaired = try lockedByNoOtherProcess { try DiskStorage(options: repair, logger: testLogger) }
        let leases = repaired.loadLeases()
        repaired.close()
        #expect(Set(leases.live.keys) == [1, 2, 3])
        #expect(leases.nextID > 6, "ids 4 to 6 were granted before the cut: \(leases.nextID)")
        #expect(leases.nextID == 4 + DiskStorage.leaseIDsSkippedByARepair)
        // And the next start keeps it (the repair's snapshot holds it).
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(crashed), logger: testLogger) }
        defer { reopened.close() }
        #expect(reopened.loadLeases().nextID == 4 + DiskStorage.leaseIDsSkippedByARepair)
    }
}
