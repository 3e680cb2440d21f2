// ObsStore — the checkpointer thread: keeps the snapshot (SnapshotFile.swift) close enough to
// the write-ahead log that a restart after a crash replays a bounded log, off the path that
// acknowledges writes.
//
// The committer only publishes how far the log is written (`LogProgress`): no record, no
// allocation per write reaches this thread. Once the log after the snapshot holds at least
// `snapshotLogBytes` and half the snapshot's size — so the snapshot is rewritten at most
// about every time the log grows by half of it — and once more when the store closes, it
// writes a new snapshot: the log frames after the old one are read back from disk and folded
// per repository into a flat table of final values (or deletions) and the newest history;
// the old snapshot is then streamed block by block into the new one, each entry a changed key
// supersedes left out, the changed keys written after; the history trimmed to the limits;
// the lease attachments the log moved applied to each repository's, the leases the log
// granted and ended to the snapshot's; the tombstones, the old snapshot's but those of keys
// the log changed, then the log's deletions (each key's last, in revision order), the oldest
// beyond the configured bound forgotten — the old ones read twice, to count what stays and
// to copy it, rather than held. Memory holds only what changed since the last snapshot (and
// each repository's attachments, one at a time), never a copy of the whole state.
// Once the new snapshot is durable and in place, the log segments it covers are deleted.
//
// A snapshot that cannot be written (a full disk) is logged, once a minute, and retried a few
// seconds later: the log keeps every write meanwhile and simply grows.

import Logging
import ObsValues
import ObservableKit
import Synchronization

/// How far the committer has written the log, and whether it is done.
final class LogProgress: Sendable {
    private let end: Atomic<UInt64>
    /// Never filled, only closed: lets the checkpointer sleep, and wake at once on close.
    private let bell = BlockingQueue<Bool>()

    init(position: UInt64) { end = Atomic(position) }

    /// Every frame up to `position` is written (and, under `sync = always`, synced).
    func advance(to position: UInt64) { end.store(position, ordering: .releasing) }
    var position: UInt64 { end.load(ordering: .acquiring) }

    /// Sleeps up to `duration`; whether the log is closed (no more will come).
    func sleep(_ duration: Duration) -> Bool { bell.takeAll(timeout: duration) == nil }
    func close() { bell.close() }
}

final class Checkpointer {
    private let directory: String
    private let options: DiskStorage.Options
    private let log: WriteAheadLog.Directory
    private let counters: StorageCounters
    private let logger: Logger
    /// The log position the snapshot covers, and its size.
    private var covered: UInt64
    private var snapshotSize: Int
    /// While snapshots fail: since when, when that was last logged, and the last attempt.
    private var failing: (since: ContinuousClock.Instant, logged: ContinuousClock.Instant, tried: ContinuousClock.Instant)? = nil

    init(directory: String, options: DiskStorage.Options, log: WriteAheadLog.Directory, covered: UInt64, snapshotSize: Int, counters: StorageCounters, logger: Logger) {
        self.directory = directory
        self.options = options
        self.log = log
        self.covered = covered
        self.snapshotSize = snapshotSize
        self.counters = counters
        self.logger = logger
    }

    /// Writes snapshots as the log grows until it closes; then one covering all of it, and
    /// marks the directory left cleanly.
    func run(_ progress: LogProgress) {
        while true {
            let closed = progress.sleep(options.checkpointInterval)
            let position = progress.position
            if closed {
                if position > covered { checkpoint(through: position) }
                break
            }
            let due = position > covered && Int(position - covered) >= max(options.snapshotLogBytes, snapshotSize / 2)
            if due, failing.map({ ContinuousClock.now - $0.tried >= .seconds(5) }) ?? true { checkpoint(through: position) }
        }
        // Only a directory whose snapshot holds the whole log counts as left cleanly (the
        // provenance check reads the marker); otherwise the next start replays the rest.
        if covered == progress.position { RunMarker.release(directory, logger: logger) }
    }

