// ObsServer — one repository as the daemon serves it: its value core (ObsCore) under a lock,
// the loops with subscribers to it, and which of its states may be shown.
//
// A change — a revision, or lease attachments a write moved without one — is applied in
// memory at once (later writes are planned against it) and shown to nobody (no event, no
// reply that reports it) until it is durable (Durability.swift); then a revision's record is
// posted to every loop with subscribers. The sequencer decides writes (Sequencer.swift); this
// type keeps the state and publishes what is decided.
//
// Subscribing happens under the same lock as writing, so a subscription's snapshot or replay
// and its live events meet at exactly one revision.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

final class Repository: DurabilityListener, DurableLine, Sendable {
    let name: String
    /// The name's UTF-8 bytes (compared with a request's in place).
    private let nameUTF8: [UInt8]
    /// Never reused in this process (loops route by it).
    let id: UInt64
    let epoch: String

    /// What the lock guards. A sequencer, deciding a write under the lock, plans and changes
    /// `core` and hands each change it applied back (`appliedRevision`, `appliedAttachments`);
    /// which states are durable, and who is shown what, stay the repository's own.
    struct State: Sendable {
        /// The values, their history, and the lease attachments.
        var core: RepositoryCore
        /// Which of its states are durable.
        fileprivate var ledger = DurabilityLedger()
        /// Loops with subscribers to this repository: each loop's count, which it keeps
        /// (a count at zero is dropped here when the next subscription starts).
        fileprivate var subscriberLoops: [RouteCount] = []

        /// The state `core` is in (a refusal or a reply that reports it waits for it).
        var current: StateSequence { ledger.current }
        /// The sequence the next change applied gets (storage is handed it before it is applied).
        var nextSequence: StateSequence { ledger.next }
    }

    private let state: Locked<State>
    /// What of `ledger` is readable without the lock.
    private let marks = DurabilityMarks()
    /// Loaded from storage, or written in this process (even if storage undid it since): the
    /// hub never drops it. Set once, never cleared.
    private let permanent = Atomic<Bool>(false)

    /// The store its changes are handed to (for `discard` after an undo), and the counters
    /// of repositories that exist.
    private let storage: any Storage
    private let stats: ServerStats
    /// Called (outside the lock) with the leases an undo attached keys to again: one that has
    /// ended meanwhile owes their deletion (LeaseEnds.swift).
    private let onUndo: @Sendable (Repository, Set<UInt64>) -> Void

    init(
        name: String, epoch: String, historyLimits: HistoryLimits, loaded: LoadedRepository? = nil, storage: any Storage, stats: ServerStats,
        onUndo: @escaping @Sendable (Repository, Set<UInt64>) -> Void = { _, _ in }
    ) {
        self.name = name
        self.nameUTF8 = Array(name.utf8)
        self.storage = storage
        self.stats = stats
        self.onUndo = onUndo
        self.id = LineIDs.next()
        self.epoch = loaded?.epoch ?? epoch
        self.state = Locked(State(core: RepositoryCore(name: name, epoch: loaded?.epoch ?? epoch, historyLimits: historyLimits, loaded: loaded)))
        if loaded != nil { permanent.store(true, ordering: .relaxed) }
    }

    var lineID: UInt64 { id }
    var subject: String { "repository \(name)" }

    /// Runs `body` with the state under the lock (the sequencers plan and commit there).
    /// Inlined: as a call, its closure's captures (the sequencer, the repository) were
    /// retained and released around it on every write.
    @inline(__always)
    func withState<R, E: Error>(_ body: (inout State) throws(E) -> R) throws(E) -> R {
        try state.withLock { (s) throws(E) -> R in try body(&s) }
    }

    // MARK: Reading

    /// The current revision, the number of keys, and the state they are of (a reply reporting them
    /// waits until it is durable).
    var summary: (revision: UInt64, keys: Int, sequence: StateSequence) {
        state.withLock { ($0.core.revision, $0.core.count, $0.ledger.current) }
    }
    var revision: UInt64 { state.withLock { $0.core.revision } }
    var isPermanent: Bool { permanent.load(ordering: .acquiring) }
    /// Subscriptions of every loop.
    var subscriberCount: Int { state.withLock { $0.subscriberLoops.reduce(0) { $0 + $1.count } } }

    /// Whether `bytes` are this repository's name.
    func hasName(_ bytes: UnsafeRawBufferPointer) -> Bool {
        nameUTF8.withUnsafeBytes { $0.count == bytes.count && (bytes.isEmpty || memcmp($0.baseAddress!, bytes.baseAddress!, bytes.count) == 0) }
    }

