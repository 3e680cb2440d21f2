// ObsStore — group commit into the write-ahead log, from the thread that wrote.
//
// Whoever holds the log's leadership (`Committer.lead`, an atomic flag) takes every revision
// queued since its last group, encodes them (LogRecord), writes the group with one `pwrite`
// and — under `sync = always` — one `fdatasync`, then posts how far each repository's (or
// the lease table's) frames are durable (`DurabilityReports`: storage calls nobody; the
// server takes the reports and delivers them) and tells the checkpointer how far the log is
// written. The daemon's event loops call
// `DiskStorage.flush` at the end of each iteration: the loop that wrote commits its own
// writes on its own thread — no hand-over to another thread and back, as Redis writes its
// append-only file before it sleeps — and a loop that finds another committing leaves its
// revisions to that one, which takes them in its next group. The committer thread is left
// with what no loop flushes (a thread that never calls `flush`: it is woken for it), the
// periodic sync under `sync = relaxed`, and the last group when the store closes.
//
// A group that fails (a full disk, an I/O error) is undone in the log — cut off, or voided
// when the cut fails (WriteAheadLog.swift) — so that no replay can find it, and only then
// is it reported that each of its repositories' revisions failed. Until a repository has undone
// them — it says so with `discard` — its later revisions, built on the failed ones, are
// dropped here unwritten. If the log can be neither cut nor voided, the group may still be
// replayed by a restart: its writes are answered "outcome unknown" (`.outcomeUnknown`),
// never "undone", and the committer stops taking writes — every later one fails, unwritten,
// naming the cause — until obsd restarts and replays the log.

import Logging
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// What a storage learned about the frames handed to it — durable, or failed — posted by the
/// thread that learned it, in that order, for the server to take (`take`) and deliver to each
/// frame's listener. Posting calls nobody but `whenPosted`'s wake-up, and that only for a
/// report posted by a thread that does not deliver it itself (the committer thread): a thread
/// that flushes takes what it posted when its flush returns.
public final class DurabilityReports: Sendable {
    /// What became of a listener's frames.
    public enum Outcome: Sendable {
        /// Everything numbered up to `through` is durable.
        case durable(through: UInt64)
        /// Everything numbered above `after` failed (`DurabilityListener.failed`).
        case failed(after: UInt64, error: StorageError)
    }

    private struct State {
        var posted: [(listener: any DurabilityListener, outcome: Outcome)] = []
        var wake: (@Sendable () -> Void)?
    }

    private let state = Locked(State())
    /// Whether `posted` holds anything: read without the lock by deliverers that look.
    private let pending = Atomic<Bool>(false)

    public init() {}

    /// Sets who is woken (once, before anything is posted) when a report arrives that its
    /// poster will not deliver.
    public func whenPosted(_ wake: @escaping @Sendable () -> Void) {
        state.withLock { $0.wake = wake }
    }

    /// Posts `outcome` for `listener`; `wake`: the posting thread will not take it itself.
    public func post(_ listener: any DurabilityListener, _ outcome: Outcome, wake: Bool) {
        let wakeUp = state.withLock { s -> (@Sendable () -> Void)? in
            let first = s.posted.isEmpty
            s.posted.append((listener, outcome))
            pending.store(true, ordering: .releasing)
            // A report already waiting has a taker coming: the thread that posted it, or the
            // one woken for it.
            return wake && first ? s.wake : nil
        }
        wakeUp?()
    }

    /// Whether reports wait to be taken.
    public var hasReports: Bool { pending.load(ordering: .acquiring) }

    /// Takes everything posted, in the order it was posted.
    public func take() -> [(listener: any DurabilityListener, outcome: Outcome)] {
        state.withLock { s in
            pending.store(false, ordering: .releasing)
            defer { s.posted.removeAll(keepingCapacity: true) }
            return s.posted
        }
    }
}

/// The queue of frames for the committer, with the listeners whose frames are dropped until
/// they have undone a failure.
final class CommitQueue: Sendable {
    private struct State: Sendable {
        var items: [DiskStorage.Queued] = []
        /// The frames of the items, encoded as they were queued.
        var frames: [UInt8] = []
        var poisoned: Set<ObjectIdentifier> = []
        var closed = false
    }

    private let state = Locked(State())
    /// How many items are queued: read without the lock, to see whether there is work.
    private let queued = Atomic<Int>(0)
    private let signal = BlockingQueue<Bool>()

