// Tests of the disk store on its own: the write-ahead log (group commit, segments, replay,
// torn tails, damage), the checkpointer (snapshots, history windows), and what a failing disk
// does to the writes in flight.

import Foundation
import Logging
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import TestSupport
import Testing

/// A repository as the store sees it: records what storage reports. Its frames are numbered
/// by their revisions (`append(_:listener:)`), so the sequences it hears are revisions.
final class ListenerStub: DurabilityListener {
    let epoch = Epoch.random()
    private let reports = Locked<(durable: UInt64, failedAfter: UInt64?, failures: Int, error: StorageError?)>((0, nil, 0, nil))

    func durable(through sequence: UInt64) { reports.withLock { $0.durable = max($0.durable, sequence) } }
    func failed(after sequence: UInt64, error: StorageError) {
        reports.withLock {
            $0.failedAfter = sequence
            $0.failures += 1
            $0.error = error
        }
    }

    var durable: UInt64 { reports.withLock { $0.durable } }
    var failedAfter: UInt64? { reports.withLock { $0.failedAfter } }
    var failures: Int { reports.withLock { $0.failures } }
    /// The error of the last failure reported.
    var lastError: StorageError? { reports.withLock { $0.error } }
}

extension Storage {
    /// Queues `record` as the frame numbered by its revision.
    func append(_ record: RevisionRecord, listener: ListenerStub) -> Bool {
        append(.revision(RevisionFrame(record, epoch: listener.epoch)), sequence: record.revision, listener: listener)
    }
}

func record(_ repo: String, _ revision: UInt64, _ key: String = "k", _ value: JSONValue = 1, time: Int64 = 1_700_000_000) -> RevisionRecord {
    RevisionRecord(
        repo: repo, changeSet: ChangeSet(revision: revision, changes: [Change(key: Key(key), old: nil, new: CanonicalJSON(value))]),
        time: time, writer: Writer(uid: 1000, gid: 1000, pid: 42))
}

func temporaryDirectory() -> String {
    var template = Array("/tmp/obsstore-test-XXXXXX".utf8CString)
    return template.withUnsafeMutableBufferPointer { String(cString: mkdtemp($0.baseAddress!)) }
}

func options(_ dir: String, historyLimit: Int = 100, maxBytes: Int = 64 << 20, maxAge: Duration? = nil, segmentSize: Int = 64 << 20) -> DiskStorage.Options {
    var options = DiskStorage.Options(directory: dir, sync: .always, historyLimit: historyLimit, historyMaxBytes: maxBytes, historyMaxAge: maxAge)
    options.segmentSize = segmentSize
    return options
}

let testLogger = Logger(label: "obsstore-test")

/// Opens a store with `open`, again while the directory's lock is held by this very process: a
/// store a test closed a moment ago may still hold it, because a child that another test of
/// the process spawns shares the lock's open file between its fork and its exec (`flock`
/// belongs to the open file), and on a busy machine that moment lasts (a fresh clone's run:
/// "in use by another obsd (pid <the test process>)"). obsd spawns no child; this is the test
/// process's own doing. Any other error, or one still there after 10 s, is thrown.
///
/// A `DiskStorage` opened here has its reports delivered (`deliverReports`).
func lockedByNoOtherProcess<T>(_ open: () throws -> T) throws -> T {
    let deadline = ContinuousClock.now + .seconds(10)
    while true {
        do {
            let opened = try open()
            if let storage = opened as? DiskStorage { deliverReports(of: storage) }
            return opened
        } catch let error as StorageError where error.kind == .locked && error.description.hasSuffix("(pid \(getpid()))") && ContinuousClock.now < deadline {
            usleep(10_000)
        }
    }
}

func open(_ options: DiskStorage.Options) throws -> DiskStorage { try lockedByNoOtherProcess { try DiskStorage(options: options, logger: testLogger) } }

/// Has what `storage` reports delivered to the listeners as the server's courier does, with no
/// event loop: what the committer thread posts, at once on that thread; what a thread that
/// flushes posts, by `flushed`.
func deliverReports(of storage: DiskStorage) {
    guard let reports = storage.reports else { return }
    reports.whenPosted { deliver(reports) }
}

