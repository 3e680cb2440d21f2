// ObsCore — one repository's values, revisions and history, as the daemon keeps them. A value:
// it knows no connection, loop, socket or lock (the server keeps each repository's core under
// a lock) and answers in domain terms.
//
// A write is planned (the write rules, then the limits: nothing is applied when either
// refuses) and committed as the next revision: installed in the keyed state, encoded once as
// a record (RevisionRecordLayout) that the history keeps and the server delivers. A change
// not yet durable — a revision, or lease attachments a write moved without making one — is
// pending: it keeps what it replaced, so a storage failure can undo it; a revision's record
// waits in `pending` until storage confirms it, and only then is it shown.
//
// Lease attachments (key → lease) live here too, with an index lease → keys, so a lease's
// end finds its keys under the same lock as the writes that attach them — and the rule that
// moves them (`attachmentMoves`), which a shared store's planner applies too; and tombstones —
// the revision of the last deletion of each absent key — kept by every change and undo, so a
// subscription resuming past the history can be caught up with a diff (`start`).

import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit

/// The limits a write is checked against, after the write rules.
public struct WriteLimits: Sendable {
    public var maxKeys: Int
    public var maxRevisionBytes: Int

    public init(maxKeys: Int, maxRevisionBytes: Int) {
        self.maxKeys = maxKeys
        self.maxRevisionBytes = maxRevisionBytes
    }
}

/// Why a write was refused; nothing was applied. (A key written twice in a batch never gets
/// here: the request is refused as it is read.)
public enum WriteRefusal: Error, Sendable, Equatable {
    /// A compare-and-set condition failed: `key` is at `actual`, not `expected`.
    case conflict(key: Key, expected: UInt64, actual: UInt64)
    /// The write would create keys beyond the repository's limit.
    case tooManyKeys(limit: Int)
    /// The revision would carry more bytes of keys and old and new values than allowed.
    case revisionTooLarge(bytes: Int, limit: Int)
}

/// A planned write: what it would change, checked against the rules and limits (each
/// operation's part is in the core, `plans`, until the state is mutated).
public struct WritePlan: Sendable {
    /// How many of its operations change their key (0: the write changes nothing).
    public let changed: Int
    /// What the revision weighs (`RevisionInfo.weight`).
    public let weight: Int
    /// The write brings the repository into existence (its first revision).
    public let creates: Bool
}

public struct RepositoryCore: Sendable {
    public let name: String
    /// The history this repository's revisions belong to (see `Epoch`).
    public let epoch: String
    public internal(set) var data: FlatState
    public private(set) var history: History
    /// The lease each attached key is attached to: not part of the state that revisions
    /// count, nor of the history (the contract's leases).
    public private(set) var attachments: [Key: UInt64] = [:]
    /// The keys attached to each lease (the inverse of `attachments`).
    private var attachedKeys: [UInt64: Set<Key>] = [:]
    /// The revision of the last deletion of each absent key (bounded: `HistoryLimits.tombstones`).
    public private(set) var tombstones: Tombstones
    /// Readers of the state as it was at a revision, open while a large start streams
    /// (StateReader.swift), by number.
    var readers: [UInt64: StateReader] = [:]
    var nextReader: UInt64 = 0
    /// The time of the newest revision: revisions are stamped no earlier, so their times
    /// never go back whatever the clock does.
    var lastTime: Int64
    /// Revisions committed and not yet durable, oldest first: their records.
    public private(set) var pending = RecordBatch<Void>()
    /// Per pending change (revision, or attachments moved alone), oldest first: what its keys
    /// held before, and the lease attachments its write moved (undone with it).
    var undo = UndoLog()
    /// How every revision's body begins (`,"repo":<name>,"rev":`), encoded once.
    private let prefix: [UInt8]
    /// Where the record of the revision committed last is: the history's newest, or — when the
    /// history keeps none — `scratch` (reused: a write allocates no buffer for it).
    // Usable from inline code, with `withLastRecord`.
    @usableFromInline private(set) var lastInHistory = false
    @usableFromInline private(set) var scratch: [UInt8] = []
    @usableFromInline private(set) var scratchPlace: RecordPlace?
    @usableFromInline private(set) var scratchInfo: RevisionInfo?