    /// The hub keeps this repository for good (it has, or had, a revision).
    func makePermanent() { permanent.store(true, ordering: .releasing) }

    /// The key's entry, and the state it was read from.
    func get(_ key: Key) -> (entry: Entry<CanonicalJSON>?, sequence: StateSequence) {
        state.withLock { ($0.core[key], $0.ledger.current) }
    }

    /// The keys with a prefix (all: nil) and their values, unsorted, at the current revision.
    func list(prefix: String?) -> (revision: UInt64, entries: [(key: Key, value: CanonicalJSON)], sequence: StateSequence) {
        state.withLock { s in (s.core.revision, s.core.entries(.prefix(prefix ?? "")), s.ledger.current) }
    }

    /// The lease `key` is attached to, if any.
    func lease(of key: Key) -> UInt64? { state.withLock { $0.core.lease(of: key) } }

    /// The leases some key is attached to.
    var attachedLeases: Set<UInt64> { state.withLock { Set($0.core.attachedLeases) } }

    // MARK: Publishing (under the lock)

    /// A revision was committed to `s.core`: names its state; `durable` if it may be shown at
    /// once — then it is published now, else when storage says it is durable.
    func appliedRevision(_ s: inout State, durable: Bool) -> StateSequence {
        let sequence = s.ledger.apply(durable: durable, marks: marks)
        if durable, !s.subscriberLoops.isEmpty {
            let loops = s.subscriberLoops
            s.core.withLastRecord { Self.publish($0, to: loops, of: self) }
        }
        return sequence
    }

    /// Lease attachments a write moved without a revision were recorded in `s.core`: names
    /// their state; `durable` if it may be reported at once.
    func appliedAttachments(_ s: inout State, durable: Bool) -> StateSequence {
        s.ledger.apply(durable: durable, marks: marks)
    }

    /// Posts a durable revision to the loops with subscribers. Under the lock, so each loop
    /// sees this repository's revisions in order.
    private static func publish(_ view: RevisionView, to loops: [RouteCount], of repository: Repository) {
        for loop in loops {
            let weight = loop.count
            if weight > 0 { loop.shard.post(view, of: repository, weight: weight) }
        }
    }

    // MARK: Durability

    func isDurable(_ sequence: StateSequence) -> Bool {
        if let known = marks.knownDurable(sequence) { return known }
        return state.withLock { s in !s.ledger.wasUndone(sequence) }
    }

    func awaitDurable(_ sequence: StateSequence, on shard: LoopShard) -> Durability {
        if marks.knownDurable(sequence) == true { return .durable }
        return state.withLock { s in s.ledger.await(sequence, on: shard, marks: marks) }
    }

    // Storage's news comes from the thread that commits — mostly an event loop's own flush —
    // which calls these directly: the lock is held for microseconds (the records are
    // published to the loops' inboxes under it).

    /// Every change up to `sequence` is durable: shows them, and tells the waiting loops.
    func durable(through sequence: UInt64) {
        state.withLock { s in confirm(&s, through: sequence) }
    }

    /// Storage kept the changes up to `sequence` and never will keep the others: undoes them.
    func failed(after sequence: UInt64, error: StorageError) {
        let reattached = state.withLock { s -> Set<UInt64> in
            confirm(&s, through: sequence)
            let (_, removedFirst, movedBack) = s.core.undo(last: s.ledger.pending.count)
            if removedFirst { stats.repositories.subtract(1, ordering: .relaxed) }
            // Under the lock: a change made after this undo reuses those numbers, and the
            // store must not drop it as one of the undone.
            storage.discard(self, after: sequence)
            s.ledger.undoPending(error, marks: marks, line: self)
            return Set(movedBack.compactMap(\.to))
        }
        if !reattached.isEmpty { onUndo(self, reattached) }
    }

    private func confirm(_ s: inout State, through sequence: StateSequence) {
        let n = s.ledger.durableCount(through: sequence)
        guard n > 0 else { return }
        let loops = s.subscriberLoops
        s.core.confirm(n) { view in Self.publish(view, to: loops, of: self) }
        s.ledger.confirm(n, marks: marks, line: self)
    }