/// Flushes `storage` on this thread, then delivers what that reported (the server's loops do
/// both at the end of each iteration).
func flushed(_ storage: DiskStorage) {
    storage.flush()
    if let reports = storage.reports { deliver(reports) }
}

private func deliver(_ reports: DurabilityReports) {
    for (listener, outcome) in reports.take() {
        switch outcome {
        case .durable(let sequence): listener.durable(through: sequence)
        case .failed(let sequence, let error): listener.failed(after: sequence, error: error)
        }
    }
}

/// Waits (bounded) until `condition` holds.
func waitFor(_ condition: () -> Bool) -> Bool {
    let deadline = ContinuousClock.now + .seconds(20)
    while !condition() {
        if ContinuousClock.now > deadline { return condition() }
        usleep(1000)
    }
    return true
}

/// The log's segment files, sorted.
func segments(_ dir: String) -> [String] {
    ((try? FileManager.default.contentsOfDirectory(atPath: dir + "/wal")) ?? []).filter { $0.hasSuffix(".wal") }.sorted()
}

/// A copy of a live data directory, as a crash would leave it (the snapshot and the log as
/// written so far, and the marker of a daemon still running). The log is copied first: a
/// snapshot written meanwhile deletes segments, and the older log beside a newer snapshot is
/// what a crash can leave too — the reverse is not.
func crashCopy(_ dir: String) throws -> String {
    let copy = temporaryDirectory()
    for attempt in 1...20 {
        do {
            try FileManager.default.copyItem(atPath: dir + "/wal", toPath: copy + "/wal")
            break
        } catch {
            // A segment deleted while it was copied: again.
            try? FileManager.default.removeItem(atPath: copy + "/wal")
            if attempt == 20 { throw error }
        }
    }
    for name in ["obsd.snapshot", "obsd.run"] where FileManager.default.fileExists(atPath: dir + "/" + name) {
        try FileManager.default.copyItem(atPath: dir + "/" + name, toPath: copy + "/" + name)
    }
    return copy
}

/// A data directory as a crash would leave it after `revisions` durable revisions of "a"
/// (key `k<rev>` = `value`, a group each), none of them in the compacted state yet (the
/// caller removes it).
func crashedAfter(_ revisions: UInt64, value: JSONValue = 1, segmentSize: Int = 64 << 20) throws -> String {
    let dir = temporaryDirectory()
    defer { try? FileManager.default.removeItem(atPath: dir) }
    var o = options(dir, segmentSize: segmentSize)
    o.checkpointInterval = .seconds(3600)
    let storage = try open(o)
    defer { storage.close() }
    let a = ListenerStub()
    for rev in 1...revisions {
        _ = storage.append(record("a", rev, "k\(rev)", value), listener: a)
        guard waitFor({ a.durable == rev }) else { throw StorageError(.io, "revision \(rev) not durable within 20 s") }
    }
    return try crashCopy(dir)
}

func crashedAfterTenRevisions() throws -> String { try crashedAfter(10) }

@Suite(.mayBlock) struct DiskStorageTests {
    /// Storage never calls a listener: a group's outcome is posted. What a thread that flushes
    /// commits waits for that thread to take it (nobody is woken); what the committer thread
    /// commits wakes the deliverer, once while reports wait.
    @Test func storageReportsDurabilityAndCallsNoListener() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try DiskStorage(options: options(dir), logger: testLogger)  // no deliverer: see `deliverReports`
        defer { storage.close() }
        let reports = try #require(storage.reports)
        let wakes = Atomic<Int>(0)
        reports.whenPosted { wakes.add(1, ordering: .relaxed) }
        let a = ListenerStub()

        // This thread flushes: it commits what it queued, and takes the report itself.
        storage.flush()
        #expect(storage.append(record("a", 1), listener: a))
        #expect(storage.append(record("a", 2), listener: a))
        storage.flush()
        #expect(a.durable == 0, "storage called the listener")
        #expect(wakes.load(ordering: .relaxed) == 0, "a flush's report woke the deliverer")
        let taken = reports.take()
        #expect(taken.count == 1 && taken.first?.listener === a)
        guard case .durable(through: 2)? = taken.first?.outcome else {
            Issue.record("not reported durable through 2: \(taken.map(\.outcome))")
            return
        }
        #expect(!reports.hasReports && reports.take().isEmpty)