    /// A repository with what storage loaded (or empty, at revision 0).
    public init(name: String, epoch: String, historyLimits: HistoryLimits, loaded: LoadedRepository? = nil) {
        self.name = name
        self.epoch = epoch
        self.data = loaded.map { FlatState($0.state) } ?? FlatState()
        let prefix = RevisionRecordLayout.prefix(repo: name)
        self.prefix = prefix
        var history = History(limits: historyLimits)
        for record in loaded?.history ?? [] {
            history.append(
                prefix: prefix,
                info: RevisionInfo(revision: record.revision, time: record.time, writer: record.writer, origin: 0, weight: record.byteSize),
                changes: record.changes, tail: record.leaseEnd.map(Self.tail) ?? [])
        }
        self.history = history
        var tombstones = loaded?.tombstones ?? Tombstones()
        tombstones.setLimit(historyLimits.tombstones)
        self.tombstones = tombstones
        self.lastTime = loaded?.history.last?.time ?? .min
        if let loaded, !loaded.attachments.isEmpty { adopt(loaded.attachments) }
    }

    /// Takes the attachments storage loaded, those of keys that exist, and indexes them by
    /// lease — each table sized once (start-up with 200,000 keys on a lease spent a quarter of
    /// its time growing them key by key).
    private mutating func adopt(_ loaded: [Key: UInt64]) {
        let data = self.data
        attachments = loaded.allSatisfy { data.contains($0.key) } ? loaded : loaded.filter { data.contains($0.key) }
        var counts: [UInt64: Int] = [:]
        for lease in attachments.values { counts[lease, default: 0] += 1 }
        for (lease, count) in counts { attachedKeys[lease] = Set(minimumCapacity: count) }
        for (key, lease) in attachments { attachedKeys[lease, default: []].insert(key) }
    }

    // MARK: Reading

    public var revision: UInt64 { data.revision }
    public var count: Int { data.count }
    public subscript(key: Key) -> Entry<CanonicalJSON>? { data[key] }

    /// The selected entries, unsorted.
    public func entries(_ selection: Selection) -> [(key: Key, value: CanonicalJSON)] {
        switch selection {
        case .keys(let keys):
            return keys.compactMap { key in data[key].map { (key, $0.value) } }
        case .prefix(let prefix) where !prefix.isEmpty:
            var selected: [(key: Key, value: CanonicalJSON)] = []
            let bytes = Array(prefix.utf8)
            data.forEach { record in
                if record.keyBytes.starts(with: bytes) { selected.append((record.key, record.value)) }
            }
            return selected
        case .all, .prefix:
            var all: [(key: Key, value: CanonicalJSON)] = []
            all.reserveCapacity(data.count)
            data.forEach { all.append(($0.key, $0.value)) }
            return all
        }
    }

    // MARK: Writing

    /// Decides `ops` — by the write rules first (a write that fails them, or changes nothing,
    /// gets that answer whatever the limits), then the limits — leaving each operation's part
    /// in `plans` (the caller's room for one per operation, reused: a write allocates nothing
    /// for it), read in place until the state is mutated. Nothing is applied. A single-key write and a batch alike: each key
    /// looked up once, its value compared where it lies, nothing copied.
    public func plan(_ ops: UnsafeBufferPointer<RawWriteOp>, limits: WriteLimits, into plans: UnsafeMutableBufferPointer<OpPlan>) throws(WriteRefusal) -> WritePlan {
        try data.plan(ops, into: plans)
        var changed = 0
        var created = 0
        var removed = 0
        var weight = 0
        for i in 0..<ops.count where plans[i].changes {
            changed += 1
            if plans[i].old == nil { created += 1 }
            if ops[i].value == nil { removed += 1 }
            weight += ops[i].key.count + (plans[i].old?.count ?? 0) + (ops[i].value?.count ?? 0) + 32
        }
        guard changed > 0 else { return WritePlan(changed: 0, weight: 0, creates: false) }
        if created > 0, data.count + created - removed > limits.maxKeys { throw .tooManyKeys(limit: limits.maxKeys) }
        if weight > limits.maxRevisionBytes { throw .revisionTooLarge(bytes: weight, limit: limits.maxRevisionBytes) }
        return WritePlan(changed: changed, weight: weight, creates: data.revision == 0)
    }

