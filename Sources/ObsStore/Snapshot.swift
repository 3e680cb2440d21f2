// ObsStore — writing a snapshot (SnapshotFile.swift has the format) and loading one at
// start-up: its entry blocks read straight into the slabs of each repository's flat table,
// then indexed; its history decoded into records; its attachments and tombstones (within
// the configured bound) into each repository's, its leases into the lease table.

import ObsValues
import ObservableKit
import SystemPackage

/// Writes a whole snapshot beside the current one, then puts it in its place (`commit`).
/// Per repository: `beginRepository`, its history oldest first, then its entries, its
/// attachments, its tombstones (`beginTombstones`, each `tombstone` oldest first,
/// `endTombstones`).
final class SnapshotWriter {
    let directory: String
    private let output: SnapshotOutput
    private var entries: [UInt8] = []
    private var history: [UInt8] = []
    /// The repository's tombstones being written: its floor, the entries of the block not yet
    /// written and how many, and whether a block was.
    private var tombstones: (floor: UInt64, block: [UInt8], count: UInt32, written: Bool)? = nil
    private var repositories = 0
    private var entryCount = 0
    private var historyCount = 0
    private var committed = false

    var path: String { directory + "/" + SnapshotFormat.fileName }

    /// Starts `obsd.snapshot.new` in `directory`, covering the log through `position`.
    init(directory: String, covering position: UInt64) throws(StorageError) {
        self.directory = directory
        output = try SnapshotOutput(path: directory + "/" + SnapshotFormat.partialName)
        var head = PayloadWriter()
        head.u32(SnapshotFormat.version)
        head.u64(position)
        head.text(try output.identity(), lengthBytes: 2)
        head.u64(UInt64(bitPattern: WallClock.unixSeconds()))
        try output.block(.head, head.bytes)
        entries.reserveCapacity(SnapshotFormat.blockSize)
    }

    deinit { if !committed { try? FilePath(output.path).remove() } }

    func beginRepository(name: String, epoch: String, revision: UInt64) throws(StorageError) {
        try flush()
        var repo = PayloadWriter()
        repo.text(name, lengthBytes: 2)
        repo.text(epoch, lengthBytes: 1)
        repo.u64(revision)
        try output.block(.repository, repo.bytes)
        repositories += 1
    }

    /// Appends a history revision (before the repository's entries).
    func history(_ record: RevisionRecord) throws(StorageError) {
        var body: [UInt8] = []
        body.reserveCapacity(record.byteSize + 64)
        StoredRevision.appendHead(revision: record.revision, time: record.time, weight: record.byteSize, writer: record.writer, leaseEnd: record.leaseEnd, to: &body)
        LogRecord.encode(record.changes, into: &body)
        try body.withUnsafeBytes { raw in Result { () throws(StorageError) in try history(body: raw) } }.get()
    }

    /// Appends a history revision as another snapshot holds it (without its length).
    func history(body: UnsafeRawBufferPointer) throws(StorageError) {
        Self.append(UInt32(body.count), &history)
        history.append(contentsOf: body)
        historyCount += 1
        if history.count >= SnapshotFormat.blockSize { try flushHistory() }
    }

    /// Writes the repository's attachments (after its entries).
    func attachments(_ attachments: [Key: UInt64]) throws(StorageError) {
        try flush()
        var block: [UInt8] = []
        var count: UInt32 = 0
        func emit() throws(StorageError) {
            guard count > 0 else { return }
            var payload: [UInt8] = []
            Self.append(count, &payload)
            payload.append(contentsOf: block)
            try output.block(.attachments, payload)
            block.removeAll(keepingCapacity: true)
            count = 0
        }
        for (key, lease) in attachments {
            key.withUTF8 { utf8 in
                Self.append(UInt16(truncatingIfNeeded: utf8.count), &block)
                block.append(contentsOf: utf8)
            }
            Self.append(lease, &block)
            count += 1
            if block.count >= SnapshotFormat.blockSize { try emit() }
        }
        try emit()
    }