        // Another thread, which never flushes, queues: the committer thread commits it, and its
        // report wakes the deliverer.
        let other = Thread { _ = storage.append(record("a", 3), listener: a) }
        other.start()
        #expect(waitFor { reports.hasReports })
        #expect(waitFor { wakes.load(ordering: .relaxed) == 1 })
        #expect(a.durable == 0)
        guard case .durable(through: 3)? = reports.take().first?.outcome else {
            Issue.record("not reported durable through 3")
            return
        }
    }

    @Test func whatWasMadeDurableIsLoadedWithItsHistoryAndEpoch() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (a, b) = (ListenerStub(), ListenerStub())
        do {
            let storage = try open(options(dir))
            for rev in 1...200 as ClosedRange<UInt64> {
                #expect(storage.append(record("a", rev, "k\(rev % 7)", .int(Int64(rev))), listener: a))
                if rev <= 20 { #expect(storage.append(record("b", rev), listener: b)) }
            }
            storage.close()
            #expect(a.durable == 200 && b.durable == 20 && a.failedAfter == nil)
        }
        let reopened = try open(options(dir))
        defer { reopened.close() }
        let loaded = Dictionary(uniqueKeysWithValues: try reopened.load().map { ($0.name, $0) })
        let repoA = try #require(loaded["a"])
        #expect(repoA.state.revision == 200 && repoA.state.count == 7)
        #expect(repoA.state[Key("k4")]?.value == CanonicalJSON(.int(200)))
        #expect(repoA.history.map(\.revision) == Array(101...200), "the newest history-limit revisions")
        #expect(repoA.history.allSatisfy { $0.writer == Writer(uid: 1000, gid: 1000, pid: 42) }, "who wrote each revision is kept")
        #expect(repoA.epoch == a.epoch && loaded["b"]?.epoch == b.epoch, "each repository's epoch is stored with it")
        #expect(reopened.notices.isEmpty, "a clean stop replays nothing: \(reopened.notices)")
    }

    @Test func aCrashReplaysTheLogOnTopOfTheCompactedState() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var o = options(dir)
        o.checkpointInterval = .seconds(3600)  // nothing reaches the compacted state
        let storage = try open(o)
        let a = ListenerStub()
        for rev in 1...300 as ClosedRange<UInt64> { #expect(storage.append(record("a", rev, "k\(rev)"), listener: a)) }
        #expect(waitFor { a.durable == 300 })
        let crashed = try crashCopy(dir)
        storage.close()
        defer { try? FileManager.default.removeItem(atPath: crashed) }

        let recovered = try open(options(crashed))
        let loaded = try #require(try recovered.load().first)
        #expect(loaded.name == "a" && loaded.state.revision == 300 && loaded.state.count == 300)
        #expect(loaded.history.last?.revision == 300 && loaded.history.count == 100)
        #expect(loaded.history.last?.writer == Writer(uid: 1000, gid: 1000, pid: 42), "the log keeps the writer too")
        #expect(recovered.notices.contains { $0.contains("replayed 300 revisions") }, "\(recovered.notices)")
        recovered.close()
        // The replayed revisions reached the compacted state: the next start replays none.
        let again = try open(options(crashed))
        #expect(try again.load().first?.state.revision == 300)
        #expect(!again.notices.contains { $0.contains("replayed") }, "\(again.notices)")
        again.close()
    }

    @Test func aTornTailIsCutOffAndReported() throws {
        let crashed = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        // Half a frame after the last one: a group whose write a crash interrupted.
        let segment = crashed + "/wal/" + segments(crashed).last!
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: segment))
        let end = try lastFrameEnd(segment)
        try file.seek(toOffset: UInt64(end))
        try file.write(contentsOf: Data([40, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3]))
        try file.close()

        let recovered = try open(options(crashed))
        #expect(try recovered.load().first?.state.revision == 10)
        #expect(recovered.notices.contains { $0.contains("cut 11 bytes of a torn write") && $0.contains(segment) }, "\(recovered.notices)")
        // Appends continue after the cut.
        let b = ListenerStub()
        #expect(recovered.append(record("a", 11), listener: b))
        recovered.close()
        #expect(b.durable == 11)
        let again = try open(options(crashed))
        #expect(try again.load().first?.state.revision == 11)
        again.close()
    }

    @Test func aNewSegmentWhoseHeaderNeverReachedTheDiskIsDiscarded() throws {
        let crashed = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        // A roll-over a crash interrupted: the next segment preallocated, its header never synced.
        let last = try #require(segments(crashed).last)
        let next = try #require(UInt64(last.dropLast(4), radix: 16)) + 1 << 20
        let name = String(repeating: "0", count: 16 - String(next, radix: 16).count) + String(next, radix: 16) + ".wal"
        try Data(count: 64 << 10).write(to: URL(fileURLWithPath: crashed + "/wal/" + name))

        let recovered = try open(options(crashed))
        #expect(try recovered.load().first?.state.revision == 10, "the log before it is replayed")
        let b = ListenerStub()
        #expect(recovered.append(record("a", 11), listener: b))
        recovered.close()
        #expect(b.durable == 11)
        let again = try open(options(crashed))
        #expect(try again.load().first?.state.revision == 11, "appends after the discarded segment are found again")
        again.close()
    }

    @Test func damageInTheMiddleOfTheLogRefusesToStartNamingTheFileAndOffset() throws {
        let crashed = try crashedAfterTenRevisions()
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let segment = crashed + "/wal/" + segments(crashed).last!
        // Flip a byte of the first record's payload (after the 32-byte header, the 16-byte
        // group-start frame and the record's 8-byte frame header).
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: segment))
        try file.seek(toOffset: 62)
        let byte = try #require(try file.read(upToCount: 1)?.first)
        try file.seek(toOffset: 62)
        try file.write(contentsOf: Data([byte ^ 0x40]))
        try file.close()

        #expect {
            try open(options(crashed))
        } throws: { error in
            guard let error = error as? StorageError else { return false }
            return error.kind == .corrupt && error.description.contains(segment) && error.description.contains("offset 48")
        }
    }

    @Test func segmentsRollOverAndAreDeletedOnceTheCompactedStateHoldsThem() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var o = options(dir, segmentSize: 4096)
        o.checkpointInterval = .milliseconds(20)
        o.snapshotLogBytes = 8192
        let storage = try open(o)
        let a = ListenerStub()
        for rev in 1...400 as ClosedRange<UInt64> {
            _ = storage.append(record("a", rev, "k", .string(String(repeating: "v", count: 100))), listener: a)
        }
        #expect(waitFor { a.durable == 400 })
        // What stays: the log the snapshot does not cover yet — less than the checkpointer's
        // threshold, `snapshotLogBytes` or half the snapshot's size, whichever is larger —
        // over the segments it spans, and the segment being written. (Not "two": where the
        // last checkpoint falls depends on when the checkpointer looked, and a busy machine's
        // run left three.) About 60 KiB were written, fifteen segments.
        func bound() -> Int {
            let snapshot = (try? FileManager.default.attributesOfItem(atPath: dir + "/obsd.snapshot")[.size] as? Int) ?? 0
            return (max(o.snapshotLogBytes, snapshot / 2) + 4095) / 4096 + 2
        }
        #expect(waitFor { segments(dir).count <= bound() }, "applied segments are deleted: \(segments(dir)), at most \(bound()) may stay")
        storage.close()
        let reopened = try open(options(dir, segmentSize: 4096))
        #expect(try reopened.load().first?.state.revision == 400)
        reopened.close()
    }

    @Test func aClosedStoreRefusesAppendsWithoutCallingBack() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try open(options(dir))
        let a = ListenerStub()
        #expect(storage.append(record("a", 1), listener: a))
        storage.close()
        #expect(a.durable == 1, "close makes everything queued durable first")
        #expect(!storage.append(record("a", 2), listener: a), "closed: refused")
        #expect(a.failedAfter == nil && a.durable == 1, "and the caller, who holds its lock, is not called")
    }

    @Test func aClockStepBackNeverBreaksTheHistory() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let now = WallClock.unixSeconds()
        do {
            let storage = try open(options(dir, maxAge: .seconds(3600)))
            let a = ListenerStub()
            // The clock stepped back an hour and a half between revision 5 and 6 (records
            // stamped by an older obsd, before times were kept monotonic).
            for rev in 1...5 as ClosedRange<UInt64> { _ = storage.append(record("a", rev, time: now), listener: a) }
            for rev in 6...10 as ClosedRange<UInt64> { _ = storage.append(record("a", rev, time: now - 5400), listener: a) }
            storage.close()
        }
        let reopened = try open(options(dir, maxAge: .seconds(3600)))
        let loaded = try #require(try reopened.load().first)
        reopened.close()
        #expect(loaded.state.revision == 10)
        // The newest revisions look oldest: age expiry keeps a contiguous suffix (here none).
        let revisions = loaded.history.map(\.revision)
        #expect(revisions.isEmpty || revisions == Array(revisions.first!...10), "\(revisions)")
    }

    @Test func historyIsBoundedByBytes() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let big = JSONValue.string(String(repeating: "x", count: 10_000))
        do {
            let storage = try open(options(dir, maxBytes: 50_000))
            let a = ListenerStub()
            for rev in 1...30 as ClosedRange<UInt64> { _ = storage.append(record("a", rev, "k", big), listener: a) }
            storage.close()
        }
        let reopened = try open(options(dir, maxBytes: 50_000))
        let loaded = try #require(try reopened.load().first)
        reopened.close()
        #expect(loaded.history.map(\.revision) == Array(27...30), "four revisions of ~10 kB fit in 50 kB")
    }

    @Test(.enabled(if: Tmpfs.available, "needs root and permission to mount tmpfs"))
    func aFullDiskFailsTheGroupThenHeals() throws {
        let mount = try Tmpfs(megabytes: 2)
        defer { mount.unmount() }
        let dir = mount.path + "/data"
        let storage = try open(options(dir, segmentSize: 1 << 20))
        let a = ListenerStub()
        #expect(storage.append(record("a", 1), listener: a))
        #expect(waitFor { a.durable == 1 })
        // Fill the file system, then write until the log refuses.
        let filler = mount.path + "/filler"
        #expect(FileManager.default.createFile(atPath: filler, contents: nil))
        let handle = try #require(FileHandle(forWritingAtPath: filler))
        while (try? handle.write(contentsOf: Data(count: 64 << 10))) != nil {}
        try? handle.close()
        let big = JSONValue.string(String(repeating: "x", count: 200_000))
        var rev: UInt64 = 1
        while a.failures == 0, rev < 40 {
            rev += 1
            _ = storage.append(record("a", rev, "k\(rev)", big), listener: a)
            _ = waitFor { a.durable == rev || a.failures > 0 }
        }
        #expect(a.failures == 1, "the failed group is reported once")
        let kept = try #require(a.failedAfter)
        // Until the repository undoes the failed revisions, its later ones are dropped.
        _ = storage.append(record("a", kept + 2, "late"), listener: a)
        storage.discard(a, after: kept)
        try FileManager.default.removeItem(atPath: filler)
        #expect(storage.append(record("a", kept + 1, "healed", "yes"), listener: a))
        #expect(waitFor { a.durable == kept + 1 })
        storage.close()
        let reopened = try open(options(dir, segmentSize: 1 << 20))
        let loaded = try #require(try reopened.load().first)
        reopened.close()
        #expect(loaded.state.revision == kept + 1)
        #expect(loaded.state[Key("healed")]?.value == CanonicalJSON(.string("yes")))
        #expect(loaded.state[Key("late")] == nil)
    }
}

/// Where the last valid frame of a segment's log ends (frames: u32 length, u32 crc, payload,
/// pad to 8; after the header, 32 bytes in a format 3 segment, 16 before): at an all-zero
/// frame header, or where the frame that names the next segment begins.
func lastFrameEnd(_ path: String) throws -> Int {
    let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
    var at = walHeaderSize(bytes)
    while at + 8 <= bytes.count {
        let length = Int(bytes[at]) | Int(bytes[at + 1]) << 8 | Int(bytes[at + 2]) << 16 | Int(bytes[at + 3]) << 24
        if length == 0 || (length == 9 && at + 8 < bytes.count && bytes[at + 8] == 0xFE) { break }
        at = (at + 8 + length + 7) & ~7
    }
    return at
}
