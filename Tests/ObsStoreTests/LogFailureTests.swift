// Tests of a write-ahead log whose disk fails at the worst moments: a full disk at a segment
// roll-over (on a real tmpfs, and on cue through FaultyFiles), a failed group whose cut
// fails (voided instead), one that can be neither cut nor voided (outcome unknown), a cut
// after an earlier cut's promise of the segment's size failed to sync, and what a zeroed frame
// header leaves behind at the end of the log. Each checks what a restart —
// a reopened store, or a copy of the live directory as a crash would leave it — finds.

import Foundation
import Synchronization
import Logging
import ObsProtocol
@testable import ObsStore
import ObservableKit
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

private func open(_ options: DiskStorage.Options, files: FaultyFiles) throws -> DiskStorage {
    try lockedByNoOtherProcess { try DiskStorage(options: options, logger: testLogger, files: files) }
}

/// Appends revisions `from...` of "a" (key `k<rev>` = `value`), one group each, until one
/// fails (at most `limit`); the last revision tried.
private func appendUntilAFailure(_ storage: DiskStorage, _ a: ListenerStub, from first: UInt64, value: JSONValue, limit: UInt64 = 20) -> UInt64 {
    var rev = first
    while true {
        _ = storage.append(record("a", rev, "k\(rev)", value), listener: a)
        _ = waitFor { a.durable == rev || a.failures > 0 }
        if a.failures > 0 || rev == first + limit { return rev }
        rev += 1
    }
}

/// A store on `dir` whose file operations a test can fail, with revision 1 (`k` = "kept") durable.
private func openWithKeyKept(_ dir: String) throws -> (DiskStorage, FaultyFiles, ListenerStub) {
    let files = FaultyFiles()
    let storage = try open(options(dir), files: files)
    let a = ListenerStub()
    #expect(storage.append(record("a", 1, "k", "kept"), listener: a))
    #expect(waitFor { a.durable == 1 })
    return (storage, files, a)
}

