// ObsCore — the single-key write, from the bytes of its request: a `set` or `delete` of one
// key — what clients send most — planned and committed with no `WriteOp`, no `Change` and no
// value copied out of the request or the table (a revision not yet durable copies what the
// key held into the undo log's buffer). The key is looked up once to plan; the record is encoded from the
// request's bytes and the table's, then installed.
//
// It takes only writes whose answer is a success it is sure of. A failed condition, a limit,
// a key attached to a lease, the repository's first revision: `planSingle` says nil and the
// general path (`plan`, `commit`) takes the write, so every refusal, its message included, is
// exactly the general path's — the same rule as the request scanner's.

import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit

/// A `set` (`value` given) or `delete` (`value` nil) of one key, read in place from its request:
/// valid while the request's bytes are.
public struct SingleWrite {
    /// The key's UTF-8 bytes (a valid key).
    public let key: UnsafeRawBufferPointer
    /// The new value's canonical encoding; nil: a `delete`.
    public let value: UnsafeRawBufferPointer?
    /// Whether the new value is plain (see `CanonicalJSON`).
    public let isPlain: Bool
    public let ifRevision: UInt64?
    public let force: Bool

    public init(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer?, isPlain: Bool, ifRevision: UInt64?, force: Bool) {
        self.key = key
        self.value = value
        self.isPlain = isPlain
        self.ifRevision = ifRevision
        self.force = force
    }
}

/// A single-key write planned on the current state.
public struct SinglePlan {
    /// Whether it changes the key (else it leaves the state as it is: no revision).
    public let changes: Bool
    /// The key's value before the write, read in place in the table (nil: absent) — valid until
    /// the state is mutated; its reply's `old`.
    public let old: UnsafeRawBufferPointer?
    public let oldIsPlain: Bool
    /// The key's revision before the write (0: absent).
    public let oldRevision: UInt64
    /// What the revision weighs (`RevisionInfo.weight`).
    public let weight: Int
    /// Where the key lies in the table (or would): the commit needs no second lookup.
    let position: FlatTable.Position
}

extension RepositoryCore {
    /// Plans `write` on the current state, as `plan` would for the same write (the write
    /// rules, then the limits) — or nil when the answer is not a success this path gives: a
    /// failed `ifRevision`, a limit passed, the key attached to a lease (a write detaches
    /// it), the repository's first revision. Nothing is applied. (`mutating` only so that
    /// `self` is passed in place: called on a repository's locked state, a non-mutating call
    /// copied the whole core, 321 bytes, to the stack on every write.)
    public mutating func planSingle(_ write: SingleWrite, limits: WriteLimits) -> SinglePlan? {
        guard data.revision > 0 else { return nil }
        if !attachments.isEmpty, attachments[Key(String(decoding: write.key, as: UTF8.self))] != nil { return nil }
        return data.withRecord(key: write.key) { record, position -> SinglePlan? in
            let oldRevision = record?.revision ?? 0
            if let ifRevision = write.ifRevision, ifRevision != oldRevision { return nil }
            let old = record?.valueBytes
            let oldIsPlain = record?.isPlain ?? true
            let unchanged = SinglePlan(changes: false, old: old, oldIsPlain: oldIsPlain, oldRevision: oldRevision, weight: 0, position: position)
            guard let value = write.value else {
                // A delete: of an absent key it changes nothing.
                guard let old else { return unchanged }
                let weight = write.key.count + old.count + 32
                guard weight <= limits.maxRevisionBytes else { return nil }
                return SinglePlan(changes: true, old: old, oldIsPlain: oldIsPlain, oldRevision: oldRevision, weight: weight, position: position)
            }
            if let record, !write.force, record.valueEquals(canonical: value, isPlain: write.isPlain) { return unchanged }
            if record == nil, data.count + 1 > limits.maxKeys { return nil }
            let weight = write.key.count + (old?.count ?? 0) + value.count + 32
            guard weight <= limits.maxRevisionBytes else { return nil }
            return SinglePlan(changes: true, old: old, oldIsPlain: oldIsPlain, oldRevision: oldRevision, weight: weight, position: position)
        }
    }

    /// Commits a plan that changes the key as the next revision, as `commit` does: recorded in
    /// the history (from the request's and the table's bytes), then installed; `durable: false`
    /// keeps it pending with what it replaced until `confirm` or `undo`. Returns its info.
    /// (The plan's `old` may be overwritten by the install: read it before, if needed after.)
    public mutating func commitSingle(
        _ write: SingleWrite, _ plan: SinglePlan, time now: Int64, writer: Writer?, origin: UInt64, durable: Bool
    ) -> RevisionInfo {
        let revision = data.revision + 1
        let time = max(now, lastTime)
        let info = RevisionInfo(revision: revision, time: time, writer: writer, origin: origin, weight: plan.weight)
        let raw = RawChange(key: write.key, old: plan.old, new: write.value)
        if !durable {
            undo.begin(moves: [], revision: true)
            undo.add(key: write.key, old: plan.old, isPlain: plan.oldIsPlain, revision: plan.oldRevision)
        }
        // Recorded before the install, which may overwrite the old value where it lies.
        record(info, raw, durable: durable)
        data.install(key: write.key, value: write.value, isPlain: write.isPlain, revision: revision, at: plan.position)
        lastTime = time
        return info
    }
}
