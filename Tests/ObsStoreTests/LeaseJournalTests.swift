// Tests of the lease journal: what it records reads back (grants, ends, attachments, the
// deletions lease ends made — which detach their keys, unless an undo attached them again —
// the next id); a rewrite keeps exactly the state it is given
// and the recent deletions; a torn last frame is cut off and reported; a damaged frame with
// more after it, or a foreign file, refuses start-up naming the file; a revision's lease end
// survives the log's encoding and the snapshot's; a header a crash cut short at creation is
// written again.

import Foundation
import Logging
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

@Suite struct LeaseJournalTests {
    private let alice = Writer(uid: 1000, gid: 1000, pid: 42)

    private func directory() throws -> String {
        TemporaryDirectory.make(prefix: "obsd-leases-")
    }

    private func open(_ directory: String) throws -> LeaseJournal {
        try LeaseJournal(directory: directory, sync: .always, logger: Logger(label: "test"))
    }

    @Test func whatItRecordsReadsBack() throws {
        let dir = try directory()
        let journal = try open(dir)
        _ = try journal.granted(.init(id: 1, owner: alice, ttl: nil))
        _ = try journal.granted(.init(id: 2, owner: alice, ttl: 30))
        _ = try journal.granted(.init(id: 3, owner: alice, ttl: 5))
        journal.attached("a", of: "r", to: 1)
        journal.attached("b", of: "r", to: 2)
        journal.attached("c", of: "s", to: 3)
        journal.attached("b", of: "r", to: nil)  // detached again
        journal.ended(3, .revoked)
        let deletion = PersistedLeases.Deletion(lease: 3, reason: .revoked, owner: alice, repo: "s", before: 7, keys: ["c"])
        journal.deleting(deletion)
        journal.close()

        let found = try open(dir).takeLoaded()
        #expect(found.nextID == 4)
        #expect(found.live == [1: .init(id: 1, owner: alice, ttl: nil), 2: .init(id: 2, owner: alice, ttl: 30)])
        #expect(found.ended[3]?.reason == .revoked && found.ended[3]?.owner == alice)
        #expect(found.attachments == ["r": ["a": 1]], "the deletion detached c")
        #expect(found.deletions == [deletion])
    }

    /// A key attached to an ended lease after its deletion was recorded: storage failed the
    /// deletion's revision and it was undone — the restart sees the key attached, and owes it.
    @Test func anAttachmentAfterItsDeletionMeansTheDeletionWasUndone() throws {
        let dir = try directory()
        let journal = try open(dir)
        _ = try journal.granted(.init(id: 1, owner: alice, ttl: 30))
        journal.attached("c", of: "s", to: 1)
        journal.attached("d", of: "s", to: 1)
        journal.ended(1, .expired)
        journal.deleting(PersistedLeases.Deletion(lease: 1, reason: .expired, owner: alice, repo: "s", before: 7, keys: ["c", "d"]))
        journal.attached("c", of: "s", to: 1)  // the undo
        journal.close()
        #expect(try open(dir).takeLoaded().attachments == ["s": ["c": 1]])
    }

    @Test func aRewriteKeepsTheStateItIsGivenAndTheRecentDeletions() throws {
        let dir = try directory()
        let journal = try open(dir)
        for id in 1...50 as ClosedRange<UInt64> { _ = try journal.granted(.init(id: id, owner: alice, ttl: 60)) }
        for id in 1...49 as ClosedRange<UInt64> { journal.ended(id, .expired) }
        let deletion = PersistedLeases.Deletion(lease: 49, reason: .expired, owner: alice, repo: "r", before: 3, keys: ["x", "y"])
        journal.deleting(deletion)
        try journal.compact(live: [.init(id: 50, owner: alice, ttl: 60)], attachments: [("r", "z", 50)], nextID: 51)
        var found = try open(dir).takeLoaded()
        #expect(found.live.keys.sorted() == [50] && found.nextID == 51)
        #expect(found.attachments == ["r": ["z": 50]] && found.deletions == [deletion])
        #expect(found.ended.isEmpty, "ended leases are not rewritten")

        // A second rewrite drops the deletions the first one kept.
        let again = try open(dir)
        try again.compact(live: [], attachments: [], nextID: 51)
        found = try open(dir).takeLoaded()
        #expect(found.live.isEmpty && found.deletions.isEmpty && found.nextID == 51, "the next id outlives every lease")
    }