    /// Installs revisions a shared store decided (every daemon's, in the store's order) and
    /// publishes them; each names who wrote it (`origin`: a connection of this daemon, or 0)
    /// and carries `tail` (a lease's end) in its event. Then applies the lease attachments
    /// the store delivered with them (`replacing`: every attachment); returns the moves.
    @discardableResult
    func install(
        _ revisions: [(record: RevisionRecord, origin: UInt64, tail: [UInt8])], attachments: [SharedAttachment] = [], replacing: Bool = false
    ) -> [(key: Key, from: UInt64?, to: UInt64?)] {
        state.withLock { s in
            for (record, origin, tail) in revisions {
                let info = RevisionInfo(revision: record.revision, time: record.time, writer: record.writer, origin: origin, weight: record.byteSize)
                guard s.core.install(record.changes, info: info, tail: tail) else { continue }
                if record.revision == 1 {
                    stats.repositories.add(1, ordering: .relaxed)
                    makePermanent()
                }
                // Decided and kept by the shared store: durable, and shown at once.
                _ = appliedRevision(&s, durable: true)
            }
            var moves: [(key: Key, from: UInt64?, to: UInt64?)] = []
            if replacing {
                let listed = Set(attachments.map(\.key))
                for (key, lease) in s.core.attachments where !listed.contains(key) {
                    s.core.setAttachment(key, to: nil)
                    moves.append((key, lease, nil))
                }
            }
            for attachment in attachments {
                let from = s.core.setAttachment(attachment.key, to: attachment.lease)
                if from != attachment.lease { moves.append((attachment.key, from, attachment.lease)) }
            }
            return moves
        }
    }

    // MARK: Subscribing

    /// What a subscription took under the lock: what it starts with, the state it was taken
    /// from, whether it went live — and the first members of the state it is sent (keys in
    /// byte order, with their values at the start's revision), the rest read later with
    /// `reader` (nil: `members` holds them all).
    struct Started {
        let start: RepositoryCore.Start
        let sequence: StateSequence
        let registered: Bool
        var members: [UInt8] = []
        /// The reader the rest is read with, from key `next` of `keys` (sorted or not yet).
        var reader: UInt64?
        var keys = KeyList()
        var next = 0
        var sorted = true
    }

    /// A start's state of at most this many keys is sorted and read under the lock, up to
    /// `firstBytes`; a larger one is sorted outside it and read a piece at a time.
    static let keysReadAtOnce = 4096

    /// Starts `subscription` for `request`: takes what it starts with and — unless its one
    /// `once` change is in the replay, or its connection closed — has its loop's `shard`
    /// start it (live and routed), all under the lock, so its start and its first event meet
    /// at one revision. Its state's first `firstBytes` (about) are read at once.
    func subscribe(
        _ subscription: Subscription, _ request: SubscribeRequest, on shard: LoopShard, now: Int64, firstBytes: Int
    ) throws(RepositoryCore.StartRefusal) -> Started {
        try state.withLock { (s) throws(RepositoryCore.StartRefusal) in
            let start = try s.core.start(request, sub: subscription.id, skipOrigin: subscription.skippedOrigin, now: now)
            var live = false
            if !(request.once && start.replayed > 0) {
                subscription.after = start.revision
                subscription.completeThrough = start.revision
                if let count = shard.start(subscription) {
                    live = true
                    if !s.subscriberLoops.contains(where: { $0 === count }) {
                        s.subscriberLoops.removeAll { $0.count == 0 }
                        s.subscriberLoops.append(count)
                    }
                }
            }
            var started = Started(start: start, sequence: s.ledger.current, registered: live)
            guard let keys = start.state?.keys else { return started }
            if keys.count <= Self.keysReadAtOnce {
                started.keys = keys.sorted()
                started.next = s.core.writeMembers(of: started.keys, from: 0, reader: nil, maxBytes: firstBytes, first: true, into: &started.members)
                if started.next < keys.count { started.reader = s.core.openReader() }
            } else {
                (started.keys, started.sorted) = (keys, false)
                started.reader = s.core.openReader()
            }
            return started
        }
    }

    /// Writes members of a start's state (`keys` from `start`, read with `reader`: see
    /// `RepositoryCore.writeMembers`); returns the next key.
    func readMembers(of keys: KeyList, from start: Int, reader: UInt64, maxBytes: Int, first: Bool, into sink: inout [UInt8]) -> Int {
        state.withLock { s in s.core.writeMembers(of: keys, from: start, reader: reader, maxBytes: maxBytes, first: first, into: &sink) }
    }

    /// Closes a start's reader.
    func closeReader(_ reader: UInt64) {
        state.withLock { s in s.core.closeReader(reader) }
    }

    /// How many readers are open (in-process tests look).
    var openReaders: Int { state.withLock { $0.core.openReaders } }
}