@Suite(.mayBlock) struct LogFailureTests {
    @Test func aGroupThatFailsAtASegmentRollOverLeavesTheNewSegmentsHeader() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var o = options(dir, segmentSize: 4096)
        o.checkpointInterval = .seconds(3600)  // acknowledged writes live in the log only
        let files = FaultyFiles()
        let storage = try open(o, files: files)
        let a = ListenerStub()
        let value = JSONValue.string(String(repeating: "v", count: 1000))
        #expect(storage.append(record("a", 1, "k1", value), listener: a))
        #expect(waitFor { a.durable == 1 })
        // Only the first group of a segment is written right after its 16-byte header: that
        // write, at the next roll-over, finds the disk full.
        files.fail(errno: ENOSPC) { if case .pwrite(let offset, _) = $0 { offset == WriteAheadLog.headerSize } else { false } }
        let failed = appendUntilAFailure(storage, a, from: 2, value: value)
        #expect(a.failures == 1 && a.failedAfter == failed - 1, "the roll-over write fails")
        #expect(segments(dir).count == 2, "in the new segment: \(segments(dir))")
        // The repository undoes it; the next write is acknowledged.
        storage.discard(a, after: failed - 1)
        #expect(storage.append(record("a", failed, "after", "the failure"), listener: a))
        #expect(waitFor { a.durable == failed })
        storage.close()

        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir, segmentSize: 4096), logger: testLogger) }  // refused ("bad header") before the fix
        let loaded = try #require(try reopened.load().first)
        reopened.close()
        #expect(loaded.state.revision == failed)
        #expect((1..<failed).allSatisfy { loaded.state[Key("k\($0)")]?.value == CanonicalJSON(value) }, "every acknowledged write is there")
        #expect(loaded.state[Key("after")]?.value == CanonicalJSON(.string("the failure")))
        #expect(loaded.state[Key("k\(failed)")] == nil, "and the failed one is not")
    }

    @Test func theCheckpointOfAGroupThatRollsOverCountsTheNewSegmentsHeader() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var o = options(dir, segmentSize: 4096)
        o.checkpointInterval = .seconds(3600)  // everything reaches the compacted state at close
        let storage = try lockedByNoOtherProcess { try DiskStorage(options: o, logger: testLogger) }
        let a = ListenerStub()
        let value = JSONValue.string(String(repeating: "v", count: 1000))
        var rev: UInt64 = 0
        // The last group written is the one that opened the second segment.
        while segments(dir).count < 2, rev < 20 {
            rev += 1
            _ = storage.append(record("a", rev, "k\(rev)", value), listener: a)
            #expect(waitFor { a.durable == rev })
        }
        storage.close()
        let last = try #require(segments(dir).last)
        let base = try #require(UInt64(last.prefix(16), radix: 16))
        let applied = try SnapshotLoader.load(dir + "/obsd.snapshot", options: options(dir)).covered
        let end = base + UInt64(try lastFrameEnd(dir + "/wal/" + last))
        #expect(applied == end, "the snapshot covers the log through where its last frame ends, header included (\(applied) against \(end))")
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir, segmentSize: 4096), logger: testLogger) }
        #expect(try reopened.load().first?.state.revision == rev)
        #expect(!reopened.notices.contains { $0.contains("replayed") }, "a clean stop replays nothing: \(reopened.notices)")
        reopened.close()
    }

    /// A `pwrite` a signal interrupts before it wrote anything (EINTR) is made again: the
    /// group is written whole and is durable, not failed and undone.
    @Test func aGroupWriteASignalInterruptsIsWrittenAgain() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (storage, files, a) = try openWithKeyKept(dir)
        files.fail(3, errno: EINTR) { if case .pwrite = $0 { true } else { false } }
        #expect(storage.append(record("a", 2, "k2", "written"), listener: a))
        #expect(waitFor { a.durable == 2 || a.failures > 0 })
        #expect(a.durable == 2 && a.failures == 0, "failed: \(String(describing: a.lastError))")
        #expect(files.failedCalls.count == 3, "three interruptions: \(files.failedCalls)")
        storage.close()
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        let state = try #require(try reopened.load().first).state
        reopened.close()
        #expect(state.revision == 2 && state[Key("k2")]?.value == CanonicalJSON(.string("written")))
    }

    @Test func aFailedGroupWhoseCutFailsIsVoidedAndNeverReplayed() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var o = options(dir)
        o.checkpointInterval = .seconds(3600)
        let files = FaultyFiles()
        let storage = try open(o, files: files)
        let a = ListenerStub()
        #expect(storage.append(record("a", 1, "k1", "kept"), listener: a))
        #expect(waitFor { a.durable == 1 })
        // Revisions 3 to 5 queue while revision 2's sync is held: they make one group of three frames.
        files.hold { $0 == .fdatasync }
        #expect(storage.append(record("a", 2, "k2", "kept"), listener: a))
        #expect(waitFor { files.holding })
        for rev in 3...5 as ClosedRange<UInt64> { #expect(storage.append(record("a", rev, "k\(rev)", "undone"), listener: a)) }
        // That group's sync fails with EIO, and so does its cut: its frames stay in the file.
        files.fail(errno: EIO) { $0 == .fdatasync }
        files.fail(errno: EIO) { if case .ftruncate = $0 { true } else { false } }
        files.release()
        #expect(waitFor { a.failures == 1 })
        #expect(files.failedCalls.count == 2)
        #expect(a.durable == 2 && a.failedAfter == 2 && a.lastError?.kind == .io, "reported undone: \(String(describing: a.lastError))")

        // Told undone, they must never come back: not after a crash now…
        let crashed = try crashCopy(dir)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let recovered = try lockedByNoOtherProcess { try DiskStorage(options: options(crashed), logger: testLogger) }
        let state = try #require(try recovered.load().first).state
        #expect(state.revision == 2 && state[Key("k3")] == nil, "revision \(state.revision)")
        #expect(recovered.notices.contains { $0.contains("after the end of the write-ahead log") }, "\(recovered.notices)")
        recovered.close()

        // …nor once writes went on: in a new segment, never behind the zeroed header (a
        // shorter group there would leave the voided frames after it, valid or cut in two).
        storage.discard(a, after: 2)
        #expect(storage.append(record("a", 3, "k3", "again"), listener: a))
        #expect(waitFor { a.durable == 3 })
        #expect(segments(dir).count == 2, "\(segments(dir))")
        storage.close()
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        let again = try #require(try reopened.load().first).state
        reopened.close()
        #expect(again.revision == 3 && again[Key("k3")]?.value == CanonicalJSON(.string("again")) && again[Key("k4")] == nil)
    }

    @Test func aGroupThatCanBeNeitherCutNorVoidedIsAnsweredOutcomeUnknown() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (storage, files, a) = try openWithKeyKept(dir)
        // The group's sync fails, then its cut, then the write that would void it (the only
        // write of 8 bytes: a frame is at least 16).
        files.fail(errno: EIO) { $0 == .fdatasync }
        files.fail(errno: EIO) { if case .ftruncate = $0 { true } else { false } }
        files.fail(errno: EIO) { if case .pwrite(_, 8) = $0 { true } else { false } }
        #expect(storage.append(record("a", 2, "k", "unknown"), listener: a))
        #expect(waitFor { a.failures == 1 })
        #expect(files.failedCalls.count == 3)
        let error = try #require(a.lastError)
        #expect(error.kind == .outcomeUnknown, "\(error)")
        #expect(error.description.contains("may be applied after a restart") && !error.description.contains("undone"), "\(error)")

        // No write is taken until a restart, even once the disk is well again.
        files.heal()
        storage.discard(a, after: 1)
        #expect(storage.append(record("a", 2, "k", "refused"), listener: a))
        #expect(waitFor { a.failures == 2 })
        #expect(a.lastError?.description.contains("this write was not stored") == true, "\(String(describing: a.lastError))")
        storage.close()

        // Here the frame did reach the file: a restart applies the write told "unknown".
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        let state = try #require(try reopened.load().first).state
        reopened.close()
        #expect(state.revision == 2 && state[Key("k")]?.value == CanonicalJSON(.string("unknown")))
    }

    /// Two failed groups (the robustness suite's `eio-cut-refused`): the first one's cut
    /// promised the preallocated size again but could not sync that header; the second one's
    /// cut must withdraw the promise all the same before it shortens the file — else a crash
    /// (or a sync failing) before the size is promised again leaves a segment shorter than its
    /// header says, which the next start refuses as cut outside obsd.
    @Test func aPromiseWhoseSyncFailedIsWithdrawnBeforeTheNextCut() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (storage, files, a) = try openWithKeyKept(dir)
        /// Fails the group's sync, then the sync after the first call `trigger` matches once
        /// the segment was truncated.
        func failGroupAndTheSyncAfter(_ trigger: @escaping @Sendable (FaultyFiles.Call) -> Bool) {
            let step = Atomic<Int>(0)  // 1: truncated, 2: the trigger seen
            files.fail(errno: EIO) { $0 == .fdatasync }
            files.fail(errno: EIO) { call in
                if case .ftruncate = call, step.load(ordering: .relaxed) == 0 { step.store(1, ordering: .relaxed) }
                if step.load(ordering: .relaxed) == 1, trigger(call) { step.store(2, ordering: .relaxed); return false }
                return call == .fdatasync && step.load(ordering: .relaxed) == 2
            }
        }
        // First group: cut (header withdrawn, file cut), preallocated again, and the header
        // promising the size again written — but its sync fails.
        failGroupAndTheSyncAfter { if case .pwrite(0, WriteAheadLog.headerSize) = $0 { true } else { false } }
        #expect(storage.append(record("a", 2, "k", "undone"), listener: a))
        #expect(waitFor { a.failures == 1 })
        #expect(files.failedCalls == [.fdatasync, .fdatasync], "\(files.failedCalls)")
        #expect(a.durable == 1 && a.lastError?.kind == .io, "reported undone: \(String(describing: a.lastError))")
        // Second group: its cut's sync after the truncation fails (it is voided instead).
        storage.discard(a, after: 1)
        failGroupAndTheSyncAfter { if case .ftruncate = $0 { true } else { false } }
        #expect(storage.append(record("a", 2, "k", "undone too"), listener: a))
        #expect(waitFor { a.failures == 2 })
        #expect(a.durable == 1 && a.lastError?.kind == .io, "reported undone: \(String(describing: a.lastError))")
        storage.close()

        // The next start finds the segment shorter than preallocated, and a header that does
        // not promise that size: no loss (refused as cut outside obsd before the fix).
        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir), logger: testLogger) }
        let state = try #require(try reopened.load().first).state
        reopened.close()
        #expect(state.revision == 1 && state[Key("k")]?.value == CanonicalJSON(.string("kept")))
    }

    @Test func whatFollowsAZeroedFrameHeaderAtTheEndOfTheLogIsCutBeforeAppendsGoOn() throws {
        let crashed = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        // Revisions 8 to 10 behind a zeroed frame header: a voided group, or one whose first
        // page a crash lost. Their frames are valid, and were never acknowledged.
        let segment = crashed + "/wal/" + (try #require(segments(crashed).last))
        let starts = try walRecordStarts(segment)
        try #require(starts.count == 10)
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: segment))
        try file.seek(toOffset: UInt64(starts[7]))
        try file.write(contentsOf: Data(count: 8))
        try file.close()

        let recovered = try lockedByNoOtherProcess { try DiskStorage(options: options(crashed), logger: testLogger) }
        #expect(try recovered.load().first?.state.revision == 7)
        // Cut from the start of revision 8's group: its group-start frame goes with it.
        #expect(
            recovered.notices.contains { $0.contains("after the end of the write-ahead log") && $0.contains("offset \(starts[7] - 16)") },
            "\(recovered.notices)")
        // Appends go on where the log ends; what was behind the zeroed header is gone.
        let b = ListenerStub()
        #expect(recovered.append(record("a", 8, "k", "new"), listener: b))
        recovered.close()
        #expect(b.durable == 8)
        let again = try lockedByNoOtherProcess { try DiskStorage(options: options(crashed), logger: testLogger) }
        let state = try #require(try again.load().first).state
        again.close()
        #expect(state.revision == 8 && state[Key("k")]?.value == CanonicalJSON(.string("new")), "revision \(state.revision)")
    }

    @Test(.enabled(if: Tmpfs.available, "needs root and permission to mount tmpfs"))
    func aFullDiskAtASegmentRollOverLeavesTheLogStartable() throws {
        let mount = try Tmpfs(megabytes: 16)
        defer { mount.unmount() }
        let dir = mount.path + "/data"
        var o = options(dir, segmentSize: 1 << 20)
        o.checkpointInterval = .seconds(3600)  // acknowledged writes live in the log only
        let storage = try lockedByNoOtherProcess { try DiskStorage(options: o, logger: testLogger) }
        let a = ListenerStub()
        let big = JSONValue.string(String(repeating: "x", count: 400_000))
        // Fill the first segment until the next write cannot fit in it.
        let first = dir + "/wal/" + (try #require(segments(dir).first))
        var rev: UInt64 = 0
        var end = 16
        repeat {
            rev += 1
            _ = storage.append(record("a", rev, "k\(rev)", big), listener: a)
            #expect(waitFor { a.durable == rev })
            end = try lastFrameEnd(first)
        } while end + (end - 16) / Int(rev) <= 1 << 20
        #expect(segments(dir).count == 1)
        // Fill the file system to 256 KiB free: the roll-over creates the next segment, and
        // its first write (400 kB) finds the disk full.
        var fs = statvfs()
        #expect(statvfs(mount.path, &fs) == 0)
        let fill = Int(fs.f_bavail) * Int(fs.f_frsize) - (256 << 10)
        let filler = mount.path + "/filler"
        let fd = Glibc.open(filler, O_CREAT | O_WRONLY | O_CLOEXEC, 0o600)
        #expect(fd >= 0 && posix_fallocate(fd, 0, off_t(fill)) == 0)
        close(fd)
        _ = storage.append(record("a", rev + 1, "k\(rev + 1)", big), listener: a)
        #expect(waitFor { a.failures == 1 })
        #expect(a.failedAfter == rev && a.lastError?.kind == .full, "\(String(describing: a.lastError))")
        #expect(segments(dir).count == 2, "the roll-over happened: \(segments(dir))")
        // Space is freed; the next write is acknowledged; a restart finds every acknowledged write.
        storage.discard(a, after: rev)
        try FileManager.default.removeItem(atPath: filler)
        #expect(storage.append(record("a", rev + 1, "after", "freed"), listener: a))
        #expect(waitFor { a.durable == rev + 1 })
        storage.close()

        let reopened = try lockedByNoOtherProcess { try DiskStorage(options: options(dir, segmentSize: 1 << 20), logger: testLogger) }  // refused ("bad header") before the fix
        let state = try #require(try reopened.load().first).state
        reopened.close()
        #expect(state.revision == rev + 1)
        #expect((1...rev).allSatisfy { state[Key("k\($0)")]?.value == CanonicalJSON(big) })
        #expect(state[Key("after")]?.value == CanonicalJSON(.string("freed")))
    }
}