    /// Begins the repository's tombstones (after its attachments): every deletion above
    /// `floor` it remembers follows, oldest first.
    func beginTombstones(floor: UInt64) throws(StorageError) {
        try flush()
        tombstones = (floor, [], 0, false)
    }

    /// Appends a tombstone: the key whose bytes are `key` was last deleted at `revision` (not
    /// before the one appended last). One at or below the floor says nothing and is left out.
    func tombstone(key: UnsafeRawBufferPointer, revision: UInt64) throws(StorageError) {
        guard tombstones != nil, revision > tombstones!.floor else { return }
        Self.append(UInt16(truncatingIfNeeded: key.count), &tombstones!.block)
        tombstones!.block.append(contentsOf: key)
        Self.append(revision, &tombstones!.block)
        tombstones!.count += 1
        if tombstones!.block.count >= SnapshotFormat.blockSize { try emitTombstones() }
    }

    /// Ends the repository's tombstones: at least one TOMB block, so the floor is stored
    /// even when no deletion is.
    func endTombstones() throws(StorageError) {
        guard let pending = tombstones else { return }
        if pending.count > 0 || !pending.written { try emitTombstones() }
        tombstones = nil
    }

    /// Writes the repository's tombstones (after its attachments): `begin`, each, `end`.
    func tombstones(_ tombstones: Tombstones) throws(StorageError) {
        try beginTombstones(floor: tombstones.floor)
        for (key, revision) in tombstones.entries {
            try key.withUTF8 { utf8 in Result { () throws(StorageError) in try tombstone(key: UnsafeRawBufferPointer(utf8), revision: revision) } }.get()
        }
        try endTombstones()
    }

    private func emitTombstones() throws(StorageError) {
        guard let pending = tombstones else { return }
        var payload: [UInt8] = []
        payload.reserveCapacity(12 + pending.block.count)
        Self.append(pending.floor, &payload)
        Self.append(pending.count, &payload)
        payload.append(contentsOf: pending.block)
        try output.block(.tombstones, payload)
        tombstones!.block.removeAll(keepingCapacity: true)
        tombstones!.count = 0
        tombstones!.written = true
    }

    /// Writes the leases (after every repository): the live ones, and those ended that a
    /// key is still attached to.
    func leases(_ leases: PersistedLeases) throws(StorageError) {
        try flush()
        var payload: [UInt8] = []
        Self.append(leases.nextID, &payload)
        Self.append(UInt32(leases.live.count + leases.ended.count), &payload)
        func lease(_ id: UInt64, _ owner: Writer, ttl: Int64?, ended: LeaseEnd.Reason?) {
            Self.append(id, &payload)
            Self.append(owner.uid, &payload)
            Self.append(owner.gid, &payload)
            Self.append(UInt32(bitPattern: owner.pid), &payload)
            Self.append(UInt64(bitPattern: ttl ?? 0), &payload)
            payload.append(ended.map(LeaseJournalRecord.code) ?? 0)
        }
        for (id, live) in leases.live.sorted(by: { $0.key < $1.key }) { lease(id, live.owner, ttl: live.ttl, ended: nil) }
        for (id, ended) in leases.ended.sorted(by: { $0.key < $1.key }) { lease(id, ended.owner, ttl: nil, ended: ended.reason) }
        try output.block(.leases, payload)
    }

    /// Appends an entry (a record as `FlatRecord` encodes it).
    func entry(_ encoded: UnsafeRawBufferPointer) throws(StorageError) {
        try flushHistory()
        if entries.count + encoded.count > SnapshotFormat.blockSize { try flushEntries() }
        if encoded.count > SnapshotFormat.blockSize {
            try output.block(.entries, encoded)  // a record larger than a slab: a block, and a slab, of its own
        } else {
            entries.append(contentsOf: encoded)
        }
        entryCount += 1
    }

