// ObsStore — the committer thread: group commit into the write-ahead log.
//
// It takes every revision queued since its last group, encodes them (LogRecord), writes
// the group with one `pwrite` and — under `sync = always` — one `fdatasync`, then tells
// each repository how far it is durable and the checkpointer how far the log is written.
// Under `sync = relaxed` it tells them after the write and syncs at most every interval.
//
// A group that fails (a full disk, an I/O error) is undone in the log — cut off, or voided
// when the cut fails (WriteAheadLog.swift) — so that no replay can find it, and only then
// is each of its repositories told its revisions failed. Until a repository has undone
// them — it says so with `discard` — its later revisions, built on the failed ones, are
// dropped here unwritten. If the log can be neither cut nor voided, the group may still be
// replayed by a restart: its writes are answered "outcome unknown" (`.outcomeUnknown`),
// never "undone", and the committer stops taking writes — every later one fails, unwritten,
// naming the cause — until obsd restarts and replays the log.

import Logging
import ObservableKit

#if canImport(Glibc)
import Glibc
#endif

/// The queue of revisions for the committer, with the repositories whose revisions are
/// dropped until they have undone a failure.
final class CommitQueue: Sendable {
    private struct State: Sendable {
        var items: [DiskStorage.Queued] = []
        var poisoned: Set<ObjectIdentifier> = []
        var closed = false
    }

    private let state = Locked(State())
    private let signal = BlockingQueue<Bool>()

    /// Queues a revision; `false` once closed.
    func append(_ item: DiskStorage.Queued) -> Bool {
        let accepted = state.withLock { s -> Bool in
            guard !s.closed else { return false }
            s.items.append(item)
            return true
        }
        if accepted { signal.append(true) }
        return accepted
    }

    /// Takes everything queued, waiting up to `timeout`; drops the revisions of poisoned
    /// repositories. `nil` once closed and drained.
    func takeAll(timeout: Duration) -> [DiskStorage.Queued]? {
        if signal.takeAll(timeout: timeout) == nil {
            // Closed: whatever is still queued goes out, then nil.
            let rest = state.withLock { s -> [DiskStorage.Queued] in
                defer { s.items = [] }
                return s.items.filter { !s.poisoned.contains(ObjectIdentifier($0.listener)) }
            }
            return rest.isEmpty ? nil : rest
        }
        return state.withLock { s in
            defer { s.items = [] }
            return s.items.filter { !s.poisoned.contains(ObjectIdentifier($0.listener)) }
        }
    }

    /// Drops the repository's revisions from now until it calls `discard`.
    func poison(_ listener: any DurabilityListener) {
        state.withLock { _ = $0.poisoned.insert(ObjectIdentifier(listener)) }
    }

    func isPoisoned(_ listener: any DurabilityListener) -> Bool {
        state.withLock { $0.poisoned.contains(ObjectIdentifier(listener)) }
    }

    /// The repository undid everything after `revision`: its queued revisions above it
    /// go, and its later revisions are taken again.
    func discard(_ listener: any DurabilityListener, after revision: UInt64) {
        state.withLock { s in
            s.items.removeAll { $0.listener === listener && $0.record.revision > revision }
            s.poisoned.remove(ObjectIdentifier(listener))
        }
    }

    func close() {
        state.withLock { $0.closed = true }
        signal.close()
    }
}

struct Committer {
    let log: WriteAheadLog
    let sync: SyncPolicy
    let counters: StorageCounters
    let logger: Logger
    /// Set when a failed group could not be undone in the log: no write is taken after it.
    private var broken: StorageError? = nil

    init(log: WriteAheadLog, sync: SyncPolicy, counters: StorageCounters, logger: Logger) {
        self.log = log
        self.sync = sync
        self.counters = counters
        self.logger = logger
    }

    mutating func run(_ queue: CommitQueue, progress: LogProgress) {
        var interval: Duration? = nil
        if case .relaxed(let i) = sync { interval = i }
        var unsynced = false
        var lastSync = ContinuousClock.now
        while let batch = queue.takeAll(timeout: interval ?? .seconds(1)) {
            if !batch.isEmpty {
                if commit(batch, queue: queue, progress: progress) { unsynced = interval != nil }
            }
            if let interval, unsynced, ContinuousClock.now - lastSync >= interval {
                unsynced = !syncRelaxed()  // a failed sync is retried at the next interval
                lastSync = .now
            }
        }
        if unsynced { _ = syncRelaxed() }
        progress.close()
    }