    /// Writes a snapshot covering the log through `position`; whether it worked.
    @discardableResult
    func checkpoint(through position: UInt64) -> Bool {
        do throws(StorageError) {
            let size = try merge(through: position)
            covered = position
            snapshotSize = size
        } catch {
            counters.checkpointFailures.add(1, ordering: .relaxed)
            let now = ContinuousClock.now
            if failing == nil || now - failing!.logged >= .seconds(60) {
                logger.error(
                    "cannot write the snapshot; the write-ahead log keeps every write and grows until it can",
                    metadata: [
                        "error": "\(error.description)", "logBytes": "\(position - covered)",
                        "failingSeconds": "\(failing.map { (now - $0.since).components.seconds } ?? 0)",
                    ])
                failing = (failing?.since ?? now, now, now)
            } else {
                failing!.tried = now
            }
            return false
        }
        if let failing {
            logger.notice("the snapshot is up to date again", metadata: ["failedSeconds": "\((ContinuousClock.now - failing.since).components.seconds)"])
            self.failing = nil
        }
        counters.checkpoints.add(1, ordering: .relaxed)
        log.removeSegments(through: position)
        return true
    }

    // MARK: Merging

    /// What the log after the snapshot did to one repository. Read from the log's frames in
    /// place: a frame's keys and values go straight into the table, its history body into
    /// one buffer — no object per revision or per value.
    private struct Changes {
        let name: String
        var epoch: String
        var revision: UInt64 = 0
        /// Final values of the keys it changed; a deletion is a record without a value.
        var table = FlatTable()
        /// Its newest revisions, within the history limits, as a snapshot stores them
        /// (`StoredRevision` bodies) one after another in `bodies`, from `head` on.
        var bodies: [UInt8] = []
        var history: [(start: Int, weight: Int)] = []
        var head = 0
        var weight = 0
        var written = false
        /// The attachments the log moved: key → the lease after (nil: none).
        var moves: [Key: UInt64?] = [:]

        mutating func move(_ moved: LogRecord.Moves) {
            moved.forEach { key, lease in moves[Key(String(decoding: key, as: UTF8.self))] = .some(lease) }
        }

        /// `attachments` with the log's moves applied.
        func attachments(after attachments: [Key: UInt64]) -> [Key: UInt64] {
            var result = attachments
            for (key, lease) in moves { result[key] = lease }
            return result
        }

        mutating func apply(_ record: LogRecord.View, limit: Int, maxBytes: Int) throws(LogRecord.Malformed) {
            revision = record.revision
            move(record.moves)
            let revisionWeight = try record.forEachChange { key, _, new in
                let value = new?.bytes ?? UnsafeRawBufferPointer(start: nil, count: 0)
                table.set(key: key, value: value, isPlain: new?.plain ?? true, revision: record.revision)
            }
            guard limit > 0 else { return }
            history.append((bodies.count, revisionWeight))
            StoredRevision.appendBody(of: record, weight: revisionWeight, to: &bodies)
            weight += revisionWeight
            while history.count - head > limit || (weight > maxBytes && history.count - head > 1) {
                weight -= history[head].weight
                head += 1
            }
            if head >= 1024 && head * 2 >= history.count {
                // Drop what was trimmed from the front of the buffer too.
                let cut = history[head].start
                bodies.removeFirst(cut)
                history.removeFirst(head)
                for k in history.indices { history[k].start -= cut }
                head = 0
            }
        }

        var count: Int { history.count - head }
        var firstRevision: UInt64? {
            count == 0 ? nil : bodies.withUnsafeBytes { UInt64(littleEndian: $0.loadUnaligned(fromByteOffset: history[head].start, as: UInt64.self)) }
        }

        /// Calls `body` with each retained revision's body, oldest first.
        func forEachRetained(_ body: (UnsafeRawBufferPointer) throws(StorageError) -> Void) throws(StorageError) {
            try bodies.withUnsafeBytes { raw in
                Result { () throws(StorageError) in
                    for k in head..<history.count {
                        let end = k + 1 < history.count ? history[k + 1].start : raw.count
                        try body(UnsafeRawBufferPointer(rebasing: raw[history[k].start..<end]))
                    }
                }
            }.get()
        }
    }