    /// Queues `frame`, encoded into the queue's buffer, waking the committer thread if
    /// `wake`; `false` once closed.
    func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener, wake: Bool) -> Bool {
        let accepted = state.withLock { s -> Bool in
            guard !s.closed else { return false }
            let start = s.frames.count
            LogRecord.appendFrame(frame, to: &s.frames)
            s.items.append(DiskStorage.Queued(frame: start..<s.frames.count, sequence: sequence, listener: listener))
            queued.wrappingAdd(1, ordering: .releasing)
            return true
        }
        if accepted && wake { signal.append(true) }
        return accepted
    }

    /// Whether revisions are queued.
    var hasItems: Bool { queued.load(ordering: .acquiring) > 0 }

    /// Takes everything queued, dropping the frames of poisoned listeners; the frames are in
    /// `frames` afterwards (whose old contents, and buffer, the queue takes for its next ones).
    func take(frames: inout [UInt8]) -> [DiskStorage.Queued] {
        state.withLock { s in
            defer {
                s.items = []
                swap(&frames, &s.frames)
                s.frames.removeAll(keepingCapacity: s.frames.capacity <= 4 << 20)
                queued.store(0, ordering: .releasing)
            }
            return s.poisoned.isEmpty ? s.items : s.items.filter { !s.poisoned.contains(ObjectIdentifier($0.listener)) }
        }
    }

    /// Waits up to `timeout` for a wake-up; `false` once closed.
    func wait(timeout: Duration) -> Bool { signal.takeAll(timeout: timeout) != nil }

    /// Drops the listener's frames from now until it calls `discard`.
    func poison(_ listener: any DurabilityListener) {
        state.withLock { _ = $0.poisoned.insert(ObjectIdentifier(listener)) }
    }

    func isPoisoned(_ listener: any DurabilityListener) -> Bool {
        state.withLock { $0.poisoned.contains(ObjectIdentifier(listener)) }
    }

    /// The listener undid everything numbered after `sequence`: its queued frames above it
    /// go, and its later frames are taken again.
    func discard(_ listener: any DurabilityListener, after sequence: UInt64) {
        state.withLock { s in
            s.items.removeAll { $0.listener === listener && $0.sequence > sequence }
            queued.store(s.items.count, ordering: .releasing)
            s.poisoned.remove(ObjectIdentifier(listener))
        }
    }

    func close() {
        state.withLock { $0.closed = true }
        signal.close()
    }
}

/// The log and what goes with writing it. Used only by the thread that holds `lead`.
final class Committer: @unchecked Sendable {
    // @unchecked Sendable: every stored property but `lead` (an atomic) is read and written
    // only between a successful `lead.compareExchange(false → true, acquiring)` and the
    // `lead.store(false, releasing)` that ends it (`withLead`), so one thread at a time uses
    // them, each seeing what the one before wrote.
    let lead = Atomic<Bool>(false)
    private let log: WriteAheadLog
    let sync: SyncPolicy
    let counters: StorageCounters
    let logger: Logger
    private let queue: CommitQueue
    private let progress: LogProgress
    /// Where each group's outcome is posted for its listeners.
    private let reports: DurabilityReports
    /// Whether the thread holding the lead wakes someone to deliver what it posts: the
    /// committer thread does; a loop that flushes delivers it itself when its flush returns.
    private var wakes = false
    /// Set when a failed group could not be undone in the log: no write is taken after it.
    private var broken: StorageError? = nil
    /// Under `sync = relaxed`: groups written since the last sync, and when that was.
    private var unsynced = false
    private var lastSync = ContinuousClock.now
    /// The group being written (reused: a steady stream of groups allocates nothing here).
    private var group: [UInt8] = []
    /// The frames of the batch being written.
    private var frames: [UInt8] = []

    init(
        log: WriteAheadLog, sync: SyncPolicy, queue: CommitQueue, progress: LogProgress, reports: DurabilityReports, counters: StorageCounters, logger: Logger
    ) {
        self.log = log
        self.sync = sync
        self.queue = queue
        self.progress = progress
        self.reports = reports
        self.counters = counters
        self.logger = logger
    }

    /// Runs `body` holding the lead, if no other thread holds it; whether it ran. `wakes`:
    /// what it posts wakes a deliverer (this thread does not deliver it).
    @discardableResult
    private func withLead(wakes: Bool, _ body: () -> Void) -> Bool {
        guard lead.compareExchange(expected: false, desired: true, successOrdering: .acquiring, failureOrdering: .relaxed).exchanged else {
            return false
        }
        self.wakes = wakes
        body()
        lead.store(false, ordering: .releasing)
        return true
    }

    /// Commits what is queued, in groups, unless another thread is committing (it takes
    /// what is queued in its next group). Checks again after giving the lead back, so a
    /// revision queued just as it was given back is not left behind. `wakes`: see `withLead`.
    func drain(wakes: Bool) {
        while queue.hasItems {
            let ran = withLead(wakes: wakes) { commitQueued() }
            if !ran { return }
        }
    }

