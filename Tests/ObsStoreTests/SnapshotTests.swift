// Tests of the snapshot: random writes over several repositories with snapshots taken while
// they go on, checked against a model (entries, history, tombstones) after a clean stop and
// after a crash at any point; a snapshot torn, damaged, foreign or missing, and log segments
// missing, refused with the file and the cause; a leftover partial snapshot removed; an
// earlier obsd's SQLite state migrated with its log replayed on top (knowing no deletion
// before it); the CRC-32C instruction against the tables. (Tombstones on their own:
// TombstoneStorageTests.)

import Foundation
import ObsProtocol
import ObservableKit
import TestSupport
import Testing

@testable import ObsStore

/// What a model of the store expects: per repository, its entries, its revisions and the
/// revision of the last deletion of each absent key (its tombstones: all of them, the bound
/// far away).
private struct Model {
    var entries: [String: [Key: Entry<CanonicalJSON>]] = [:]
    var revisions: [String: UInt64] = [:]
    var deletions: [String: [Key: UInt64]] = [:]

    /// A random revision of one of `repos` (sets and deletions of a few of 60 keys).
    mutating func next(_ repos: [String], _ rng: inout SeededGenerator) -> RevisionRecord {
        let repo = repos.randomElement(using: &rng)!
        let revision = (revisions[repo] ?? 0) + 1
        revisions[repo] = revision
        var changes: [Change<CanonicalJSON>] = []
        var touched = Set<Key>()
        for _ in 0..<Int.random(in: 1...4, using: &rng) {
            let key = Key("key/\(Int.random(in: 0..<60, using: &rng))")
            guard touched.insert(key).inserted else { continue }
            let old = entries[repo]?[key]?.value
            if old != nil, Int.random(in: 0..<4, using: &rng) == 0 {
                changes.append(Change(key: key, old: old, new: nil))
                entries[repo]![key] = nil
                deletions[repo, default: [:]][key] = revision
            } else {
                let value = stringValue(Int(revision), size: Int.random(in: 1...200, using: &rng))
                changes.append(Change(key: key, old: old, new: value))
                entries[repo, default: [:]][key] = Entry(value: value, revision: revision)
                deletions[repo]?[key] = nil
            }
        }
        return RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: changes), time: 1_700_000_000, writer: nil)
    }

    /// `everyDeletionKnown`: the store never started a new epoch (a copied snapshot does: it
    /// knows only the deletions above the revision it was taken at).
    func check(_ loaded: [LoadedRepository], historyLimit: Int, everyDeletionKnown: Bool = true, sourceLocation: SourceLocation = #_sourceLocation) {
        #expect(Set(loaded.map(\.name)) == Set(revisions.keys), sourceLocation: sourceLocation)
        for repository in loaded {
            #expect(repository.state.revision == revisions[repository.name], sourceLocation: sourceLocation)
            expectSame(repository.state, entries[repository.name] ?? [:], sourceLocation: sourceLocation)
            let revision = revisions[repository.name] ?? 0
            let expected = Array(max(1, Int(revision) - historyLimit + 1)...Int(revision)).map(UInt64.init)
            #expect(repository.history.map(\.revision) == expected, "\(repository.name)", sourceLocation: sourceLocation)
            let tombstones = Dictionary(uniqueKeysWithValues: repository.tombstones.entries.map { ($0.key, $0.revision) })
            let floor = repository.tombstones.floor
            if everyDeletionKnown { #expect(floor == 0, "\(repository.name): every deletion is known", sourceLocation: sourceLocation) }
            let known = (deletions[repository.name] ?? [:]).filter { $0.value > floor }
            #expect(tombstones == known, "\(repository.name)'s tombstones above \(floor)", sourceLocation: sourceLocation)
        }
    }
}

private func storeOptions(_ dir: String) -> DiskStorage.Options {
    var o = options(dir, historyLimit: 30, segmentSize: 8192)
    o.checkpointInterval = .milliseconds(5)
    o.snapshotLogBytes = 4096
    return o
}

/// A clean store holding a few revisions, stopped; its snapshot's path.
private func storeWithASnapshot(_ dir: String) throws -> String {
    let storage = try open(storeOptions(dir))
    let a = ListenerStub()
    for rev in 1...40 as ClosedRange<UInt64> { _ = storage.append(record("a", rev, "k\(rev % 9)", .string("value \(rev)")), listener: a) }
    storage.close()
    return dir + "/obsd.snapshot"
}

