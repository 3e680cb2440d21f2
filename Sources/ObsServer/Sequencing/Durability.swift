// ObsServer — which states may be shown: the bookkeeping every line of changes that storage
// makes durable shares — a repository (its revisions, and the attachments a write moved
// without one) and the lease table (its grants and ends).
//
// A change is applied in memory at once and named by a sequence number (`StateSequence`), one
// per change, never reused after an undo, so a reply computed from undone state can always be
// recognised. Storage reports, in order, how far a line's changes are durable — or that those
// after some point never will be: it posts its reports and calls nobody, and the
// `DurabilityCourier` delivers them to the lines, on an event loop. A reply that reports a
// state not yet durable waits in its outbox slot (LoopShard+Durability.swift); the loops
// holding such replies are told the news.

import ObsStore
import Synchronization

/// Delivers what storage reports (`DurabilityReports`) to the lines that handed the frames
/// over (`DurabilityListener`: the repositories, the lease table), in the order storage
/// reported it and one deliverer at a time: a loop, after its flush, delivers what it
/// reported; the committer thread's reports wake a loop to deliver them. A loop that finds
/// another delivering leaves the reports to it, which looks again before it stops.
final class DurabilityCourier: Sendable {
    private let reports: DurabilityReports?
    private let delivering = Atomic<Bool>(false)

    /// Delivers what `storage` reports; the loop `wakes` runs what its committer thread reports.
    init(_ storage: any Storage, wakes loop: IOLoop) {
        reports = storage.reports
        // Weak: the storage holds this wake-up, and the loop holds the storage (its flush).
        reports?.whenPosted { [weak self, weak loop] in
            guard let self, let loop else { return }
            loop.execute { self.deliver() }
        }
    }

    /// Delivers every report waiting, unless another thread is delivering them.
    func deliver() {
        guard let reports else { return }
        while reports.hasReports {
            guard delivering.compareExchange(expected: false, desired: true, successOrdering: .acquiring, failureOrdering: .relaxed).exchanged else {
                return
            }
            for (line, outcome) in reports.take() {
                switch outcome {
                case .durable(let sequence): line.durable(through: sequence)
                case .failed(let sequence, let error): line.failed(after: sequence, error: error)
                }
            }
            delivering.store(false, ordering: .releasing)
        }
    }
}

/// Identifies the state a reply was computed from (see the file header).
typealias StateSequence = UInt64

/// Whether the state a reply reports may be shown.
enum Durability {
    case durable
    /// The loop that asked will be told (`DurabilityNews`).
    case pending
    /// The state was undone after a storage failure.
    case failed(StorageError)
}

/// Durability news for a loop.
enum DurabilityNews: Sendable {
    /// Every state of the line up to this sequence is durable.
    case durable(any DurableLine, through: StateSequence)
    /// These states of the line were undone.
    case failed(any DurableLine, undone: ClosedRange<StateSequence>, StorageError)
}

/// A line of changes storage makes durable in order, whose states replies report.
protocol DurableLine: AnyObject, Sendable {
    /// Unique among lines for the life of the process (loops keep waiting replies by it).
    var lineID: UInt64 { get }
    /// What a storage failure's reply names ("repository ui", "the lease table").
    var subject: String { get }
    /// Whether the state `sequence` is durable.
    func isDurable(_ sequence: StateSequence) -> Bool
    /// Whether the state `sequence` may be shown; if it is not durable yet, `shard` is told
    /// once it is — or once it is undone — and holds the reply meanwhile.
    func awaitDurable(_ sequence: StateSequence, on shard: LoopShard) -> Durability
}

/// Line ids: repositories and the lease table draw from one counter.
enum LineIDs {
    private static let counter = Atomic<UInt64>(0)
    static func next() -> UInt64 { counter.add(1, ordering: .relaxed).newValue }
}

