// The single-key write path (RepositoryCore+Single.swift) against the general one: for any
// write it takes, the same answer, the same state, the same history bytes — and for every
// write whose answer is not a plain success, no answer at all (the general path gives it).

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Testing

private func core() -> RepositoryCore {
    RepositoryCore(name: "ui", epoch: "e1", historyLimits: HistoryLimits(count: 10_000, maxBytes: 1 << 30, maxAge: nil))
}

/// Calls `body` with `op` as the single path reads it (key and value as bytes).
private func withSingle<R>(_ op: WriteOp<CanonicalJSON>, _ body: (SingleWrite) -> R) -> R {
    op.key.withUTF8 { key in
        switch op {
        case .set(_, let value, let ifRevision, let force):
            return value.bytes.withUnsafeBytes { bytes in
                body(SingleWrite(key: UnsafeRawBufferPointer(key), value: bytes, isPlain: value.isPlain, ifRevision: ifRevision, force: force))
            }
        case .delete(_, let ifRevision):
            return body(SingleWrite(key: UnsafeRawBufferPointer(key), value: nil, isPlain: true, ifRevision: ifRevision, force: false))
        }
    }
}

/// A reply's fields: revision, changed, and the old value's bytes (nil: the key did not exist).
private struct Answer: Equatable {
    let revision: UInt64
    let changed: Bool
    let old: [UInt8]?
}

/// `op` through the single path, if it takes it (durable at once unless `durable` is false).
private func single(_ c: inout RepositoryCore, _ op: WriteOp<CanonicalJSON>, limits: WriteLimits, durable: Bool = true) -> Answer? {
    withSingle(op) { write -> Answer? in
        guard let plan = c.planSingle(write, limits: limits) else { return nil }
        let old = plan.old.map { Array($0) }
        guard plan.changes else { return Answer(revision: c.revision, changed: false, old: old) }
        let info = c.commitSingle(write, plan, time: 100, writer: Writer(uid: 1, gid: 2, pid: 3), origin: 9, durable: durable)
        return Answer(revision: info.revision, changed: true, old: old)
    }
}

/// `op` through the general path: its answer, or its refusal.
private func general(_ c: inout RepositoryCore, _ op: WriteOp<CanonicalJSON>, limits: WriteLimits, durable: Bool = true) -> Result<Answer, WriteRefusal> {
    let plan: WritePlan
    do throws(WriteRefusal) { plan = try c.plan([op], limits: limits) } catch { return .failure(error) }
    guard !plan.changes.isEmpty else { return .success(Answer(revision: c.revision, changed: false, old: plan.previous?.bytes)) }
    let info = c.commit(plan, time: 100, writer: Writer(uid: 1, gid: 2, pid: 3), origin: 9, durable: durable)
    return .success(Answer(revision: info.revision, changed: true, old: plan.previous?.bytes))
}

/// Every revision the core holds, as the events a `since: 0` subscription replays.
private func history(_ c: RepositoryCore) throws -> [UInt8] {
    try c.start(SubscribeRequest(repo: "ui", since: 0, writers: true), sub: 1, skipOrigin: nil, now: 100).replay
}

private func state(_ c: RepositoryCore) -> [String: [UInt8]] {
    var entries: [String: [UInt8]] = [:]
    c.data.forEach { entries[$0.key.string] = Array($0.valueBytes) + Array("@\($0.revision)\($0.isPlain)".utf8) }
    return entries
}

