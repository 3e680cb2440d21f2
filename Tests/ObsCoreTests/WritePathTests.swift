// The core's one write path on its own: what a write replies (its revision, whether it
// changed anything, the value it replaced) whatever its spelling; a write not yet durable
// undone and confirmed like any other; random runs of confirms and undos restoring exactly
// the state each undo went back to.

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Testing
import TestSupport

private func core() -> RepositoryCore {
    RepositoryCore(name: "ui", epoch: "e1", historyLimits: HistoryLimits(count: 10_000, maxBytes: 1 << 30, maxAge: nil))
}

/// A reply's fields: revision, changed, and the old value's bytes (nil: the key did not exist).
private struct Answer: Equatable {
    let revision: UInt64
    let changed: Bool
    let old: [UInt8]?
}

/// `op` through the write path: its answer, or its refusal.
private func write(_ c: inout RepositoryCore, _ op: WriteOp<CanonicalJSON>, limits: WriteLimits, durable: Bool = true) -> Result<Answer, WriteRefusal> {
    let plan: PlannedWrite
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

@Suite(.mayBlock) struct WritePathTests {
    /// What a single-key write answers, whatever its spelling: an equal value (however spelled)
    /// is no change and reports the value left in place; a delete of an absent key reports no
    /// value; a change reports the value it replaced; the limits refuse before anything applies.
    @Test func aWriteAnswersWithTheValueItReplaced() throws {
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        #expect(write(&c, .set("a", CanonicalJSON(.int(1))), limits: unlimited) == .success(Answer(revision: 1, changed: true, old: nil)))
        #expect(write(&c, .set("a", CanonicalJSON(.double(1.0))), limits: unlimited) == .success(Answer(revision: 1, changed: false, old: Array("1".utf8))))
        #expect(write(&c, .set("a", CanonicalJSON(.double(1.0)), force: true), limits: unlimited) == .success(Answer(revision: 2, changed: true, old: Array("1".utf8))))
        #expect(write(&c, .delete("absent"), limits: unlimited) == .success(Answer(revision: 2, changed: false, old: nil)))
        #expect(write(&c, .set("a", CanonicalJSON(.int(2)), ifRevision: 7), limits: unlimited) == .failure(.conflict(key: "a", expected: 7, actual: 2)))
        #expect(write(&c, .set("b", CanonicalJSON(.int(2))), limits: WriteLimits(maxKeys: 1, maxRevisionBytes: .max)) == .failure(.tooManyKeys(limit: 1)))
        #expect(write(&c, .delete("a"), limits: unlimited) == .success(Answer(revision: 3, changed: true, old: Array("1.0".utf8))))
        #expect(c.revision == 3 && c.count == 0, "nothing refused was applied")
    }

    /// A write not yet durable is undone like any other: state and history as before.
    @Test func aPendingWriteIsUndoneAndConfirmedLikeAnyOther() throws {
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        _ = write(&c, .set("a", CanonicalJSON(.string("one"))), limits: unlimited)
        let before = (state(c), try history(c))
        #expect(try write(&c, .set("a", CanonicalJSON(.string("two"))), limits: unlimited, durable: false).get().revision == 2)
        #expect(try write(&c, .delete("a"), limits: unlimited, durable: false).get().revision == 3)
        #expect(c.pending.count == 2)
        c.undo(last: Int(c.revision - 1))
        let after = (state(c), try history(c))
        #expect(after.0 == before.0 && after.1 == before.1 && c.revision == 1)
        #expect(try write(&c, .set("a", CanonicalJSON(.string("three"))), limits: unlimited, durable: false).get().revision == 2)
        var confirmed: [String] = []
        c.confirm(1) { confirmed.append(String(decoding: $0.body, as: UTF8.self)) }
        #expect(confirmed == [#","repo":"ui","rev":2,"changes":[{"key":"a","old":"one","new":"three"}]}"# + "\n"])
    }
}

@Suite(.mayBlock) struct UndoLogTests {
    /// Random writes not yet durable — batches and single keys — confirmed in random runs
    /// (past the log's compaction of its front) and
    /// undone in random runs: after each undo the state is exactly what it was at the revision
    /// it went back to.
    @Test func undoingPendingRevisionsRestoresTheStateTheyStartedFrom() throws {
        var rng = SplitMix(seed: 112_811)
        var c = core()
        let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
        _ = write(&c, .set("seed", CanonicalJSON(.int(0))), limits: unlimited)
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
                    _ = write(&c, op, limits: unlimited, durable: false)
                }
            }
            states[c.revision] = state(c)
        }
        #expect(undone > 500, "\(undone) revisions undone")
        #expect(c.pending.count == Int(c.revision - durable))
    }
}
