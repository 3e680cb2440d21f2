// ObsStore — start-up's replay of the write-ahead log on top of the compacted state (the
// snapshot): each record read where the log holds it, its changes written straight into its
// repository's flat table and its history kept as a snapshot keeps it (one buffer, decoded
// a revision at a time when the server takes it) — no object per value, so a replay of a
// million changes does not leave the allocator holding them.

import ObsValues
import ObservableKit

/// Revisions read back from the log at start-up, applied on top of the compacted state.
struct Recovery {
    private struct Builder {
        let name: String
        let epoch: String
        var state: FlatTable
        var history: LoadedHistory
        /// The weight appended to `history` since it was last trimmed, and kept then.
        var weight = 0
    }

    private var builders: [Builder]
    private var byName: [String: Int] = [:]
    /// The repository of the last record (records come in runs of one repository).
    private var last: (name: [UInt8], index: Int)? = nil
    private let renewEpochs: Bool
    private let options: DiskStorage.Options

    init(repositories: [LoadedRepository], renewEpochs: Bool, options: DiskStorage.Options) {
        self.builders = repositories.map { Builder(name: $0.name, epoch: $0.epoch, state: $0.state, history: $0.history) }
        self.renewEpochs = renewEpochs
        self.options = options
        for (i, repo) in repositories.enumerated() { byName[repo.name] = i }
    }

    /// The repositories with every replayed revision applied, their history within the limits.
    var repositories: [LoadedRepository] {
        builders.map { b in
            var history = b.history
            history.retain(limit: options.historyLimit, maxBytes: options.historyMaxBytes)
            return LoadedRepository(name: b.name, epoch: b.epoch, state: b.state, history: history)
        }
    }

    mutating func apply(_ payload: UnsafeRawBufferPointer, at position: UInt64, log: String) throws(StorageError) {
        let record: LogRecord.View
        do throws(LogRecord.Malformed) { record = try LogRecord.View(payload) } catch {
            throw malformed(log, position)
        }
        let index: Int
        if let last, record.repo.elementsEqual(last.name) {
            index = last.index
        } else {
            guard let name = String(validating: record.repo, as: UTF8.self) else { throw malformed(log, position) }
            if let i = byName[name] {
                index = i
            } else {
                let epoch = renewEpochs ? Epoch.random() : String(decoding: record.epoch, as: UTF8.self)
                builders.append(Builder(name: name, epoch: epoch, state: FlatTable(), history: LoadedHistory(repo: name)))
                index = builders.count - 1
                byName[name] = index
            }
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
                    builders[index].state.set(key: key, value: new.bytes, isPlain: new.plain, revision: record.revision)
                } else {
                    builders[index].state.remove(key: key)
                }
            }
        } catch {
            throw malformed(log, position)
        }
        builders[index].state.revision = record.revision
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

    private func malformed(_ log: String, _ position: UInt64) -> StorageError {
        StorageError(.corrupt, "\(log): a record before position \(position) has a valid checksum but no meaning to this obsd; refusing to start")
    }
}
