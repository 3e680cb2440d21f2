// What the ObsCore tests share: writes given as values, through the core's one write path
// (each operation's bytes read in place, planned, committed) — the way the daemon's writes go.

import ObsCore
import ObsStore
import ObsValues
import ObservableKit

/// A write planned on a core: its operations, and what the rules decided.
struct PlannedWrite {
    let ops: WriteOps
    let plan: WritePlan
    /// Its changes, as values (empty: it changes nothing).
    let changes: [Change<CanonicalJSON>]
    /// The value a single-key write replaced, or left in place (nil for a batch).
    let previous: CanonicalJSON?
}

extension RepositoryCore {
    /// Plans `ops` (each `set` naming `leases[i]`), as a session's write would be.
    func plan(_ ops: [WriteOp<CanonicalJSON>], limits: WriteLimits, leases: [UInt64?] = []) throws(WriteRefusal) -> PlannedWrite {
        let owned = WriteOps(ops, leases: leases)
        var buffer = OpPlanBuffer()
        return try owned.withRawOps { raw throws(WriteRefusal) -> PlannedWrite in
            let plans = buffer.room(for: raw.count)
            let plan = try self.plan(raw, limits: limits, into: plans)
            let changes = RepositoryCore.withChanges(raw, plans, changed: plan.changed) { $0.map(\.materialized) }
            let previous = ops.count == 1 ? plans[0].old.map { CanonicalJSON(canonical: Array($0), isPlain: plans[0].oldIsPlain) } : nil
            return PlannedWrite(ops: owned, plan: plan, changes: changes, previous: previous)
        }
    }

    /// Commits `write` (planned on the current state, changing something) as the next revision.
    @discardableResult
    mutating func commit(
        _ write: PlannedWrite, time: Int64, writer: Writer?, origin: UInt64, durable: Bool, tail: [UInt8] = [], moves: [AttachmentMove] = []
    ) -> RevisionInfo {
        var buffer = OpPlanBuffer()
        return write.ops.withRawOps { raw in
            let plans = buffer.room(for: raw.count)
            let plan = try! self.plan(raw, limits: WriteLimits(maxKeys: .max, maxRevisionBytes: .max), into: plans)
            let info = nextRevision(plan, time: time, writer: writer, origin: origin)
            commit(plan, raw, plans, as: info, durable: durable, tail: tail, moves: moves)
            return info
        }
    }

    /// Moves the attachments `ops` make (each `set` naming `leases[i]`), as a write does.
    mutating func attach(_ ops: [WriteOp<CanonicalJSON>], leases: [UInt64?]) -> [AttachmentMove] {
        WriteOps(ops, leases: leases).withRawOps { attach($0) }
    }
}