    /// Writes the new snapshot: the old one with the log's frames after it folded in.
    /// Returns its size.
    private func merge(through position: UInt64) throws(StorageError) -> Int {
        var changes: [Changes] = []
        var byName: [String: Int] = [:]
        let limit = options.historyLimit
        let maxBytes = options.historyMaxBytes
        let logPath = log.path
        var last: (name: [UInt8], index: Int)? = nil
        /// The log's leases granted and ended, in its order.
        var leaseFrames: [LogRecord.Entry] = []
        try log.forEachFrame(after: covered, through: position) { (payload, at) throws(StorageError) in
            do throws(LogRecord.Malformed) {
                let entry = try LogRecord.Entry(payload)
                let repo: UnsafeRawBufferPointer
                let epoch: UnsafeRawBufferPointer?
                switch entry {
                case .revision(let record): (repo, epoch) = (record.repo, record.epoch)
                case .attachments(let name, _, _): (repo, epoch) = (name, nil)
                case .leaseGranted, .leaseEnded:
                    leaseFrames.append(entry)
                    return
                }
                let index: Int
                if let last, repo.elementsEqual(last.name) {
                    index = last.index
                } else {
                    let name = String(decoding: repo, as: UTF8.self)
                    if let known = byName[name] {
                        index = known
                    } else {
                        // Attachments alone never create a repository (they are of keys that exist).
                        guard let epoch else { return }
                        changes.append(Changes(name: name, epoch: String(decoding: epoch, as: UTF8.self)))
                        index = changes.count - 1
                        byName[name] = index
                    }
                    last = (Array(repo), index)
                }
                switch entry {
                case .revision(let record): try changes[index].apply(record, limit: limit, maxBytes: maxBytes)
                case .attachments(_, _, let moves): changes[index].move(moves)
                default: break
                }
            } catch {
                throw StorageError(.corrupt, "\(logPath): the record ending at position \(at) has a valid checksum but does not decode")
            }
        }

        let writer = try SnapshotWriter(directory: directory, covering: position)
        let input = try SnapshotInput(path: directory + "/" + SnapshotFormat.fileName)
        var block = try input.next()
        guard block.kind == .head else { throw input.malformed(block.at, "it begins with a \(block.kind.name) block, not HEAD") }
        var head = PayloadReader(try input.payload())
        guard let version = head.u32() else { throw input.malformed(block.at, "a HEAD block cut short") }
        block = try input.next()
        var leases = PersistedLeases()
        var referenced = Set<UInt64>()
        while block.kind != .done {
            if block.kind == .leases {
                leases = try Self.readLeases(try input.payload(), input, at: block.at)
                block = try input.next()
                continue
            }
            guard block.kind == .repository else { throw input.malformed(block.at, "a \(block.kind.name) block outside a repository") }
            var fields = PayloadReader(try input.payload())
            guard let name = fields.text(lengthBytes: 2), let epoch = fields.text(lengthBytes: 1), let revision = fields.u64() else {
                throw input.malformed(block.at, "a REPO block cut short")
            }
            // Its history, then its entries, with what the log changed.
            var old: [(revision: UInt64, weight: Int, body: [UInt8])] = []
            block = try input.next()
            while block.kind == .history {
                var reader = PayloadReader(try input.payload())
                while !reader.atEnd {
                    guard let (stored, body) = StoredRevision.read(&reader) else { throw input.malformed(block.at, "a history revision cut short") }
                    if limit > 0 { old.append((stored.revision, stored.weight, Array(body))) }
                }
                block = try input.next()
            }
            let i = byName[name]
            try writer.beginRepository(name: name, epoch: epoch, revision: max(revision, i.map { changes[$0].revision } ?? 0))
            try writeHistory(old: old, new: i.map { changes[$0] }, writer)
            while block.kind == .entries {
                let payload = try input.payload()
                var offset = 0
                while offset < payload.count {
                    let (record, size): (FlatRecord?, Int)
                    do throws(FlatRecordCodec.Malformed) { (record, size) = try FlatRecordCodec.readChecked(payload, at: offset) } catch {
                        throw input.malformed(block.at, "\(error.reason) at byte \(error.offset) of its entries")
                    }
                    if let record, !(i.map { changes[$0].table.contains(key: record.keyBytes) } ?? false) {
                        try writer.entry(record.encoded)
                    }
                    offset += size
                }
                block = try input.next()
            }
            if let i {
                try writeEntries(changes[i].table, writer)
                changes[i].written = true
            }
            var attachments: [Key: UInt64] = [:]
            while block.kind == .attachments {
                try Self.readAttachments(try input.payload(), into: &attachments, input, at: block.at)
                block = try input.next()
            }
            if let i { attachments = changes[i].attachments(after: attachments) }
            try writer.attachments(attachments)
            referenced.formUnion(attachments.values)
            var tombstones: [Int] = []
            while block.kind == .tombstones {
                guard version >= SnapshotFormat.tombstonesSince else { throw input.malformed(block.at, "tombstones in a snapshot of version \(version)") }
                tombstones.append(block.at)
                block = try input.next()
            }
            // An older snapshot's repository: no deletion at or below its revision is known.
            try writeTombstones(old: tombstones, floor: revision, new: i.map { changes[$0] }, input, writer)
        }
        _ = try input.payload()
        for repository in changes where !repository.written {
            try writer.beginRepository(name: repository.name, epoch: repository.epoch, revision: repository.revision)
            try writeHistory(old: [], new: repository, writer)
            try writeEntries(repository.table, writer)
            let attachments = repository.attachments(after: [:])
            try writer.attachments(attachments)
            referenced.formUnion(attachments.values)
            // The log holds it from its first revision: every deletion is known.
            try writeTombstones(old: [], floor: 0, new: repository, input, writer)
        }
        for frame in leaseFrames {
            switch frame {
            case .leaseGranted(let lease): leases.granted(lease)
            case .leaseEnded(let id, let reason, let owner): leases.ended(id, reason, owner: owner)
            default: break
            }
        }
        leases.forgetEnded(except: referenced)
        try writer.leases(leases)
        Failpoints.hit("checkpoint.commit")  // test-only (Failpoints.swift)
        try writer.commit()
        return try SnapshotLoader.fileSize(writer.path)
    }

