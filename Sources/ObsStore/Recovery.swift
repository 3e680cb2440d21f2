// ObsStore — start-up's replay of the write-ahead log on top of the compacted state (the
// snapshot): each frame read where the log holds it — a revision's changes written straight
// into its repository's flat table and its history kept as a snapshot keeps it (one buffer,
// decoded a revision at a time when the server takes it), no object per value, so a replay
// of a million changes does not leave the allocator holding them; the attachments a write
// moved applied to its repository's; each deletion of a key remembered in its repository's
// tombstones (within the configured bound), each key created again forgetting its own — a
// repository the snapshot did not hold starts with none unknown, the log holding its every
// revision; leases granted and ended applied to the leases.

import ObsValues
import ObservableKit

/// Revisions read back from the log at start-up, applied on top of the compacted state.
struct Recovery {
    private struct Builder {
        let name: String
        let epoch: String
        var state: FlatTable
        var history: LoadedHistory
        var attachments: [Key: UInt64]
        var tombstones: Tombstones
        /// The weight appended to `history` since it was last trimmed, and kept then.
        var weight = 0
    }

    private var builders: [Builder]
    private var byName: [String: Int] = [:]
    /// The repository of the last record (records come in runs of one repository).
    private var last: (name: [UInt8], index: Int)? = nil
    private let renewEpochs: Bool
    private let options: DiskStorage.Options
    /// The leases, as the snapshot had them and the log moved them on.
    private(set) var leases: PersistedLeases

    init(repositories: [LoadedRepository], leases: PersistedLeases, renewEpochs: Bool, options: DiskStorage.Options) {
        self.builders = repositories.map { repository in
            var tombstones = repository.tombstones
            tombstones.setLimit(options.tombstoneLimit)
            return Builder(name: repository.name, epoch: repository.epoch, state: repository.state, history: repository.history, attachments: repository.attachments, tombstones: tombstones)
        }
        self.leases = leases
        self.renewEpochs = renewEpochs
        self.options = options
        for (i, repo) in repositories.enumerated() { byName[repo.name] = i }
    }

    /// The repositories with every replayed revision applied, their history within the limits.
    var repositories: [LoadedRepository] {
        builders.map { b in
            var history = b.history
            history.retain(limit: options.historyLimit, maxBytes: options.historyMaxBytes)
            return LoadedRepository(name: b.name, epoch: b.epoch, state: b.state, history: history, attachments: b.attachments, tombstones: b.tombstones)
        }
    }

    mutating func apply(_ payload: UnsafeRawBufferPointer, at position: UInt64, log: String) throws(StorageError) {
        let entry: LogRecord.Entry
        do throws(LogRecord.Malformed) { entry = try LogRecord.Entry(payload) } catch {
            throw malformed(log, position)
        }
        switch entry {
        case .revision(let record):
            try apply(record, at: position, log: log)
        case .attachments(let repo, _, let moves):
            // Of keys that exist, in a repository that does (an equal-value write moved them).
            if let i = self.index(of: repo) { moves.apply(to: &builders[i].attachments) }
        case .leaseGranted(let lease):
            leases.granted(lease)
        case .leaseEnded(let id, let reason, let owner):
            leases.ended(id, reason, owner: owner)
        }
    }

    /// The builder of the repository whose name is `repo`, if there is one.
    private mutating func index(of repo: UnsafeRawBufferPointer) -> Int? {
        if let last, repo.elementsEqual(last.name) { return last.index }
        guard let name = String(validating: repo, as: UTF8.self), let i = byName[name] else { return nil }
        last = (Array(repo), i)
        return i
    }

    private mutating func apply(_ record: LogRecord.View, at position: UInt64, log: String) throws(StorageError) {
        let index: Int
        if let known = self.index(of: record.repo) {
            index = known
        } else {
            guard let name = String(validating: record.repo, as: UTF8.self) else { throw malformed(log, position) }
            let epoch = renewEpochs ? Epoch.random() : String(decoding: record.epoch, as: UTF8.self)
            // Its log begins at its first revision: every deletion in it is known (floor 0).
            builders.append(
                Builder(
                    name: name, epoch: epoch, state: FlatTable(), history: LoadedHistory(repo: name), attachments: [:],
                    tombstones: Tombstones(limit: options.tombstoneLimit)))
            index = builders.count - 1
            byName[name] = index
            last = (Array(record.repo), index)
        }
        let revision = builders[index].state.revision
        guard record.revision == revision + 1 else {
            if record.revision <= revision { return }  // already in the compacted state
            throw StorageError(
                .corrupt,
                "\(log): repository \(builders[index].name) jumps from revision \(revision) to \(record.revision) (position \(position)); refusing to start")
        }
        let weight: Int
        do throws(LogRecord.Malformed) {
            // Checked whole before the table changes: a record applies entirely or not at all.
            try LogRecord.checkChanges(record.changes)
            weight = try record.forEachChange { key, _, new in
                if let new {
                    let (created, position) = builders[index].state.withRecord(key: key) { found, position in (found == nil, position) }
                    builders[index].state.set(key: key, value: new.bytes, isPlain: new.plain, revision: record.revision, at: position)
                    if created, !builders[index].tombstones.isEmpty { builders[index].tombstones.remove(Self.key(key)) }
                } else if builders[index].state.remove(key: key) {
                    builders[index].tombstones.deleted(Self.key(key), at: record.revision)
                }
            }
        } catch {
            throw malformed(log, position)
        }
        builders[index].state.revision = record.revision
        record.moves.apply(to: &builders[index].attachments)
        guard options.historyLimit > 0 else { return }
        var body: [UInt8] = []
        StoredRevision.appendBody(of: record, weight: weight, to: &body)
        _ = body.withUnsafeBytes { builders[index].history.appendStored($0) }
        builders[index].weight += weight
        // Replaying a long log keeps no more than about twice what the history retains.
        if builders[index].history.count >= 2 * options.historyLimit || builders[index].weight > 2 * options.historyMaxBytes {
            builders[index].weight = builders[index].history.retain(limit: options.historyLimit, maxBytes: options.historyMaxBytes)
        }
    }

    /// A key read from the log (its UTF-8 checked by `checkChanges`).
    private static func key(_ bytes: UnsafeRawBufferPointer) -> Key { Key(String(decoding: bytes, as: UTF8.self)) }

    private func malformed(_ log: String, _ position: UInt64) -> StorageError {
        StorageError(.corrupt, "\(log): a record before position \(position) has a valid checksum but no meaning to this obsd; refusing to start")
    }
}
