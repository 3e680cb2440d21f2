// Tests of the operator's repair of a write-ahead log with a damaged record (`obsd
// --repair-log`, `DiskStorage.Options.repairLog`): the log is cut at the damaged record, with
// everything after it — later segments included — every repository starts a new epoch, a
// snapshot is written, and the store then opens as usual and takes writes. Without the
// option the same directory is refused, as before.

import Foundation
import ObsValues
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

/// Flips a byte of the payload of the record whose frame starts at `at`.
private func damage(_ path: String, recordAt at: Int) throws {
    let file = try FileHandle(forUpdating: URL(fileURLWithPath: path))
    defer { try? file.close() }
    try file.seek(toOffset: UInt64(at + 12))
    let byte = try #require(try file.read(upToCount: 1)?.first)
    try file.seek(toOffset: UInt64(at + 12))
    try file.write(contentsOf: Data([byte ^ 0x40]))
}

private func repairing(_ dir: String) -> DiskStorage.Options {
    var o = options(dir)
    o.repairLog = true
    return o
}

@Suite(.mayBlock) struct LogRepairTests {
    @Test func aDamagedRecordIsCutWithWhatFollowsAndTheStoreGoesOn() throws {
        let dir = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let segment = dir + "/wal/" + (try #require(segments(dir).last))
        let starts = try walRecordStarts(segment)
        try #require(starts.count == 10)
        try damage(segment, recordAt: starts[4])  // revision 5
        #expect(throws: StorageError.self) { try open(options(dir)) }

        let repaired = try lockedByNoOtherProcess { try DiskStorage(options: repairing(dir), logger: testLogger) }
        let loaded = try #require(try repaired.load().first)
        #expect(loaded.state.revision == 4 && loaded.state[Key("k4")] != nil && loaded.state[Key("k5")] == nil)
        #expect(
            repaired.notices.contains {
                $0.hasPrefix("repaired the write-ahead log") && $0.contains("offset \(starts[4])") && $0.contains("every repository starts a new epoch")
            }, "\(repaired.notices)")
        repaired.close()

        // Opened as usual now, with the epoch the repair gave (its snapshot holds it); writes
        // go on from revision 5.
        let reopened = try open(options(dir))
        let again = try #require(try reopened.load().first)
        #expect(again.state.revision == 4 && again.epoch == loaded.epoch)
        let a = ListenerStub()
        #expect(reopened.append(record("a", 5, "new", 1), listener: a))
        reopened.close()
        #expect(a.durable == 5)
        let last = try open(options(dir))
        #expect(try last.load().first?.state[Key("new")] != nil)
        last.close()
    }

    @Test func laterSegmentsGoWithTheCut() throws {
        let dir = try crashedAfter(40, value: .string(String(repeating: "v", count: 300)), segmentSize: 4096)
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let names = segments(dir)
        try #require(names.count >= 3)
        let first = dir + "/wal/" + names[0]
        let starts = try walRecordStarts(first)
        try #require(starts.count >= 2)
        try damage(first, recordAt: starts[1])
        #expect(throws: StorageError.self) { try open(options(dir)) }

        let repaired = try lockedByNoOtherProcess { try DiskStorage(options: repairing(dir), logger: testLogger) }
        #expect(try repaired.load().first?.state.revision == 1)
        #expect(repaired.notices.contains { $0.contains("and \(names.count - 1) later log segment(s)") }, "\(repaired.notices)")
        repaired.close()
        #expect(segments(dir).count <= 2, "the later segments are gone: \(segments(dir))")
        let reopened = try open(options(dir))
        #expect(try reopened.load().first?.state.revision == 1)
        reopened.close()
    }

    @Test func aSoundLogIsLeftAsItIs() throws {
        let dir = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try lockedByNoOtherProcess { try DiskStorage(options: repairing(dir), logger: testLogger) }
        let loaded = try #require(try storage.load().first)
        #expect(loaded.state.revision == 10, "nothing cut")
        #expect(!storage.notices.contains { $0.hasPrefix("repaired") }, "\(storage.notices)")
        storage.close()
    }
}