    /// Ends the snapshot, makes it durable and puts it in place of the current one.
    func commit() throws(StorageError) {
        try flush()
        var done = PayloadWriter()
        done.u32(UInt32(clamping: repositories))
        done.u64(UInt64(entryCount))
        done.u64(UInt64(historyCount))
        try output.block(.done, done.bytes)
        try output.sync()
        try attempt("cannot rename \(output.path) to \(path)") { () throws(Errno) in try FilePath(output.path).rename(to: FilePath(path)) }
        committed = true
        try DataDirectory.sync(directory)
    }

    private func flush() throws(StorageError) {
        try flushHistory()
        try flushEntries()
    }

    private func flushHistory() throws(StorageError) {
        guard !history.isEmpty else { return }
        try output.block(.history, history)
        history.removeAll(keepingCapacity: true)
    }

    private func flushEntries() throws(StorageError) {
        guard !entries.isEmpty else { return }
        try output.block(.entries, entries)
        entries.removeAll(keepingCapacity: true)
    }

    static func append<I: FixedWidthInteger>(_ value: I, _ out: inout [UInt8]) {
        withUnsafeBytes(of: value.littleEndian) { out.append(contentsOf: $0) }
    }
}

/// One history revision as a snapshot holds it (after its length): the fixed fields read,
/// the changes still encoded.
struct StoredRevision {
    let revision: UInt64
    let time: Int64
    let weight: Int
    let writer: Writer?
    let leaseEnd: LeaseEnd?
    let changes: UnsafeRawBufferPointer

    /// Reads the revision at the reader's position (`u32 length` then the body); `body` is
    /// all of it after its length.
    static func read(_ reader: inout PayloadReader) -> (revision: StoredRevision, body: UnsafeRawBufferPointer)? {
        guard let length = reader.u32(), let body = reader.take(Int(length)) else { return nil }
        var fields = PayloadReader(body)
        return Self.fields(&fields).map { ($0, body) }
    }

    /// Reads a body (what follows the length) that `reader` holds whole.
    static func fields(_ reader: inout PayloadReader) -> StoredRevision? {
        guard let revision = reader.u64(), let time = reader.u64(), let weight = reader.u32(), let flags = reader.u8(), flags & ~3 == 0 else { return nil }
        var writer: Writer? = nil
        if flags & 1 != 0 {
            guard let uid = reader.u32(), let gid = reader.u32(), let pid = reader.u32() else { return nil }
            writer = Writer(uid: uid, gid: gid, pid: Int32(bitPattern: pid))
        }
        var leaseEnd: LeaseEnd? = nil
        if flags & 2 != 0 {
            guard let lease = reader.u64(), let reason = reader.u8().flatMap(LeaseJournalRecord.reason) else { return nil }
            leaseEnd = LeaseEnd(lease: lease, reason: reason)
        }
        guard let changes = reader.take(reader.bytes.count - reader.offset) else { return nil }
        return StoredRevision(revision: revision, time: Int64(bitPattern: time), weight: Int(weight), writer: writer, leaseEnd: leaseEnd, changes: changes)
    }

    /// Appends the body (what follows the length) of `record`, read from the log, weighing `weight`.
    static func appendBody(of record: LogRecord.View, weight: Int, to out: inout [UInt8]) {
        appendHead(revision: record.revision, time: record.time, weight: weight, writer: record.writer, leaseEnd: record.leaseEnd, to: &out)
        out.append(contentsOf: record.changes)
    }

    /// Appends a body's fields before its changes.
    static func appendHead(revision: UInt64, time: Int64, weight: Int, writer: Writer?, leaseEnd: LeaseEnd?, to out: inout [UInt8]) {
        SnapshotWriter.append(revision, &out)
        SnapshotWriter.append(UInt64(bitPattern: time), &out)
        SnapshotWriter.append(UInt32(clamping: weight), &out)
        LogRecord.appendWriterAndLeaseEnd(writer, leaseEnd, to: &out)
    }