    /// Writes one group; whether it reached the log.
    private mutating func commit(_ batch: [DiskStorage.Queued], queue: CommitQueue, progress: LogProgress) -> Bool {
        if let broken {
            fail(batch, broken, queue: queue)
            return false
        }
        var group: [UInt8] = []
        var payload: [UInt8] = []
        for item in batch {
            payload.removeAll(keepingCapacity: true)
            LogRecord.encode(item.record, epoch: item.listener.epoch, into: &payload)
            payload.withUnsafeBytes { WriteAheadLog.frame($0, into: &group) }
        }
        do throws(StorageError) {
            _ = try log.append(group)
            if sync == .always {
                try log.sync()
                counters.fsyncs.add(1, ordering: .relaxed)
            }
        } catch {
            counters.failures.add(1, ordering: .relaxed)
            undo(batch, after: error, queue: queue)
            return false
        }
        counters.commits.add(1, ordering: .relaxed)
        counters.records.add(batch.count, ordering: .relaxed)
        progress.advance(to: log.position)
        for (listener, revision) in Self.lastRevisions(batch) { listener.durable(through: revision) }
        return true
    }

    /// Undoes a group that failed with `error` in the log, then tells its repositories:
    /// undone — or, when the log could not be made to forget it, that its outcome is unknown.
    private mutating func undo(_ batch: [DiskStorage.Queued], after error: StorageError, queue: CommitQueue) {
        let how: WriteAheadLog.Undo
        do throws(StorageError) {
            how = try log.undoFailedGroup()
        } catch let undo {
            let unknown = StorageError(
                .outcomeUnknown,
                "\(error.description); and the write-ahead log could neither cut this write off nor void it (\(undo.description)): its outcome is unknown — it is not applied now, and may be applied after a restart; obsd takes no more writes until it restarts"
            )
            broken = StorageError(
                error.kind,
                "obsd takes no more writes until it restarts: an earlier failed write could not be undone in the write-ahead log (\(error.description); \(undo.description)); this write was not stored")
            logger.critical(
                "write-ahead log unusable: a failed group could be neither cut off nor voided, so a restart may replay it; its writes are answered outcome unknown and every later write fails until obsd restarts",
                metadata: ["error": "\(unknown.description)", "writes": "\(batch.count)"])
            fail(batch, unknown, queue: queue)
            return
        }
        var metadata: Logger.Metadata = ["error": "\(error.description)", "writes": "\(batch.count)"]
        if case .voided(let cutFailure) = how {
            metadata["undo"] = "voided (its first frame header zeroed; the log goes on in a new segment) because the cut failed: \(cutFailure.description)"
        }
        logger.error("a group commit failed; its writes were undone and their clients told", metadata: metadata)
        fail(batch, error, queue: queue)
    }

    /// Reports a group's revisions failed, each repository from its first one in the group.
    private func fail(_ batch: [DiskStorage.Queued], _ error: StorageError, queue: CommitQueue) {
        var told = Set<ObjectIdentifier>()
        for item in batch where told.insert(ObjectIdentifier(item.listener)).inserted {
            queue.poison(item.listener)
            item.listener.failed(after: item.record.revision - 1, error: error)
        }
    }

    /// Syncs the log under `sync = relaxed`; whether it worked.
    private func syncRelaxed() -> Bool {
        do throws(StorageError) {
            try log.sync()
            counters.fsyncs.add(1, ordering: .relaxed)
            return true
        } catch {
            // Acknowledged writes may not survive a power loss now: say so loudly, keep trying.
            counters.failures.add(1, ordering: .relaxed)
            logger.error(
                "sync = relaxed: cannot sync the write-ahead log; writes acknowledged since the last sync are not yet safe from a power loss; retrying",
                metadata: ["error": "\(error.description)"])
            return false
        }
    }

    /// The highest revision per repository in a batch, in order of first appearance.
    static func lastRevisions(_ batch: [DiskStorage.Queued]) -> [(any DurabilityListener, UInt64)] {
        var order: [ObjectIdentifier] = []
        var latest: [ObjectIdentifier: (any DurabilityListener, UInt64)] = [:]
        for item in batch {
            let id = ObjectIdentifier(item.listener)
            if latest[id] == nil { order.append(id) }
            latest[id] = (item.listener, max(latest[id]?.1 ?? 0, item.record.revision))
        }
        return order.map { latest[$0]! }
    }
}