    /// The committer thread: what no loop flushed, the periodic sync under `sync =
    /// relaxed`, and, once the queue closes, the rest.
    func run() {
        var interval: Duration? = nil
        if case .relaxed(let i) = sync { interval = i }
        while queue.wait(timeout: interval ?? .seconds(1)) {
            if let interval {
                withLead(wakes: true) {
                    if unsynced, ContinuousClock.now - lastSync >= interval {
                        unsynced = !syncRelaxed()  // a failed sync is retried at the next interval
                        lastSync = .now
                    }
                }
            }
            // After the sync: what a loop queued while this thread held the lead is this
            // thread's to commit (that loop's flush found the lead taken and went on).
            drain(wakes: true)
        }
        // Closed: no loop flushes any more; wait for one still committing, then the rest.
        while !withLead(wakes: true, {
            commitQueued()
            if unsynced { _ = syncRelaxed() }
        }) {
            usleep(100)
        }
        progress.close()
    }

    /// Commits what is queued, a group at a time, until nothing is (the lead held).
    private func commitQueued() {
        while true {
            let batch = queue.take(frames: &frames)
            if batch.isEmpty { break }
            if commit(batch) { unsynced = sync != .always }
        }
    }

    /// Writes one group; whether it reached the log.
    private func commit(_ batch: [DiskStorage.Queued]) -> Bool {
        if let broken {
            fail(batch, broken)
            return false
        }
        group.removeAll(keepingCapacity: group.capacity <= 4 << 20)
        WriteAheadLog.startGroup(into: &group)
        frames.withUnsafeBytes { frames in
            for item in batch { group.append(contentsOf: frames[item.frame]) }
        }
        do throws(StorageError) {
            _ = try log.append(group)
            if sync == .always {
                try log.sync()
                counters.fsyncs.add(1, ordering: .relaxed)
            }
        } catch {
            counters.failures.add(1, ordering: .relaxed)
            undo(batch, after: error)
            return false
        }
        counters.commits.add(1, ordering: .relaxed)
        counters.records.add(batch.count, ordering: .relaxed)
        progress.advance(to: log.position)
        for (listener, sequence) in Self.lastSequences(batch) { reports.post(listener, .durable(through: sequence), wake: wakes) }
        log.zeroAhead()  // once its writers are told: off the path that acknowledges
        return true
    }

    /// Undoes a group that failed with `error` in the log, then tells its repositories:
    /// undone — or, when the log could not be made to forget it, that its outcome is unknown.
    private func undo(_ batch: [DiskStorage.Queued], after error: StorageError) {
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
            fail(batch, unknown)
            return
        }
        var metadata: Logger.Metadata = ["error": "\(error.description)", "writes": "\(batch.count)"]
        if case .voided(let cutFailure) = how {
            metadata["undo"] = "voided (its first frame header zeroed; the log goes on in a new segment) because the cut failed: \(cutFailure.description)"
        }
        logger.error("a group commit failed; its writes were undone and their clients told", metadata: metadata)
        fail(batch, error)
    }

    /// Reports a group's frames failed, each listener's from its first one in the group.
    private func fail(_ batch: [DiskStorage.Queued], _ error: StorageError) {
        var told = Set<ObjectIdentifier>()
        for item in batch where told.insert(ObjectIdentifier(item.listener)).inserted {
            queue.poison(item.listener)
            reports.post(item.listener, .failed(after: item.sequence - 1, error: error), wake: wakes)
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

    /// The highest sequence per listener in a batch, in order of first appearance.
    static func lastSequences(_ batch: [DiskStorage.Queued]) -> [(any DurabilityListener, UInt64)] {
        // A group mostly holds one repository's frames, or a few: looked up in a list,
        // not hashed, until there are many.
        var latest: [(listener: any DurabilityListener, sequence: UInt64)] = []
        var index: [ObjectIdentifier: Int] = [:]
        for item in batch {
            let found: Int? =
                if latest.count <= 8 { latest.firstIndex { $0.listener === item.listener } } else { index[ObjectIdentifier(item.listener)] }
            if let i = found {
                latest[i].sequence = max(latest[i].sequence, item.sequence)
                continue
            }
            latest.append((item.listener, item.sequence))
            if latest.count == 9 {
                for (i, entry) in latest.enumerated() { index[ObjectIdentifier(entry.listener)] = i }
            } else if latest.count > 9 {
                index[ObjectIdentifier(item.listener)] = latest.count - 1
            }
        }
        return latest.map { ($0.listener, $0.sequence) }
    }
}
