// ObservableKit — coalesced delivery for a consumer that lags.
//
// An async consumer of a repository's changes that reads more slowly than the writers
// write would, with an unbounded stream, hold every intermediate revision. A consumer that
// wants the current *state* (a UI, a configuration follower) asks for coalescing instead:
// while it is not reading, the buffer keeps, per changed key, the value the consumer last
// received and the latest value — nothing per write. When it reads, it gets one change set
// per key whose value differs (byte order of keys; keys that changed back left out), with
// `revision` the latest revision and `from` the first one covered. A consumer that keeps up
// gets every revision's change set unchanged. Memory: one change set plus one entry per
// selected key that changed, whatever the number of writes.
//
// Thread safety: the repository's delivery thread only takes the buffer's lock to merge;
// a waiting consumer is resumed after the lock is released, so nothing runs under it and
// observers may be added or removed from anywhere, a consumer's own loop included.

/// The changes to a selection of an `ObservableRepository`, coalesced while the consumer
/// lags (see `ObservableRepository.coalescedChanges(_:)`).
///
/// One consumer iterates it. Iteration ends when the consuming task is cancelled; the
/// observation ends when the sequence and its iterators are gone.
public struct CoalescedChanges<Value: Equatable & Sendable>: AsyncSequence, Sendable {
    public typealias Element = ChangeSet<Value>
    public typealias Failure = Never

    let buffer: CoalescingBuffer<Value>

    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(buffer: buffer) }

    /// Iterates the coalesced changes.
    public struct AsyncIterator: AsyncIteratorProtocol {
        let buffer: CoalescingBuffer<Value>

        /// The next change set: at once if changes are waiting (coalesced when they span
        /// several revisions), else when the next revision touches the selection; `nil`
        /// once the consuming task was cancelled.
        public mutating func next() async -> ChangeSet<Value>? {
            await buffer.next()
        }
    }
}

/// The state between a repository's deliveries and one consumer.
final class CoalescingBuffer<Value: Equatable & Sendable>: Sendable {
    /// One key's coalesced change: the value the consumer last received and the latest.
    struct Pending: Sendable {
        var old: Value?
        var new: Value?
    }

    struct State: Sendable {
        /// One revision's change set, kept as it is while it is the only one waiting.
        var exact: ChangeSet<Value>?
        /// Once several revisions wait: per key, what the consumer has and what is current.
        var pending: [Key: Pending] = [:]
        /// The first and the last revision `pending` covers.
        var from: UInt64 = 0
        var revision: UInt64 = 0
        var waiters: [CheckedContinuation<ChangeSet<Value>?, Never>] = []
        var finished = false

        /// What the consumer gets now, if anything: the exact change set, or the keys whose
        /// value differs from the one the consumer last received, in byte order.
        mutating func take() -> ChangeSet<Value>? {
            if let exact {
                self.exact = nil
                return exact
            }
            guard !pending.isEmpty else { return nil }
            let changes = pending.sorted { $0.key < $1.key }.compactMap { key, p in
                p.old == p.new ? nil : Change(key: key, old: p.old, new: p.new)
            }
            pending.removeAll(keepingCapacity: true)
            return changes.isEmpty ? nil : ChangeSet(revision: revision, changes: changes, from: from)
        }

        mutating func merge(_ changeSet: ChangeSet<Value>) {
            for change in changeSet.changes {
                if pending[change.key] != nil {
                    pending[change.key]!.new = change.new
                } else {
                    pending[change.key] = Pending(old: change.old, new: change.new)
                }
            }
            revision = changeSet.revision
        }
    }

    private let state = Locked(State())
    /// The repository observation feeding this buffer; ends when the buffer is released.
    private let token = Locked<ObservationToken?>(nil)

    init() {}

    func hold(_ observation: ObservationToken) {
        token.withLock { $0 = observation }
    }

    /// Takes one revision's change set from the repository (on its delivery thread).
    func push(_ changeSet: ChangeSet<Value>) {
        let waiter: CheckedContinuation<ChangeSet<Value>?, Never>? = state.withLock { s in
            if s.finished { return nil }
            if s.exact == nil && s.pending.isEmpty {
                if !s.waiters.isEmpty { return s.waiters.removeFirst() }
                s.exact = changeSet
                return nil
            }
            if let exact = s.exact {
                s.exact = nil
                s.from = exact.from ?? exact.revision
                s.merge(exact)
            }
            s.merge(changeSet)
            return nil
        }
        waiter?.resume(returning: changeSet)
    }

    func next() async -> ChangeSet<Value>? {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<ChangeSet<Value>?, Never>) in
                let ready: ChangeSet<Value>?? = state.withLock { s in
                    if s.finished || Task.isCancelled { return .some(nil) }
                    if let changeSet = s.take() { return .some(changeSet) }
                    s.waiters.append(continuation)
                    return nil
                }
                if let ready { continuation.resume(returning: ready) }
            }
        } onCancel: {
            finish()
        }
    }

    /// Ends the sequence: waiting consumers get `nil`, the observation ends.
    func finish() {
        let waiters = state.withLock { s in
            s.finished = true
            s.exact = nil
            s.pending = [:]
            defer { s.waiters = [] }
            return s.waiters
        }
        for waiter in waiters { waiter.resume(returning: nil) }
        token.withLock { $0 }?.cancel()
    }

    /// How many changes the buffer holds for its consumer (bounded by the selected keys).
    var heldChanges: Int {
        state.withLock { ($0.exact?.changes.count ?? 0) + $0.pending.count }
    }
}

extension ObservableRepository {
    /// The changes to the keys `selection` includes, coalesced while the consumer lags.
    ///
    /// A consumer that keeps up receives each revision's `ChangeSet` as `changes(_:)` would.
    /// One that falls behind receives, when it next reads, a single change set covering
    /// every revision it missed (`from` is the first of them, `revision` the latest): one
    /// change per key whose value differs from the one it last received — `old` that value,
    /// `new` the current one — in byte order of the keys; a key that changed and changed
    /// back is left out, and if every key did, nothing is delivered. Applying every change
    /// set received leaves the consumer with exactly the repository's state at the latest
    /// revision. The memory a lagging consumer costs is bounded by the number of selected
    /// keys, never by the number of writes. Observation starts at once (changes made before
    /// the first `next()` are not missed).
    ///
    /// ```swift
    /// for await changes in settings.coalescedChanges(.prefix("ui.")) {
    ///     await render(changes)      // slow: meanwhile, writes coalesce per key
    /// }
    /// ```
    public func coalescedChanges(_ selection: Selection = .all) -> CoalescedChanges<Value> {
        let buffer = CoalescingBuffer<Value>()
        buffer.hold(observe(selection) { [weak buffer] changeSet in buffer?.push(changeSet) })
        return CoalescedChanges(buffer: buffer)
    }
}