    func record(repo: String) -> RevisionRecord? {
        guard let changes = try? LogRecord.decodeChanges(changes) else { return nil }
        return RevisionRecord(repo: repo, changeSet: ChangeSet(revision: revision, changes: changes), time: time, writer: writer, leaseEnd: leaseEnd)
    }
}

/// What a snapshot holds, as start-up loads it.
struct LoadedSnapshot {
    var repositories: [LoadedRepository]
    var leases: PersistedLeases
    /// The log position it covers.
    let covered: UInt64
    /// The identity it recorded for itself, and the one the file has.
    let recordedIdentity: String
    let identity: String
    /// Its size in bytes.
    let size: Int
}

enum SnapshotLoader {
    /// Reads the snapshot at `path`: every block checked, entries into flat tables, the
    /// history within `options`' limits (age included).
    static func load(_ path: String, options: DiskStorage.Options) throws(StorageError) -> LoadedSnapshot {
        let input = try SnapshotInput(path: path)
        let head = try input.next()
        guard head.kind == .head else { throw input.malformed(head.at, "it begins with a \(head.kind.name) block, not HEAD") }
        var fields = PayloadReader(try input.payload())
        guard let version = fields.u32(), let covered = fields.u64(), let recorded = fields.text(lengthBytes: 2), fields.u64() != nil else {
            throw input.malformed(head.at, "a HEAD block cut short")
        }
        guard SnapshotFormat.readable.contains(version) else {
            throw StorageError(
                .corrupt,
                "\(path) is a snapshot of format version \(version); this obsd reads versions \(SnapshotFormat.readable.lowerBound) to \(SnapshotFormat.readable.upperBound)")
        }
        let identity = try Self.identity(of: path)
        let cutoff = options.historyMaxAge.map { WallClock.unixSeconds() - $0.components.seconds } ?? Int64.min
        var repositories: [LoadedRepository] = []
        var current: Reading? = nil
        var counts = (entries: 0, history: 0)
        var leases = PersistedLeases()
        var leasesRead = false

        /// Ends the repository being read, at the block at `at`.
        func finish(at: Int) throws(StorageError) {
            guard let repo = current else { return }
            current = nil
            do throws(FlatRecordCodec.Malformed) { try repo.table.buildIndex() } catch {
                throw StorageError(.corrupt, "\(path): repository \(repo.name) holds \(error.reason); refusing to start")
            }
            var history = repo.history
            history.retain(limit: options.historyLimit, maxBytes: options.historyMaxBytes, cutoff: cutoff)
            if history.last?.revision != repo.revision { history = [] }  // a history that does not reach the state serves no `since`
            let state = FlatTable(revision: repo.revision, storage: repo.table)
            if version >= SnapshotFormat.tombstonesSince {
                guard let tombstones = repo.tombstones else { throw input.malformed(at, "repository \(repo.name) ends without its TOMB block") }
                for (key, _) in tombstones.entries where state.withRecord(key, { $0 != nil }) {
                    throw StorageError(.corrupt, "\(path): repository \(repo.name) holds key \(key.string.debugDescription) and a tombstone of it; refusing to start")
                }
            }
            // A version without tombstones: the deletions before its state are not known (nil).
            repositories.append(
                LoadedRepository(
                    name: repo.name, epoch: repo.epoch, state: state, history: history, attachments: repo.attachments, tombstones: repo.tombstones))
        }

        while true {
            let block = try input.next()
            switch block.kind {
            case .head:
                throw input.malformed(block.at, "a second HEAD block")
            case .repository:
                try finish(at: block.at)
                var fields = PayloadReader(try input.payload())
                guard let name = fields.text(lengthBytes: 2), let epoch = fields.text(lengthBytes: 1), let revision = fields.u64(), fields.atEnd else {
                    throw input.malformed(block.at, "a REPO block that is not a name, an epoch and a revision")
                }
                guard Epoch.isValid(epoch) else { throw input.malformed(block.at, "repository \(name) has no valid epoch") }
                guard !leasesRead else { throw input.malformed(block.at, "a repository after the leases") }
                current = Reading(name: name, epoch: epoch, revision: revision, table: FlatTableStorage(), history: LoadedHistory(repo: name))
            case .history:
                guard current != nil, current!.table.count == 0, !current!.table.hasBlocks, current!.attachments.isEmpty, current!.tombstones == nil else {
                    throw input.malformed(block.at, "history outside a repository, or after its entries")
                }
                var reader = PayloadReader(try input.payload())
                while !reader.atEnd {
                    guard let length = reader.u32(), let body = reader.take(Int(length)),
                        options.historyLimit == 0 || current!.history.appendStored(body)
                    else {
                        throw input.malformed(block.at, "a history revision that does not decode")
                    }
                    counts.history += 1
                }
            case .entries:
                guard let table = current?.table, current!.attachments.isEmpty, current!.tombstones == nil else {
                    throw input.malformed(block.at, "entries outside a repository, or after its attachments or tombstones")
                }
                let memory = FlatMemory.allocate(block.length, populate: true)
                do {
                    try input.payload(into: memory)
                } catch {
                    FlatMemory.deallocate(memory, block.length)
                    throw error
                }
                do throws(FlatRecordCodec.Malformed) {
                    counts.entries += try table.adoptBlock(memory, blockCapacity: block.length, used: block.length)
                } catch {
                    throw input.malformed(block.at, "\(error.reason) at byte \(error.offset) of its entries")
                }
            case .attachments:
                guard version >= 2, current != nil, current!.tombstones == nil else { throw input.malformed(block.at, "attachments outside a repository, or after its tombstones") }
                var reader = PayloadReader(try input.payload())
                guard let count = reader.u32() else { throw input.malformed(block.at, "an ATTA block cut short") }
                for _ in 0..<count {
                    guard let key = reader.text(lengthBytes: 2), !key.isEmpty, let lease = reader.u64(), lease > 0 else {
                        throw input.malformed(block.at, "an attachment that does not decode")
                    }
                    current!.attachments[Key(key)] = lease
                }
                guard reader.atEnd else { throw input.malformed(block.at, "bytes after its attachments") }
            case .tombstones:
                guard version >= SnapshotFormat.tombstonesSince, current != nil else { throw input.malformed(block.at, "tombstones outside a repository") }
                var reader = PayloadReader(try input.payload())
                guard let floor = reader.u64(), let count = reader.u32() else { throw input.malformed(block.at, "a TOMB block cut short") }
                let revision = current!.revision
                if current!.tombstones == nil {
                    guard floor <= revision else { throw input.malformed(block.at, "a tombstone floor \(floor) above the repository's revision \(revision)") }
                    current!.tombstones = Tombstones(limit: options.tombstoneLimit, floor: floor)
                    current!.tombstoneFloor = floor
                } else {
                    guard floor == current!.tombstoneFloor else { throw input.malformed(block.at, "a tombstone floor other than the repository's first TOMB block's") }
                }
                for _ in 0..<count {
                    guard let key = reader.text(lengthBytes: 2), !key.isEmpty, let deleted = reader.u64() else {
                        throw input.malformed(block.at, "a tombstone that does not decode")
                    }
                    guard deleted > floor, deleted <= revision, deleted >= current!.lastTombstone else {
                        throw input.malformed(
                            block.at, "a tombstone of revision \(deleted), not above the floor \(floor), at most revision \(revision) and after the one before")
                    }
                    guard current!.tombstones![Key(key)] == nil else { throw input.malformed(block.at, "key \(key.debugDescription) deleted twice") }
                    current!.tombstones!.deleted(Key(key), at: deleted)
                    current!.lastTombstone = deleted
                }
                guard reader.atEnd else { throw input.malformed(block.at, "bytes after its tombstones") }
            case .leases:
                try finish(at: block.at)
                guard version >= 2, !leasesRead else { throw input.malformed(block.at, "a second LEAS block") }
                leasesRead = true
                var reader = PayloadReader(try input.payload())
                guard let next = reader.u64(), let count = reader.u32() else { throw input.malformed(block.at, "a LEAS block cut short") }
                leases.nextID = max(1, next)
                for _ in 0..<count {
                    guard let id = reader.u64(), id > 0, let uid = reader.u32(), let gid = reader.u32(), let pid = reader.u32(), let ttl = reader.u64(),
                        let ended = reader.u8(), Int64(bitPattern: ttl) >= 0
                    else { throw input.malformed(block.at, "a lease that does not decode") }
                    let owner = Writer(uid: uid, gid: gid, pid: Int32(bitPattern: pid))
                    if ended == 0 {
                        leases.live[id] = PersistedLeases.Lease(id: id, owner: owner, ttl: ttl == 0 ? nil : Int64(bitPattern: ttl))
                    } else {
                        guard let reason = LeaseJournalRecord.reason(ended) else { throw input.malformed(block.at, "a lease that ended for no known reason") }
                        leases.ended[id] = PersistedLeases.Ended(reason: reason, owner: owner)
                    }
                    guard id < leases.nextID else { throw input.malformed(block.at, "lease \(id) at or past the next id \(leases.nextID)") }
                }
                guard reader.atEnd else { throw input.malformed(block.at, "bytes after its leases") }
            case .done:
                try finish(at: block.at)
                var fields = PayloadReader(try input.payload())
                guard let repos = fields.u32(), let entries = fields.u64(), let history = fields.u64(), fields.atEnd else {
                    throw input.malformed(block.at, "a DONE block cut short")
                }
                guard Int(repos) == repositories.count, Int(entries) == counts.entries, Int(history) == counts.history else {
                    throw input.malformed(
                        block.at,
                        "its end counts \(repos) repositories, \(entries) entries and \(history) history revisions; the file holds \(repositories.count), \(counts.entries) and \(counts.history)"
                    )
                }
                guard input.atEnd else { throw input.malformed(block.at, "bytes after its end marker") }
                return LoadedSnapshot(
                    repositories: repositories, leases: leases, covered: covered, recordedIdentity: recorded, identity: identity, size: input.size)
            }
        }
    }

