// Tests of a write-ahead log that lost acknowledged writes outside obsd — its last segment cut
// short, removed, or the whole log gone while the snapshot stayed: the store refuses to start,
// naming the file and `obsd --repair-log`, rather than hand out the lost revisions' numbers
// again under the same epoch; repaired, every repository starts a new epoch. And the states
// a crash can leave that look alike — a roll-over or a cut interrupted — are not mistaken for
// such a loss.

import Foundation
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

#if canImport(Glibc)
import Glibc
#endif

private func repairing(_ dir: String, segmentSize: Int = 64 << 20) -> DiskStorage.Options {
    var o = options(dir, segmentSize: segmentSize)
    o.repairLog = true
    return o
}

/// Expects the store in `dir` to refuse to start, naming `path` and the way out.
private func expectLossRefused(_ dir: String, segmentSize: Int = 64 << 20, naming path: String, _ cause: String, sourceLocation: SourceLocation = #_sourceLocation) {
    #expect(sourceLocation: sourceLocation) {
        try open(options(dir, segmentSize: segmentSize))
    } throws: { error in
        guard let error = error as? StorageError else { return false }
        let said = error.kind == .corrupt && error.description.contains(path) && error.description.contains(cause)
            && error.description.contains("obsd --repair-log")
        if !said { Issue.record("refused, but said: \(error.description)", sourceLocation: sourceLocation) }
        return said
    }
}

/// The epoch and revision of repository "a" in the store at `dir`, opened with `o` (then closed).
private func stateOfA(_ o: DiskStorage.Options) throws -> (epoch: String, revision: UInt64, notices: [String]) {
    let storage = try lockedByNoOtherProcess { try DiskStorage(options: o, logger: testLogger) }
    defer { storage.close() }
    let a = try #require(try storage.load().first { $0.name == "a" })
    return (a.epoch, a.state.revision, storage.notices)
}

/// Cuts the file at `path` to `length` bytes.
private func cut(_ path: String, to length: Int) {
    #expect(truncate(path, off_t(length)) == 0)
}