/// The part of a line's durability readable without its lock.
final class DurabilityMarks: Sendable {
    /// The sequence of the latest durable state.
    let durable = Atomic<StateSequence>(0)
    /// The highest sequence ever undone (0: none).
    let undoneCeiling = Atomic<StateSequence>(0)

    /// Whether `sequence` is known durable without the lock (nil: ask under it).
    @inline(__always)
    func knownDurable(_ sequence: StateSequence) -> Bool? {
        if durable.load(ordering: .acquiring) < sequence { return false }
        if sequence > undoneCeiling.load(ordering: .acquiring) { return true }
        return nil
    }
}

/// A line's durability bookkeeping, kept under its owner's lock.
struct DurabilityLedger: Sendable {
    /// Sequences handed out so far: one per change applied, undone ones included.
    private(set) var applied: StateSequence = 0
    /// The sequence of the current state (after an undo: the durable state's).
    private(set) var current: StateSequence = 0
    /// Sequences of pending changes, oldest first (their states become durable in order).
    private(set) var pending: [StateSequence] = []
    /// Sequences of states undone after storage failures; ascending, disjoint.
    private var undone: [ClosedRange<StateSequence>] = []
    private var lastFailure: StorageError? = nil
    /// Loops that have waited for a state of this line to be durable.
    private var waitingLoops: [LoopShard] = []

    /// The sequence the next change applied gets (storage is handed it before `apply`).
    var next: StateSequence { applied + 1 }

    /// A change was applied: names its state; `durable` if it may be shown at once.
    mutating func apply(durable: Bool, marks: DurabilityMarks) -> StateSequence {
        applied += 1
        current = applied
        if durable {
            marks.durable.store(applied, ordering: .releasing)
        } else {
            pending.append(applied)
        }
        return applied
    }

    /// How many pending changes are durable once everything through `sequence` is.
    func durableCount(through sequence: StateSequence) -> Int {
        var n = 0
        while n < pending.count, pending[n] <= sequence { n += 1 }
        return n
    }

    /// The `n` oldest pending changes are durable: tells the marks and the waiting loops.
    mutating func confirm(_ n: Int, marks: DurabilityMarks, line: any DurableLine) {
        guard n > 0 else { return }
        let durable = pending[n - 1]
        pending.removeFirst(n)
        marks.durable.store(durable, ordering: .releasing)
        for shard in waitingLoops { shard.post(.durable(line, through: durable)) }
    }

    /// Every pending change was undone (storage failed it with `error`): the state is the
    /// durable one again, and every state after it is gone — including those reported by
    /// no-op writes and reads. Tells the waiting loops.
    mutating func undoPending(_ error: StorageError, marks: DurabilityMarks, line: any DurableLine) {
        pending.removeAll()
        let durable = marks.durable.load(ordering: .relaxed)
        guard applied > durable else { return }
        let gone = (durable + 1)...applied
        if let last = undone.last, last.lowerBound == gone.lowerBound {
            undone[undone.count - 1] = gone
        } else {
            undone.append(gone)
        }
        marks.undoneCeiling.store(applied, ordering: .releasing)
        current = durable
        lastFailure = error
        // Exactly these states are gone: a loop may already hold replies of later ones
        // (written after this undo, before the loop hears of it), which stand.
        for shard in waitingLoops { shard.post(.failed(line, undone: gone, error)) }
    }

    /// Whether `sequence` was undone.
    func wasUndone(_ sequence: StateSequence) -> Bool { undone.contains { $0.contains(sequence) } }

    /// `awaitDurable` under the lock, once the marks could not tell.
    mutating func await(_ sequence: StateSequence, on shard: LoopShard, marks: DurabilityMarks) -> Durability {
        if wasUndone(sequence), let failure = lastFailure { return .failed(failure) }
        if marks.durable.load(ordering: .relaxed) >= sequence { return .durable }
        if !waitingLoops.contains(where: { $0 === shard }) { waitingLoops.append(shard) }
        return .pending
    }
}