    /// A repository being read: what its blocks so far held.
    private struct Reading {
        let name: String
        let epoch: String
        let revision: UInt64
        let table: FlatTableStorage
        var history: LoadedHistory
        var attachments: [Key: UInt64] = [:]
        /// Its TOMB blocks' (none read yet: nil), their floor, and the last revision read.
        var tombstones: Tombstones? = nil
        var tombstoneFloor: UInt64 = 0
        var lastTombstone: UInt64 = 0
    }

    static func identity(of path: String) throws(StorageError) -> String {
        let fd = try FileDescriptor.opening(path)
        defer { try? fd.close() }
        return try SnapshotFormat.identity(of: fd, path: path)
    }

    /// Writes a whole snapshot of `repositories` and `leases` covering the log through `position`.
    static func write(_ repositories: [LoadedRepository], leases: PersistedLeases, covering position: UInt64, directory: String) throws(StorageError) -> Int {
        let writer = try SnapshotWriter(directory: directory, covering: position)
        var referenced = Set<UInt64>()
        for repository in repositories {
            try writer.beginRepository(name: repository.name, epoch: repository.epoch, revision: repository.state.revision)
            try repository.history.forEach(stored: writer.history(body:), replayed: writer.history(_:))
            try repository.state.forEach { (record) throws(StorageError) in try writer.entry(record.encoded) }
            try writer.attachments(repository.attachments)
            try writer.tombstones(repository.tombstones)
            referenced.formUnion(repository.attachments.values)
        }
        var leases = leases
        leases.forgetEnded(except: referenced)
        try writer.leases(leases)
        try writer.commit()
        return (try? fileSize(writer.path)) ?? 0
    }

    static func fileSize(_ path: String) throws(StorageError) -> Int {
        try attempt("cannot stat \(path)") { () throws(Errno) in try FilePath(path).size() }
    }
}