/// A store that crashed after ten revisions, its last segment, and where its ten records start.
private func tenRevisionsInTheLastSegment() throws -> (dir: String, segment: String, starts: [Int]) {
    let dir = try crashedAfterTenRevisions()
    let segment = dir + "/wal/" + (try #require(segments(dir).last))
    let starts = try walRecordStarts(segment)
    try #require(starts.count == 10)
    return (dir, segment, starts)
}

@Suite(.mayBlock) struct LogLossTests {
    /// The last segment cut in the middle of a record: what is left looks like a torn write,
    /// but a preallocated segment is never shorter than its preallocation after a crash.
    @Test func aLastSegmentCutShortIsRefusedNamingIt() throws {
        let (dir, segment, starts) = try tenRevisionsInTheLastSegment()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        cut(segment, to: starts[5] + 20)  // in revision 6's record
        expectLossRefused(dir, naming: segment, "shorter than")
    }

    /// Cut exactly where a group ends: what is left looks like a whole, shorter log.
    @Test func aLastSegmentCutAtAGroupsEndIsRefusedToo() throws {
        let (dir, segment, starts) = try tenRevisionsInTheLastSegment()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        cut(segment, to: starts[5] - 16)  // before revision 6's group start: revisions 1–5 whole
        expectLossRefused(dir, naming: segment, "shorter than")
    }

    /// Cut inside a frame's padding (right after the payload of revision 6's group start,
    /// before its seven zeros): the next frame would begin past the file's end. Refused, and repaired,
    /// like any other cut — before, reading the frame there trapped, at every start and at
    /// the repair (the robustness suite's `truncate` fault, a cut to half the used bytes).
    @Test func aLastSegmentCutInsideAFramesPaddingIsRefusedAndRepaired() throws {
        let (dir, segment, starts) = try tenRevisionsInTheLastSegment()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        cut(segment, to: starts[5] - 16 + 9)  // the group start's header and payload, none of its 7 zeros
        expectLossRefused(dir, naming: segment, "shorter than")
        #expect(try stateOfA(repairing(dir)).revision == 5)
    }

    /// Repaired, the store starts without the lost revisions, every repository on a new epoch:
    /// the numbers handed out again never meet the old epoch.
    @Test func aCutSegmentRepairedStartsANewEpoch() throws {
        let dir = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let segment = dir + "/wal/" + (try #require(segments(dir).last))
        let starts = try walRecordStarts(segment)
        // The epoch the acknowledged revisions were written in: a copy of the store, intact, says.
        let intact = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: intact) }
        try FileManager.default.removeItem(atPath: intact)
        try FileManager.default.copyItem(atPath: dir, toPath: intact)
        let before = try stateOfA(options(intact))
        #expect(before.revision == 10)
        cut(segment, to: starts[5] - 16)
        let repaired = try stateOfA(repairing(dir))
        #expect(repaired.revision == 5)
        #expect(repaired.epoch != before.epoch, "a new epoch")
        #expect(
            repaired.notices.contains { $0.hasPrefix("repaired the write-ahead log") && $0.contains(segment) && $0.contains("new epoch") },
            "\(repaired.notices)")
        // From then on the store opens as usual, on the new epoch, and takes revision 6 anew.
        let reopened = try open(options(dir))
        let a = ListenerStub()
        #expect(reopened.append(record("a", 6, "after", 1), listener: a))
        reopened.close()
        #expect(a.durable == 6)
        let again = try stateOfA(options(dir))
        #expect(again.revision == 6 && again.epoch == repaired.epoch)
    }

    /// The last of several segments removed: the one before it says the log went on.
    @Test func aRemovedLastSegmentIsRefusedNamingIt() throws {
        let crashed = try crashedAfter(40, value: .string(String(repeating: "v", count: 500)), segmentSize: 8192)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let names = segments(crashed)
        try #require(names.count >= 2)
        let last = crashed + "/wal/" + names.last!
        try FileManager.default.removeItem(atPath: last)
        expectLossRefused(crashed, segmentSize: 8192, naming: last, "is missing")
        // Emptied rather than removed: the same.
        let again = try crashedAfter(40, value: .string(String(repeating: "v", count: 500)), segmentSize: 8192)
        defer { try? FileManager.default.removeItem(atPath: again) }
        let emptied = again + "/wal/" + (try #require(segments(again).last))
        cut(emptied, to: 0)
        expectLossRefused(again, segmentSize: 8192, naming: emptied, "is empty")
        // Repaired: a new epoch, the revisions of the segments left.
        let repaired = try stateOfA(repairing(crashed, segmentSize: 8192))
        #expect(repaired.revision > 0 && repaired.revision < 40)
        #expect(repaired.notices.contains { $0.hasPrefix("repaired the write-ahead log") && $0.contains(last) }, "\(repaired.notices)")
        let reopened = try stateOfA(options(crashed, segmentSize: 8192))
        #expect(reopened.revision == repaired.revision && reopened.epoch == repaired.epoch)
    }

    /// The only segment removed, or the whole log: the snapshot covers less than was acknowledged.
    @Test func aRemovedOnlySegmentOrLogIsRefused() throws {
        let dir = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let only = try #require(segments(dir).first)
        try FileManager.default.removeItem(atPath: dir + "/wal/" + only)
        expectLossRefused(dir, naming: dir + "/wal", "no log segment")
        try FileManager.default.removeItem(atPath: dir + "/wal")
        expectLossRefused(dir, naming: dir + "/wal", "no log segment")
        let repaired = try open(repairing(dir))
        #expect(try repaired.load().isEmpty, "revisions 1–10 were in the log alone")
        #expect(repaired.notices.contains { $0.hasPrefix("repaired the write-ahead log") && $0.contains(dir + "/wal") }, "\(repaired.notices)")
        repaired.close()
    }

    // MARK: What a crash leaves is not a loss

    /// A roll-over a crash interrupted after the new segment was made, before the old one said
    /// so (its end-of-segment frame not written yet, or torn): nothing is lost, nothing refused.
    @Test(arguments: [[UInt8](repeating: 0, count: 24), [0x09, 0, 0, 0, 0xAA, 0xBB, 0xCC, 0xDD, 0xFE, 1, 2, 3]])
    func aRollOverInterruptedBeforeTheOldSegmentNamesTheNewOneIsNoLoss(_ left: [UInt8]) throws {
        let crashed = try crashedAfter(40, value: .string(String(repeating: "v", count: 500)), segmentSize: 8192)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let names = segments(crashed)
        try #require(names.count >= 2)
        let previous = crashed + "/wal/" + names[names.count - 2]
        // The frame after its last group names the next segment: zeroed (not written yet), or
        // garbled (torn).
        let end = try lastFrameEnd(previous)
        let fd = Glibc.open(previous, O_WRONLY)
        #expect(left.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(end)) } == left.count)
        close(fd)
        #expect(try stateOfA(options(crashed, segmentSize: 8192)).revision == 40)
    }

    /// A roll-over a crash interrupted while it wrote the new segment's header (the robustness
    /// suite's `torn` fault: half the header, then SIGKILL): nothing was written to that
    /// segment, nothing names it — it goes, as an empty one does (refused as "bad header"
    /// before). With a record after the torn header, it is still refused.
    @Test(arguments: [false, true])
    func aNewSegmentWhoseHeaderACrashToreIsNoLoss(recordAfter: Bool) throws {
        let crashed = try crashedAfter(40, value: .string(String(repeating: "v", count: 500)), segmentSize: 8192)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let lastName = try #require(segments(crashed).last)
        let base = try #require(UInt64(lastName.prefix { $0 != "." }, radix: 16))
        let position = base + UInt64(try lastFrameEnd(crashed + "/wal/" + lastName))
        let torn = crashed + "/wal/" + String(format: "%016llx.wal", position)
        var bytes = Array(WriteAheadLog.header(base: position, reserved: 8192).prefix(WriteAheadLog.headerSize / 2))
        bytes += [UInt8](repeating: 0, count: 8192 - bytes.count)
        if recordAfter {
            // A valid frame where the first record would go: this segment held something.
            let previous = [UInt8](try Data(contentsOf: URL(fileURLWithPath: crashed + "/wal/" + lastName)))
            let end = try lastFrameEnd(crashed + "/wal/" + lastName)
            let frame = previous[WriteAheadLog.headerSize..<end]
            bytes.replaceSubrange(WriteAheadLog.headerSize..<(WriteAheadLog.headerSize + frame.count), with: frame)
        }
        try Data(bytes).write(to: URL(fileURLWithPath: torn))
        if recordAfter {
            #expect(throws: StorageError.self) { try stateOfA(options(crashed, segmentSize: 8192)) }
        } else {
            #expect(try stateOfA(options(crashed, segmentSize: 8192)).revision == 40)
            // It went; where it was, the log starts a segment of its own again.
            if FileManager.default.fileExists(atPath: torn) {
                let header = [UInt8](try Data(contentsOf: URL(fileURLWithPath: torn)).prefix(WriteAheadLog.headerSize))
                #expect(WriteAheadLog.format(of: header) == 3)
            }
        }
    }

    /// A roll-over a crash interrupted before the new segment's header was durable: the empty
    /// segment goes, a new one starts where the log ends, and a store closed before any write
    /// to it still stops cleanly — its last snapshot covers the new segment's header (before,
    /// it could not be written: the log "ended before" the position after that header, and the
    /// directory stayed marked as in use, the stop counted as unclean).
    @Test func aStoreThatStartedANewSegmentAndTookNoWriteStopsCleanly() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try open(options(dir))
        let a = ListenerStub()
        for rev in 1...10 as ClosedRange<UInt64> { #expect(storage.append(record("a", rev, "k\(rev)"), listener: a)) }
        storage.close()
        #expect(a.durable == 10)
        let last = try #require(segments(dir).last)
        let next = try #require(UInt64(last.dropLast(4), radix: 16)) + 1 << 20
        let name = String(repeating: "0", count: 16 - String(next, radix: 16).count) + String(next, radix: 16) + ".wal"
        try Data(count: 4096).write(to: URL(fileURLWithPath: dir + "/wal/" + name))
        let recovered = try open(options(dir))
        #expect(try recovered.load().first?.state.revision == 10)
        #expect(segments(dir).count == 1 && segments(dir).last != name, "a new segment where the log ends: \(segments(dir))")
        recovered.close()
        #expect(!FileManager.default.fileExists(atPath: dir + "/" + RunMarker.fileName), "stopped cleanly")
        let again = try open(options(dir))
        #expect(try again.load().first?.state.revision == 10)
        again.close()
    }

    /// The cut of a failed group (or of a torn tail at start-up) interrupted between the
    /// truncation and the new preallocation: the header had stopped vouching for the size first.
    @Test func aCutInterruptedBeforeTheSegmentIsPreallocatedAgainIsNoLoss() throws {
        let dir = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let segment = dir + "/wal/" + (try #require(segments(dir).last))
        var header = [UInt8](try Data(contentsOf: URL(fileURLWithPath: segment)).prefix(WriteAheadLog.headerSize))
        try #require(WriteAheadLog.format(of: header) == 3)
        WriteAheadLog.setReserved(0, in: &header)
        let fd = Glibc.open(segment, O_WRONLY)
        #expect(header.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) } == header.count)
        close(fd)
        cut(segment, to: try lastFrameEnd(segment))
        #expect(try stateOfA(options(dir)).revision == 10)
        // Opened, the segment is preallocated and vouched for again.
        let reread = [UInt8](try Data(contentsOf: URL(fileURLWithPath: segment)).prefix(WriteAheadLog.headerSize))
        #expect(WriteAheadLog.reserved(in: reread) == 64 << 20)
    }
}