    @Test func aTornLastFrameIsCutOffAndReported() throws {
        let dir = try directory()
        let journal = try open(dir)
        _ = try journal.granted(.init(id: 1, owner: alice, ttl: 9))
        _ = try journal.granted(.init(id: 2, owner: alice, ttl: 9))
        journal.close()
        let path = dir + "/" + LeaseJournal.fileName
        let whole = try Data(contentsOf: URL(fileURLWithPath: path))
        try whole.prefix(whole.count - 5).write(to: URL(fileURLWithPath: path))
        let reopened = try open(dir)
        #expect(reopened.notices.count == 1 && reopened.notices[0].contains("torn"))
        #expect(reopened.takeLoaded().live.keys.sorted() == [1])
        // What follows is appended where the torn frame began.
        _ = try reopened.granted(.init(id: 3, owner: alice, ttl: 9))
        #expect(try open(dir).takeLoaded().live.keys.sorted() == [1, 3])
    }

    @Test func aHeaderCutShortRightAfterCreationIsWrittenAgain() throws {
        let dir = try directory()
        let path = dir + "/" + LeaseJournal.fileName
        try Data("OBSD".utf8).write(to: URL(fileURLWithPath: path))
        let journal = try open(dir)
        #expect(journal.notices.count == 1 && journal.notices[0].contains("cut short"))
        _ = try journal.granted(.init(id: 1, owner: alice, ttl: 9))
        journal.close()
        #expect(try open(dir).takeLoaded().live.keys.sorted() == [1])
        // A short file that is not the start of the header is someone else's.
        try Data("XY".utf8).write(to: URL(fileURLWithPath: path))
        #expect(throws: StorageError.self) { _ = try open(dir) }
    }

    @Test func aDamagedFrameWithMoreAfterItOrAForeignFileRefusesStartUp() throws {
        let dir = try directory()
        let journal = try open(dir)
        _ = try journal.granted(.init(id: 1, owner: alice, ttl: 9))
        _ = try journal.granted(.init(id: 2, owner: alice, ttl: 9))
        journal.close()
        let path = dir + "/" + LeaseJournal.fileName
        var bytes = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
        bytes[LeaseRecord.magic.count + LeaseRecord.frameHeader + 2] ^= 0xFF  // inside the first grant
        try Data(bytes).write(to: URL(fileURLWithPath: path))
        do {
            _ = try open(dir)
            Issue.record("a damaged journal was read")
        } catch let error as StorageError {
            #expect(error.kind == .corrupt && error.description.contains(path) && error.description.contains("damaged"))
        }
        try Data("not a journal at all".utf8).write(to: URL(fileURLWithPath: path))
        do {
            _ = try open(dir)
            Issue.record("a foreign file was read")
        } catch let error as StorageError {
            #expect(error.kind == .corrupt && error.description.contains("not an obsd lease journal"))
        }
    }

    @Test func aRevisionsLeaseEndSurvivesTheLogAndTheSnapshot() throws {
        let end = SharedLeaseEnd(lease: 7, reason: .closed)
        let record = RevisionRecord(
            repo: "svc", changeSet: ChangeSet(revision: 4, changes: [Change(key: "up", old: CanonicalJSON(.bool(true)), new: nil)]), time: 1_700_000_000,
            writer: alice, leaseEnd: end)
        var payload: [UInt8] = []
        LogRecord.encode(record, epoch: "0123456789abcdef0123456789abcdef", into: &payload)
        let decoded = try payload.withUnsafeBytes { try LogRecord.decode($0) }.record
        #expect(decoded.leaseEnd == end && decoded.writer == alice && decoded.changes == record.changes)
        // The in-place frame the committer writes is the same encoding.
        var frame: [UInt8] = []
        LogRecord.appendFrame(record, epoch: "0123456789abcdef0123456789abcdef", to: &frame)
        #expect(Array(frame[WriteAheadLog.frameHeaderSize..<(WriteAheadLog.frameHeaderSize + payload.count)]) == payload)
        let view = try payload.withUnsafeBytes { try LogRecord.View($0).leaseEnd }
        #expect(view == end)

        var body: [UInt8] = []
        StoredRevision.appendHead(revision: 4, time: 1, weight: 10, writer: nil, leaseEnd: end, to: &body)
        LogRecord.encode(record.changes, into: &body)
        let stored = body.withUnsafeBytes { raw -> RevisionRecord? in
            var reader = PayloadReader(raw)
            return StoredRevision.fields(&reader)?.record(repo: "svc")
        }
        #expect(stored?.leaseEnd == end && stored?.writer == nil)
    }
}