    /// The next revision's info for a write that changes something, made `now` (its time is
    /// never before the revision before it).
    public func nextRevision(_ plan: WritePlan, time now: Int64, writer: Writer?, origin: UInt64) -> RevisionInfo {
        RevisionInfo(revision: data.revision + 1, time: max(now, lastTime), writer: writer, origin: origin, weight: plan.weight)
    }

    /// Calls `body` with the changes `ops`, planned as `plans`, make — as bytes in place (for
    /// storage, which encodes them before `commit` installs them).
    @inlinable
    public static func withChanges<R>(
        _ ops: UnsafeBufferPointer<RawWriteOp>, _ plans: UnsafeMutableBufferPointer<OpPlan>, changed: Int, _ body: (UnsafeBufferPointer<RawChange>) -> R
    ) -> R {
        withUnsafeTemporaryAllocation(of: RawChange.self, capacity: max(1, changed)) { buffer in
            var n = 0
            for i in 0..<ops.count where plans[i].changes {
                buffer.initializeElement(
                    at: n, to: RawChange(key: ops[i].key, old: plans[i].old, oldIsPlain: plans[i].oldIsPlain, new: ops[i].value, newIsPlain: ops[i].isPlain))
                n += 1
            }
            defer { buffer.baseAddress!.deinitialize(count: n) }
            return body(UnsafeBufferPointer(rebasing: buffer[..<n]))
        }
    }

    /// Commits `ops`, planned as `plan` and `plans` (a write that changes something), as
    /// revision `info`: records it in the history (with `tail`, a lease's end, in its event) —
    /// and, `durable: false`, keeps it pending with what its keys held and the attachment
    /// `moves` its write made, until `confirm` or `undo` — then installs it. `withLastRecord`
    /// reads its record. (The values `plans` point to are overwritten: read them before.)
    public mutating func commit(
        _ plan: WritePlan, _ ops: UnsafeBufferPointer<RawWriteOp>, _ plans: UnsafeMutableBufferPointer<OpPlan>, as info: RevisionInfo, durable: Bool, tail: [UInt8] = [],
        moves: [AttachmentMove] = []
    ) {
        if !durable {
            undo.begin(moves: moves, revision: true)
            for i in 0..<ops.count where plans[i].changes {
                // A key it creates gives up its tombstone: the undo puts it back.
                let tombstone = plans[i].old == nil && !tombstones.isEmpty ? tombstones[Key(bytes: ops[i].key)] : nil
                undo.add(key: ops[i].key, old: plans[i].old, isPlain: plans[i].oldIsPlain, revision: plans[i].oldRevision, tombstone: tombstone)
            }
        }
        if !readers.isEmpty {
            for i in 0..<ops.count where plans[i].changes {
                keepForReaders(key: ops[i].key, old: plans[i].old, isPlain: plans[i].oldIsPlain, revision: plans[i].oldRevision)
            }
        }
        // Recorded before the install, which may overwrite the old values where they lie.
        Self.withChanges(ops, plans, changed: plan.changed) { record(info, RawChanges($0), durable: durable, tail: tail) }
        if ops.count == 1 {
            data.install(key: ops[0].key, value: ops[0].value, isPlain: ops[0].isPlain, revision: info.revision, at: plans[0].position)
        } else {
            // Each install may move what the next plan found: looked up again.
            for i in 0..<ops.count where plans[i].changes {
                data.restore(key: ops[i].key, value: ops[i].value, isPlain: ops[i].isPlain, revision: info.revision)
            }
            data.setRevision(info.revision)
        }
        for i in 0..<ops.count where plans[i].changes {
            if ops[i].value == nil {
                tombstones.deleted(Key(bytes: ops[i].key), at: info.revision)
            } else if plans[i].old == nil, !tombstones.isEmpty {
                tombstones.remove(Key(bytes: ops[i].key))
            }
        }
        lastTime = info.time
    }

    // MARK: Leases

    /// The lease member of the event of a deletion `end` made: `,"lease":{"id":L,"end":E}`.
    public static func tail(_ end: LeaseEnd) -> [UInt8] {
        var bytes: [UInt8] = []
        end.writeMember(into: &bytes)
        return bytes
    }

    /// The lease `key` is attached to, if any.
    public func lease(of key: Key) -> UInt64? { attachments.isEmpty ? nil : attachments[key] }

    /// A key's move between leases: the lease it was attached to before, and after (nil: none).
    public typealias AttachmentMove = ObsStore.AttachmentMove