private func expectRefusal(_ dir: String, naming path: String, _ words: String..., sourceLocation: SourceLocation = #_sourceLocation) {
    #expect(sourceLocation: sourceLocation) {
        try open(storeOptions(dir)).close()
    } throws: { error in
        guard let error = error as? StorageError, error.kind == .corrupt else { return false }
        return error.description.contains(path) && words.allSatisfy { error.description.contains($0) }
    }
}

@Suite(.mayBlock) struct SnapshotTests {
    @Test(arguments: [21 as UInt64, 22])
    func snapshotsTakenWhileWritingLoadWhatWasWrittenAfterAStopOrACrash(seed: UInt64) throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        var rng = SeededGenerator(seed: seed)
        var model = Model()
        let repos = ["a", "b", "c"]
        let listeners = Dictionary(uniqueKeysWithValues: repos.map { ($0, ListenerStub()) })
        let storage = try open(storeOptions(dir))
        var crashes: [(copy: String, model: Model, killed: Bool)] = []
        var checkpoints = 0
        for step in 1...1_500 {
            let record = model.next(repos, &rng)
            #expect(storage.append(record, listener: listeners[record.repo]!))
            if step % 500 == 0 {
                // As a crash would leave it once this is durable and a snapshot was taken since
                // the last copy: a snapshot and the log after it. (Waited for, not hoped for: a
                // busy machine writes all this between two of the checkpointer's looks.)
                #expect(waitFor { repos.allSatisfy { listeners[$0]!.durable == model.revisions[$0] ?? 0 } })
                #expect(waitFor { storage.counters!.checkpoints.load(ordering: .relaxed) > checkpoints }, "no snapshot taken while writing")
                checkpoints = storage.counters!.checkpoints.load(ordering: .relaxed)
                // Left in place by a kill, or copied (a new epoch) — every other time.
                crashes.append((step % 1000 == 0 ? try killedCopy(dir) : try crashCopy(dir), model, step % 1000 == 0))
            }
        }
        storage.close()
        #expect(storage.counters!.checkpoints.load(ordering: .relaxed) >= 3, "snapshots were taken while writing")