@Suite struct SingleWriteTests {
    /// Random sets (equal values spelled differently, forced, conditional), deletes and limits
    /// on two cores: one writes through the single path wherever it answers, the other always
    /// through the general one. Every answer the single path gives is the general path's; it
    /// gives none where the general path refuses; state and history stay byte for byte equal.
    @Test func itAnswersExactlyAsTheGeneralPathWhereverItAnswers() throws {
        var rng = SplitMix(seed: 20261128)
        var a = core()
        var b = core()
        let values: [JSONValue] = [
            .int(1), .double(1.0), .double(1.5), .string("x"), .string("x\"\\\u{1}é"), .null, .bool(true),
            ["a": 1, "b": [2]], ["b": [2.0], "a": 1],
        ]
        var taken = 0
        for step in 0..<4000 {
            let key = Key(rng.next() % 9 == 0 ? "k\"\(rng.next() % 3)" : "k\(rng.next() % 12)")
            let current = a[key]?.revision ?? 0
            let ifRevision: UInt64? = switch rng.next() % 6 { case 0: current; case 1: current + 1; case 2: 0; default: nil }
            let op: WriteOp<CanonicalJSON> =
                rng.next() % 5 == 0
                ? .delete(key, ifRevision: ifRevision)
                : .set(key, CanonicalJSON(values[Int(rng.next() % UInt64(values.count))]), ifRevision: ifRevision, force: rng.next() % 7 == 0)
            let limits = WriteLimits(maxKeys: rng.next() % 10 == 0 ? a.count : .max, maxRevisionBytes: rng.next() % 10 == 0 ? 40 : .max)
            let before = a.revision
            let expected = general(&a, op, limits: limits)
            if let answer = single(&b, op, limits: limits) {
                taken += 1
                #expect(expected == .success(answer), "step \(step): \(op)")
            } else {
                // Declined: only a refusal, or the repository's first revision.
                if case .success = expected { #expect(before == 0, "step \(step) declined \(op), which succeeds") }
                #expect(general(&b, op, limits: limits) == expected, "step \(step)")
            }
            #expect(a.revision == b.revision)
        }
        #expect(taken > 2500, "the single path took \(taken) of 4000 writes")
        #expect(state(a) == state(b))
        let (historyA, historyB) = (try history(a), try history(b))
        #expect(historyA == historyB, "the same records, byte for byte")
    }

    @Test func itLeavesToTheGeneralPathEveryWriteThatIsNotAPlainSuccess() throws {
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        #expect(single(&c, .set("a", CanonicalJSON(.int(1))), limits: unlimited) == nil, "the repository's first revision")
        _ = general(&c, .set("a", CanonicalJSON(.int(1))), limits: unlimited)
        #expect(single(&c, .set("a", CanonicalJSON(.int(2)), ifRevision: 7), limits: unlimited) == nil, "a failed condition")
        #expect(single(&c, .set("b", CanonicalJSON(.int(2))), limits: WriteLimits(maxKeys: 1, maxRevisionBytes: .max)) == nil, "too many keys")
        #expect(single(&c, .set("a", CanonicalJSON(.string("long"))), limits: WriteLimits(maxKeys: .max, maxRevisionBytes: 36)) == nil)
        _ = c.attach([.set("a", CanonicalJSON(.int(1)))], leases: [5])
        #expect(single(&c, .set("a", CanonicalJSON(.int(3))), limits: unlimited) == nil, "a key attached to a lease")
        #expect(single(&c, .set("b", CanonicalJSON(.int(3))), limits: unlimited) == Answer(revision: 2, changed: true, old: nil))
        #expect(c.revision == 2 && c["a"]?.value == CanonicalJSON(.int(1)), "nothing declined was applied")
        // An equal value, however spelled, is no change, and reports the value left in place.
        #expect(single(&c, .set("b", CanonicalJSON(.double(3.0))), limits: unlimited) == Answer(revision: 2, changed: false, old: Array("3".utf8)))
        #expect(single(&c, .delete("absent"), limits: unlimited) == Answer(revision: 2, changed: false, old: nil))
    }

    /// A single write not yet durable is undone like any other: state and history as before.
    @Test func aPendingSingleWriteIsUndoneAndConfirmedLikeAnyOther() throws {
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        _ = general(&c, .set("a", CanonicalJSON(.string("one"))), limits: unlimited)
        let before = (state(c), try history(c))
        #expect(single(&c, .set("a", CanonicalJSON(.string("two"))), limits: unlimited, durable: false)?.revision == 2)
        #expect(single(&c, .delete("a"), limits: unlimited, durable: false)?.revision == 3)
        #expect(c.pending.count == 2)
        c.undo(last: Int(c.revision - 1))
        let after = (state(c), try history(c))
        #expect(after.0 == before.0 && after.1 == before.1 && c.revision == 1)
        #expect(single(&c, .set("a", CanonicalJSON(.string("three"))), limits: unlimited, durable: false)?.revision == 2)
        var confirmed: [String] = []
        c.confirm(1) { confirmed.append(String(decoding: $0.body, as: UTF8.self)) }
        #expect(confirmed == [#","repo":"ui","rev":2,"changes":[{"key":"a","old":"one","new":"three"}]}"# + "\n"])
    }
}

@Suite struct UndoLogTests {
    /// Random writes not yet durable — batches through the general path, single keys through
    /// the single path — confirmed in random runs (past the log's compaction of its front) and
    /// undone in random runs: after each undo the state is exactly what it was at the revision
    /// it went back to.
    @Test func undoingPendingRevisionsRestoresTheStateTheyStartedFrom() throws {
        var rng = SplitMix(seed: 112_811)
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        _ = general(&c, .set("seed", CanonicalJSON(.int(0))), limits: unlimited)
        var states: [UInt64: [String: [UInt8]]] = [c.revision: state(c)]
        var durable = c.revision
        var undone = 0
        for _ in 0..<3000 {
            switch rng.next() % 10 {
            case 0:
                // Storage kept some: confirmed up to a random pending revision.
                let through = durable + rng.next() % (c.revision - durable + 1)
                c.confirm(Int(through - durable)) { _ in }
                durable = max(durable, through)
            case 1:
                // Storage failed the rest after a random point.
                let after = durable + rng.next() % (c.revision - durable + 1)
                undone += c.undo(last: Int(c.revision - after)).undone
                #expect(c.revision == after && state(c) == states[after], "undone to \(after)")
            default:
                let key = Key("k\(rng.next() % 30)")
                let value = CanonicalJSON(.string(String(repeating: "v", count: Int(rng.next() % 40))))
                if rng.next() % 4 == 0 {
                    let plan = try c.plan([.set(key, value), .delete(Key("k\(rng.next() % 30 + 30)"))], limits: unlimited)
                    if !plan.changes.isEmpty { c.commit(plan, time: 100, writer: nil, origin: 0, durable: false) }
                } else {
                    let op: WriteOp<CanonicalJSON> = rng.next() % 5 == 0 ? .delete(key) : .set(key, value)
                    if single(&c, op, limits: unlimited, durable: false) == nil { _ = general(&c, op, limits: unlimited, durable: false) }
                }
            }
            states[c.revision] = state(c)
        }
        #expect(undone > 500, "\(undone) revisions undone")
        #expect(c.pending.count == Int(c.revision - durable))
    }
}