    /// A write was accepted: its keys move by the attachment rule (`attachmentMoves`). Returns
    /// the moves, for storage (they ride in the revision's frame, or in one of their own when
    /// the write makes no revision) and for `commit`, so that undoing the write moves its keys
    /// back. (Nothing to do, and no key made, when no key is attached and no operation names a
    /// lease.)
    public mutating func attach(_ ops: UnsafeBufferPointer<RawWriteOp>) -> [AttachmentMove] {
        guard !attachments.isEmpty || ops.contains(where: { $0.lease != nil }) else { return [] }
        return Self.attachmentMoves(ops) { key, to in setAttachment(key, to: to) }
    }

    /// The attachment rule, whoever keeps the attachments — a repository here, or a shared
    /// store's group as it is planned: after a write, each `set` attaches its key to the lease
    /// it names (nil: none), even when its value was equal, and each `delete` detaches; in
    /// order, so the last operation on a key decides. `move(key, to)` attaches `key` to `to`
    /// and returns the lease it was attached to before. Returns the moves that changed an
    /// attachment.
    public static func attachmentMoves(_ ops: UnsafeBufferPointer<RawWriteOp>, _ move: (Key, _ to: UInt64?) -> UInt64?) -> [AttachmentMove] {
        var moves: [AttachmentMove] = []
        for op in ops {
            let to: UInt64? = op.value == nil ? nil : op.lease
            let key = Key(String(decoding: op.key, as: UTF8.self))
            let from = move(key, to)
            if from != to { moves.append((key, from, to)) }
        }
        return moves
    }

    /// Records attachments a write moved while making no revision (an equal value written
    /// naming a lease): `durable: false` keeps them pending until `confirm` or `undo`, like a
    /// revision.
    public mutating func recordAttachments(_ moves: [AttachmentMove], durable: Bool) {
        guard !durable else { return }
        undo.begin(moves: moves, revision: false)
    }

    /// The keys attached to `lease` that exist, in byte order — what its end deletes.
    public func keys(attachedTo lease: UInt64) -> [Key] {
        (attachedKeys[lease] ?? []).filter { data.contains($0) }.sorted()
    }

    /// The leases keys are attached to (to find those attached to a lease that ended).
    public var attachedLeases: Dictionary<UInt64, Set<Key>>.Keys { attachedKeys.keys }

    /// Detaches `key` if it is attached to `lease` (a key that no longer exists).
    public mutating func detach(_ key: Key, from lease: UInt64) {
        if attachments[key] == lease { setAttachment(key, to: nil) }
    }

    /// Attaches `key` to `lease` (nil: to none) — a shared store decided it, or a write,
    /// or its undo, moved it; returns the lease it was attached to.
    @discardableResult
    public mutating func setAttachment(_ key: Key, to lease: UInt64?) -> UInt64? {
        guard let lease else {
            guard !attachments.isEmpty, let from = attachments.removeValue(forKey: key) else { return nil }
            attachedKeys[from]?.remove(key)
            if attachedKeys[from]?.isEmpty == true { attachedKeys[from] = nil }
            return from
        }
        let from = attachments.updateValue(lease, forKey: key)
        guard from != lease else { return from }
        if let from {
            attachedKeys[from]?.remove(key)
            if attachedKeys[from]?.isEmpty == true { attachedKeys[from] = nil }
        }
        attachedKeys[lease, default: []].insert(key)
        return from
    }

    /// What a tentative install replaced, to take it back.
    public typealias Tentative = [(key: Key, entry: Entry<CanonicalJSON>?)]

    /// Installs `changes` as the next revision, recording nothing, so the next write of a
    /// group can be planned on top of it (a shared store commits the group, or not);
    /// `revert` takes such installs back, newest first.
    public mutating func installTentatively(_ changes: [Change<CanonicalJSON>]) -> Tentative {
        let previous = data.entries(replacedBy: changes)
        data.install(ChangeSet(revision: data.revision + 1, changes: changes))
        return previous
    }

    /// Takes back tentative installs (in the order they were made).
    public mutating func revert(_ tentatives: [Tentative]) {
        for previous in tentatives.reversed() { data.undoLast(restoring: previous) }
    }