    /// Writes a repository's history: the old snapshot's and the log's newest, contiguous,
    /// within the limits (the newest revision stays whatever its size).
    private func writeHistory(old: [(revision: UInt64, weight: Int, body: [UInt8])], new: Changes?, _ writer: SnapshotWriter) throws(StorageError) {
        guard options.historyLimit > 0 else { return }
        var count = new?.count ?? 0
        var weight = new?.weight ?? 0
        var start = old.count
        let contiguous = new?.firstRevision.map { first in old.last.map { $0.revision + 1 == first } ?? true } ?? true
        if contiguous {
            while start > 0, count < options.historyLimit, count == 0 || weight + old[start - 1].weight <= options.historyMaxBytes,
                start == old.count || old[start - 1].revision + 1 == old[start].revision
            {
                start -= 1
                count += 1
                weight += old[start].weight
            }
        }
        for revision in old[start...] { try revision.body.withUnsafeBytes { raw in Result { () throws(StorageError) in try writer.history(body: raw) } }.get() }
        try new?.forEachRetained { (body) throws(StorageError) in try writer.history(body: body) }
    }

    /// Writes a repository's tombstones: those of the old snapshot (its TOMB blocks at `old`;
    /// none: no deletion at or below `floor` known) but for the keys the log changed since,
    /// then the log's deletions, oldest first, at most `tombstoneLimit` — the oldest beyond
    /// it forgotten, the floor raised to the newest of them. The old blocks are read twice,
    /// once to count what stays and once to copy it, rather than held in memory.
    private func writeTombstones(old: [Int], floor: UInt64, new: Changes?, _ input: SnapshotInput, _ writer: SnapshotWriter) throws(StorageError) {
        var floor = floor
        var kept = 0
        if let first = old.first {
            var reader = PayloadReader(try input.payload(again: first))
            guard let stored = reader.u64() else { throw input.malformed(first, "a TOMB block cut short") }
            floor = stored
            for at in old {
                try Self.forEachTombstone(in: try input.payload(again: at), input, at: at) { key, _ in
                    if new?.table.contains(key: key) != true { kept += 1 }
                }
            }
        }
        // The log's: each deleted key's last deletion (a key written since is no tombstone).
        var deleted: [(key: [UInt8], revision: UInt64)] = []
        new?.table.forEach { record in
            if record.isDeletion { deleted.append((Array(record.keyBytes), record.revision)) }
        }
        deleted.sort { $0.revision < $1.revision || ($0.revision == $1.revision && $0.key.lexicographicallyPrecedes($1.key)) }
        // The oldest `forgotten` go; written from the first kept on, once the floor is known.
        var forgotten = max(0, kept + deleted.count - options.tombstoneLimit)
        var begun = false
        func keep(_ key: UnsafeRawBufferPointer, _ revision: UInt64) throws(StorageError) {
            if forgotten > 0 {
                forgotten -= 1
                floor = max(floor, revision)
                return
            }
            if !begun {
                try writer.beginTombstones(floor: floor)
                begun = true
            }
            try writer.tombstone(key: key, revision: revision)
        }
        if kept > 0 {
            for at in old {
                try Self.forEachTombstone(in: try input.payload(again: at), input, at: at) { (key, revision) throws(StorageError) in
                    if new?.table.contains(key: key) != true { try keep(key, revision) }
                }
            }
        }
        for (key, revision) in deleted {
            try key.withUnsafeBytes { raw in Result { () throws(StorageError) in try keep(raw, revision) } }.get()
        }
        if !begun { try writer.beginTombstones(floor: floor) }
        try writer.endTombstones()
    }