        let reopened = try open(storeOptions(dir))
        model.check(try reopened.load(), historyLimit: 30)
        #expect(reopened.notices.isEmpty, "a clean stop leaves nothing to replay: \(reopened.notices)")
        reopened.close()
        for (copy, expected, killed) in crashes {
            defer { try? FileManager.default.removeItem(atPath: copy) }
            let recovered = try open(storeOptions(copy))
            expected.check(try recovered.load(), historyLimit: 30, everyDeletionKnown: killed)
            recovered.close()
        }
    }

    @Test func aTornSnapshotIsRefused() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = try storeWithASnapshot(dir)
        let whole = try Data(contentsOf: URL(fileURLWithPath: path))
        for cut in [whole.count - 1, whole.count - 32, whole.count / 2, 30] {
            try whole.prefix(cut).write(to: URL(fileURLWithPath: path))
            expectRefusal(dir, naming: path, "is torn")
        }
    }

    @Test func aDamagedSnapshotIsRefusedWithItsOffset() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = try storeWithASnapshot(dir)
        let whole = try Data(contentsOf: URL(fileURLWithPath: path))
        // A byte of every block's payload and of a block header: each is found.
        for at in stride(from: 30, to: whole.count - 1, by: max(1, whole.count / 23)) {
            var damaged = whole
            damaged[at] ^= 0x10
            try damaged.write(to: URL(fileURLWithPath: path))
            #expect {
                try open(storeOptions(dir)).close()
            } throws: { error in
                guard let error = error as? StorageError, error.kind == .corrupt else { return false }
                return error.description.contains(path) && (error.description.contains("is damaged") || error.description.contains("is torn"))
            }
        }
        try whole.write(to: URL(fileURLWithPath: path))
        let intact = try open(storeOptions(dir))
        #expect(try intact.load().first?.state.revision == 40)
        intact.close()
    }

    @Test func aForeignFileIsRefused() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = try storeWithASnapshot(dir)
        try Data("SQLite format 3\0 and more".utf8).write(to: URL(fileURLWithPath: path))
        expectRefusal(dir, naming: path, "is not an obsd snapshot")
        try Data().write(to: URL(fileURLWithPath: path))
        expectRefusal(dir, naming: path, "is not an obsd snapshot")
    }

    @Test func aMissingSnapshotOrLogSegmentIsRefused() throws {
        // A group each, in segments of 8 KiB: the log rolls over segments.
        let crashed = try crashedAfter(60, value: .string(String(repeating: "v", count: 500)), segmentSize: 8192)
        defer { try? FileManager.default.removeItem(atPath: crashed) }
        let names = segments(crashed)
        try #require(names.count >= 3)
        try FileManager.default.removeItem(atPath: crashed + "/wal/" + names[1])
        expectRefusal(crashed, naming: crashed + "/wal/" + names[2], "segments between are missing")
        try FileManager.default.removeItem(atPath: crashed + "/obsd.snapshot")
        expectRefusal(crashed, naming: crashed + "/obsd.snapshot", "is missing")
    }

    @Test func aPartialSnapshotACrashLeftIsRemoved() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        _ = try storeWithASnapshot(dir)
        try Data(repeating: 7, count: 100).write(to: URL(fileURLWithPath: dir + "/obsd.snapshot.new"))
        let reopened = try open(storeOptions(dir))
        #expect(try reopened.load().first?.state.revision == 40)
        #expect(reopened.notices.contains { $0.contains("obsd.snapshot.new") }, "\(reopened.notices)")
        #expect(!FileManager.default.fileExists(atPath: dir + "/obsd.snapshot.new"))
        reopened.close()
    }

    @Test func anEarlierObsdsSQLiteStateIsMigratedWithItsLogReplayedOnTop() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        // The state of revision 1 in SQLite (schema 3, as obsd 0.3 wrote it), revision 2 in the log.
        try DataDirectory.create(dir)
        let (connection, _) = try Schema.open(path: dir + "/obsd.db", options: options(dir))
        try connection.execute(
            """
            INSERT INTO repos VALUES (1, 'old', 1, '0123456789abcdef0123456789abcdef');
            INSERT INTO entries VALUES (1, CAST('k' AS BLOB), CAST('"kept"' AS BLOB), 1);
            INSERT INTO meta VALUES ('wal_applied', '0');
            """)
        connection.close()
        let log = WriteAheadLog(directory: dir + "/wal")
        _ = try log.open(after: 0) { _, _ in }
        var frame: [UInt8] = []
        WriteAheadLog.startGroup(into: &frame)
        LogRecord.appendFrame(.revision(RevisionFrame(record("old", 2, "k2", "logged"), epoch: "0123456789abcdef0123456789abcdef")), to: &frame)
        _ = try log.append(frame)
        try log.sync()

        let migrated = try open(options(dir))
        let loaded = try #require(try migrated.load().first)
        #expect(loaded.state.revision == 2 && loaded.state[Key("k")]?.value == CanonicalJSON(.string("kept")))
        #expect(loaded.tombstones.floor == 1 && loaded.tombstones.isEmpty, "no deletion before the migrated state is known")
        #expect(loaded.state[Key("k2")]?.value == CanonicalJSON(.string("logged")))
        #expect(migrated.notices.contains { $0.contains("obsd.db") && $0.contains("SQLite") }, "\(migrated.notices)")
        migrated.close()
        #expect(!FileManager.default.fileExists(atPath: dir + "/obsd.db") && FileManager.default.fileExists(atPath: dir + "/obsd.snapshot"))
        let again = try open(options(dir))
        #expect(try again.load().first?.state.revision == 2)
        #expect(again.notices.isEmpty, "\(again.notices)")
        again.close()
    }

    /// A revision's frame reads back as the revision it was written from — its changes, its
    /// writer, the lease attachments it moved — whether its changes were given as values or,
    /// one change, as bytes (the daemon's single-key writes): the two give the same bytes.
    @Test func aRevisionsFrameReadsBackAsItWasWrittenFromValuesOrBytes() throws {
        var rng = SeededGenerator(seed: 9)
        var model = Model()
        var singles = 0
        for i in 0..<200 {
            let base = model.next(["a", "repository-\(i % 3)"], &rng)
            let record = RevisionRecord(
                repo: base.repo, changeSet: ChangeSet(revision: base.revision, changes: base.changes), time: Int64(i) - 100,
                writer: i % 2 == 0 ? nil : Writer(uid: UInt32(i), gid: 7, pid: -Int32(i)))
            let epoch = i % 5 == 0 ? String(repeating: "e", count: 64) : Epoch.random()
            let moves: [AttachmentMove] = i % 3 == 0 ? record.changes.map { ($0.key, nil, $0.new == nil ? nil : UInt64(i + 1)) } : []
            var frame: [UInt8] = [1, 2, 3]
            LogRecord.appendFrame(.revision(RevisionFrame(record, epoch: epoch, moves: moves)), to: &frame)
            let entry = try frame.withUnsafeBytes { raw -> (RevisionRecord, [Key: UInt64], String) in
                guard case .frame(let payload, let next) = WriteAheadLog.frame(in: UnsafeRawBufferPointer(rebasing: raw[3...]), at: 0), next == raw.count - 3,
                    case .revision(let view) = try LogRecord.Entry(UnsafeRawBufferPointer(rebasing: raw[3...][(3 + payload.lowerBound)..<(3 + payload.upperBound)]))
                else { throw TestFailure("not a revision's frame") }
                var attachments: [Key: UInt64] = [:]
                view.moves.apply(to: &attachments)
                return (try view.record(), attachments, String(decoding: view.epoch, as: UTF8.self))
            }
            #expect(entry.0.repo == record.repo && entry.0.revision == record.revision && entry.0.time == record.time && entry.0.writer == record.writer)
            #expect(entry.0.changes == record.changes && entry.2 == epoch, "record \(i)")
            #expect(entry.1 == Dictionary(moves.compactMap { m in m.to.map { (m.key, $0) } }, uniquingKeysWith: max), "record \(i)'s moves")
            // A single change, given as bytes as the daemon's single-key writes queue it: the same frame.
            guard record.changes.count == 1, let change = record.changes.first, moves.isEmpty else { continue }
            var single: [UInt8] = [1, 2, 3]
            change.key.withUTF8 { key in
                (change.old?.bytes ?? []).withUnsafeBytes { old in
                    (change.new?.bytes ?? []).withUnsafeBytes { new in
                        var raw = RawChange(
                            key: UnsafeRawBufferPointer(key), old: change.old == nil ? nil : old, oldIsPlain: change.old?.isPlain ?? true,
                            new: change.new == nil ? nil : new, newIsPlain: change.new?.isPlain ?? true)
                        withUnsafePointer(to: &raw) { raw in
                            let frame = RevisionFrame(
                                repo: record.repo, epoch: epoch, revision: record.revision, time: record.time, writer: record.writer,
                                changes: .raw(UnsafeBufferPointer(start: raw, count: 1)))
                            LogRecord.appendFrame(.revision(frame), to: &single)
                        }
                    }
                }
            }
            #expect(single == frame, "record \(i), as a single change given as bytes")
            singles += 1
        }
        #expect(singles > 20, "\(singles) records of a single change")
    }

    @Test func aGroupTellsEachRepositoryItsLastRevisionInTheOrderTheyCame() {
        let listeners = (0..<12).map { _ in ListenerStub() }
        var batch: [DiskStorage.Queued] = []
        for round in 1...3 as ClosedRange<UInt64> {
            for (i, listener) in listeners.enumerated() where i % 2 == 0 || round > 1 {
                batch.append(DiskStorage.Queued(frame: 0..<0, sequence: round * 10 + UInt64(i), listener: listener))
            }
        }
        let last = Committer.lastSequences(batch)
        let evens = listeners.indices.filter { $0 % 2 == 0 }, odds = listeners.indices.filter { $0 % 2 == 1 }
        #expect(last.map { ObjectIdentifier($0.0) } == (evens + odds).map { ObjectIdentifier(listeners[$0]) })
        #expect(last.map(\.1) == (evens + odds).map { 30 + UInt64($0) })
    }

    @Test func theInstructionComputesWhatTheTablesDo() {
        let check = Array("123456789".utf8)
        #expect(check.withUnsafeBytes { CRC32C.checksum($0) } == 0xE306_9283)
        #expect(check.withUnsafeBytes { CRC32C.software($0) } == 0xE306_9283)
        var rng = SeededGenerator(seed: 5)
        for length in [0, 1, 7, 8, 9, 63, 1000, 4099] {
            let bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &rng) }
            bytes.withUnsafeBytes { raw in
                #expect(CRC32C.checksum(raw) == CRC32C.software(raw))
                let half = raw.count / 2
                let first = CRC32C.checksum(UnsafeRawBufferPointer(rebasing: raw[..<half]))
                #expect(CRC32C.checksum(UnsafeRawBufferPointer(rebasing: raw[half...]), continuing: first) == CRC32C.software(raw))
            }
        }
    }
}