    /// Installs a revision decided elsewhere (another daemon's, through a shared store; or this
    /// daemon's, once the store committed it) — with `tail`, a lease's end, in its event.
    /// Ignored unless it is the next revision.
    @discardableResult
    public mutating func install(_ changes: [Change<CanonicalJSON>], info: RevisionInfo, tail: [UInt8] = []) -> Bool {
        guard info.revision == data.revision + 1 else { return false }
        if !readers.isEmpty {
            for change in changes {
                let entry = data[change.key]
                change.key.withUTF8 { key in
                    if let entry {
                        entry.value.bytes.withUnsafeBytes {
                            keepForReaders(key: UnsafeRawBufferPointer(key), old: $0, isPlain: entry.value.isPlain, revision: entry.revision)
                        }
                    } else {
                        keepForReaders(key: UnsafeRawBufferPointer(key), old: nil, isPlain: true, revision: 0)
                    }
                }
            }
        }
        data.install(ChangeSet(revision: info.revision, changes: changes))
        for change in changes {
            if change.new == nil {
                tombstones.deleted(change.key, at: info.revision)
            } else if change.old == nil {
                tombstones.remove(change.key)
            }
        }
        lastTime = max(lastTime, info.time)
        record(info, changes, durable: true, tail: tail)
        return true
    }

    /// Encodes the revision once: into the history (or `scratch`, when it keeps none), and
    /// — not durable yet — copies it to `pending`.
    mutating func record<C: RecordChanges>(_ info: RevisionInfo, _ changes: C, durable: Bool, tail: [UInt8] = []) {
        if history.keepsRevisions {
            history.append(prefix: prefix, info: info, changes: changes, tail: tail)
            lastInHistory = true
        } else {
            scratch.removeAll(keepingCapacity: scratch.capacity <= 1 << 20)
            scratchPlace = RevisionRecordLayout.append(prefix: prefix, revision: info.revision, changes: changes, into: &scratch, tail: tail)
            scratchInfo = info
            lastInHistory = false
        }
        if !durable {
            var pending = self.pending
            self.pending = RecordBatch()  // `pending` the only owner while it grows
            withLastRecord { pending.append($0, tag: ()) }
            self.pending = pending
        }
    }

    /// Reads the record of the revision committed or installed last. (`mutating` only so
    /// that `self` is passed in place.)
    @inlinable
    public mutating func withLastRecord<R>(_ body: (RevisionView) -> R) -> R? {
        if lastInHistory { return history.withNewest(body) }
        guard let place = scratchPlace, let info = scratchInfo else { return nil }
        return scratch.withUnsafeBytes { body(RevisionView(info: info, place: place, bytes: $0)) }
    }

    // MARK: Durability

    /// The number of pending changes (revisions, and attachments moved alone), oldest first.
    public var pendingChanges: Int { undo.count }

    /// The `n` oldest pending changes are durable: calls `body` with the record of each
    /// revision among them, oldest first, and forgets how to undo them. Returns how many
    /// revisions there were.
    @discardableResult
    public mutating func confirm(_ n: Int, _ body: (RevisionView) -> Void) -> Int {
        let revisions = undo.revisions(inFirst: n)
        for i in 0..<revisions { pending.withEntry(i) { _, view in body(view) } }
        if revisions > 0 { pending.removeFirst(revisions) }
        undo.removeFirst(n)
        return revisions
    }

    /// Storage never will keep the `n` newest pending changes: undoes them, newest first, and
    /// drops their revisions from the history; the lease attachments their writes moved go
    /// back (each key still where its write left it). Returns how many revisions were undone,
    /// whether revision 1 was among them (the repository no longer exists), and the
    /// attachments moved back.
    @discardableResult
    public mutating func undo(last n: Int) -> (undone: Int, removedFirst: Bool, movedBack: [AttachmentMove]) {
        var undone = 0
        var removedFirst = false
        var movedBack: [AttachmentMove] = []
        for _ in 0..<min(n, undo.count) {
            let (moves, revision) = undo.undoLast(in: &data, tombstones: &tombstones)
            for move in moves.reversed() where attachments[move.key] == move.to {
                setAttachment(move.key, to: move.from)
                movedBack.append((move.key, move.to, move.from))
            }
            guard revision else { continue }
            if pending.entry(pending.count - 1).info.revision == 1 { removedFirst = true }
            pending.removeLast(1)
            undone += 1
        }
        history.removeLast(undone)
        // A key its undo left attached but absent is attached to nothing.
        for move in movedBack where move.to != nil && data[move.key] == nil { setAttachment(move.key, to: nil) }
        return (undone, removedFirst, movedBack)
    }