    /// Calls `body` with each tombstone of an old snapshot's TOMB block.
    private static func forEachTombstone(
        in payload: UnsafeRawBufferPointer, _ input: SnapshotInput, at: Int, _ body: (UnsafeRawBufferPointer, UInt64) throws(StorageError) -> Void
    ) throws(StorageError) {
        var reader = PayloadReader(payload)
        guard reader.u64() != nil, let count = reader.u32() else { throw input.malformed(at, "a TOMB block cut short") }
        for _ in 0..<count {
            guard let length = reader.u16(), let key = reader.take(Int(length)), let revision = reader.u64() else {
                throw input.malformed(at, "a tombstone that does not decode")
            }
            try body(key, revision)
        }
    }

    /// The leases an old snapshot's LEAS block holds.
    private static func readLeases(_ payload: UnsafeRawBufferPointer, _ input: SnapshotInput, at: Int) throws(StorageError) -> PersistedLeases {
        var reader = PayloadReader(payload)
        guard let next = reader.u64(), let count = reader.u32() else { throw input.malformed(at, "a LEAS block cut short") }
        var leases = PersistedLeases(nextID: max(1, next))
        for _ in 0..<count {
            guard let id = reader.u64(), let uid = reader.u32(), let gid = reader.u32(), let pid = reader.u32(), let ttl = reader.u64(), let ended = reader.u8()
            else { throw input.malformed(at, "a lease that does not decode") }
            let owner = Writer(uid: uid, gid: gid, pid: Int32(bitPattern: pid))
            if ended == 0 {
                leases.live[id] = PersistedLeases.Lease(id: id, owner: owner, ttl: ttl == 0 ? nil : Int64(bitPattern: ttl))
            } else if let reason = LeaseJournalRecord.reason(ended) {
                leases.ended[id] = PersistedLeases.Ended(reason: reason, owner: owner)
            } else {
                throw input.malformed(at, "a lease that ended for no known reason")
            }
        }
        return leases
    }

    /// Adds an old snapshot's ATTA block to `attachments`.
    private static func readAttachments(_ payload: UnsafeRawBufferPointer, into attachments: inout [Key: UInt64], _ input: SnapshotInput, at: Int)
        throws(StorageError)
    {
        var reader = PayloadReader(payload)
        guard let count = reader.u32() else { throw input.malformed(at, "an ATTA block cut short") }
        for _ in 0..<count {
            guard let key = reader.text(lengthBytes: 2), let lease = reader.u64() else { throw input.malformed(at, "an attachment that does not decode") }
            attachments[Key(key)] = lease
        }
    }

    private func writeEntries(_ table: FlatTable, _ writer: SnapshotWriter) throws(StorageError) {
        try table.forEach { (record) throws(StorageError) in
            if !record.isDeletion { try writer.entry(record.encoded) }
        }
    }
}