    // MARK: Subscribing

    /// Why a subscription cannot start where it asked to.
    public enum StartRefusal: Error, Sendable {
        /// `since` cannot be served from the history (another epoch, a revision this daemon
        /// does not have, or one no longer retained) and the subscription did not ask to be
        /// caught up.
        case compacted(String)
    }

    /// What a subscription starts with, at revision `revision`.
    public struct Start: Sendable {
        public let revision: UInt64
        /// For a subscription that asked for `catchup`: how it is brought up to `revision`.
        public let catchUp: CatchUpMode?
        /// The state it is sent, if any: its keys (unsorted), read with their values at
        /// `revision` (`writeMembers`) — every selected key for a snapshot (`initial`, or a
        /// catch-up's `snapshot`), the keys changed after `since` for a catch-up's `diff`.
        public let state: StartState?
        /// Replayed `change` events, in order.
        public var replay: [UInt8]
        public var replayed: Int
    }

    /// The state a subscription starts with.
    public struct StartState: Sendable {
        public enum Kind: Sendable, Equatable {
            /// A `snapshot` event: the selected state, complete.
            case snapshot
            /// A `catchup` event from `from`: the keys changed since, and those deleted since
            /// (in byte order).
            case diff(from: UInt64, deleted: [Key])
        }
        public let kind: Kind
        public var keys: KeyList
    }

    /// Starts subscription `sub` for `request` at the current revision: its snapshot (with
    /// `initial`), its replay since `request.since` written as events (at most one for `once`;
    /// none of `skipOrigin`'s revisions — `echo: false`) — or, where the history cannot replay
    /// and the request asked for `catchup`, the diff since (the keys changed since, and the
    /// deletions its tombstones remember) or, when that cannot be shown, a snapshot.
    public func start(_ request: SubscribeRequest, sub: UInt64, skipOrigin: UInt64?, now: Int64) throws(StartRefusal) -> Start {
        let revision = data.revision
        guard let since = request.since else {
            let state = request.initial ? StartState(kind: .snapshot, keys: keys(request.selection)) : nil
            return Start(revision: revision, catchUp: nil, state: state, replay: [], replayed: 0)
        }
        let range: Range<Int>?
        let refusal: String
        let sameHistory: Bool
        if let seen = request.epoch, seen != epoch {
            (range, sameHistory) = (nil, false)
            refusal =
                "epoch \(JSONValue.string(String(seen.prefix(80))).jsonText) is not repository \(name)'s history (its epoch is \(epoch)): revision \(since) of that history means nothing here; subscribe with initial: true"
        } else if since > revision {
            (range, sameHistory) = (nil, false)
            refusal = "since \(since) is ahead of repository \(name)'s revision \(revision): this daemon does not have that history; subscribe with initial: true"
        } else {
            range = history.records(after: since, current: revision, now: now)
            sameHistory = true
            let oldest = history.oldestRevision(now: now).map { "starts at revision \($0)" } ?? "is empty"
            refusal = "history of repository \(name) \(oldest); since \(since) is older: subscribe with initial: true"
        }
        guard let range else {
            guard request.catchup else { throw .compacted(refusal) }
            // Past the history: a diff where the deletions since are known, else a snapshot.
            if sameHistory, tombstones.knowsDeletions(after: since) {
                let diff = StartState(
                    kind: .diff(from: since, deleted: tombstones.deleted(after: since, selectedBy: request.selection)),
                    keys: keys(request.selection, changedAfter: since))
                return Start(revision: revision, catchUp: .diff, state: diff, replay: [], replayed: 0)
            }
            return Start(revision: revision, catchUp: .snapshot, state: StartState(kind: .snapshot, keys: keys(request.selection)), replay: [], replayed: 0)
        }
        var replay: [UInt8] = []
        var replayed = 0
        history.forEach(in: range) { view in
            guard !(request.once && replayed > 0), view.touches(request.selection) else { return }
            if let skipOrigin, view.info.origin == skipOrigin { return }
            view.writeEvent(&replay, sub: sub, writers: request.writers, selected: view.selected(by: request.selection))
            replayed += 1
        }
        return Start(revision: revision, catchUp: request.catchup ? .replay : nil, state: nil, replay: replay, replayed: replayed)
    }
}
