// The value core in process, with no loop, socket or lock: the write rules and limits, a
// revision recorded once as a record its events are made of, undo of revisions storage did
// not keep, subscription starts (snapshot, replay, compacted), leases' attachments, and a
// randomized comparison against a plain dictionary model.

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Testing
import TestSupport

private let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
private func value(_ v: JSONValue) -> CanonicalJSON { CanonicalJSON(v) }

private func core(history: Int = 100, maxBytes: Int = 1 << 30, maxAge: Int64? = nil) -> RepositoryCore {
    RepositoryCore(name: "ui", epoch: "e1", historyLimits: HistoryLimits(count: history, maxBytes: maxBytes, maxAge: maxAge))
}

/// Plans and commits `ops` (durable at once); the revision, or nil when nothing changed.
@discardableResult
private func write(_ c: inout RepositoryCore, _ ops: [WriteOp<CanonicalJSON>], time: Int64 = 100, origin: UInt64 = 0) throws -> UInt64? {
    let plan = try c.plan(ops, limits: unlimited)
    guard !plan.changes.isEmpty else { return nil }
    return c.commit(plan, time: time, writer: Writer(uid: 1, gid: 2, pid: 3), origin: origin, durable: true).revision
}

/// The events a subscription with `request` starts with, as text lines.
private func replay(_ c: RepositoryCore, _ request: SubscribeRequest, skip: UInt64? = nil) throws -> [String] {
    let start = try c.start(request, sub: 7, skipOrigin: skip, now: 100)
    return String(decoding: start.replay, as: UTF8.self).split(separator: "\n").map(String.init)
}

@Suite(.mayBlock) struct RepositoryCoreTests {
    @Test func theWriteRulesDecideWhatChanges() throws {
        var c = core()
        #expect(try write(&c, [.set("theme", value("light"))]) == 1)
        #expect(try write(&c, [.set("theme", value("light"))]) == nil, "an equal value is no change")
        #expect(try write(&c, [.set("theme", value("light"), force: true)]) == 2, "force makes it one")
        #expect(throws: WriteRefusal.conflict(key: "theme", expected: 1, actual: 2)) {
            try c.plan([.set("theme", value("dark"), ifRevision: 1)], limits: unlimited)
        }
        #expect(try write(&c, [.delete("absent")]) == nil, "deleting an absent key is no change")
        #expect(try write(&c, []) == nil, "an empty batch is no change")
        let plan = try c.plan([.set("theme", value(1.0)), .set("n", value(1))], limits: unlimited)
        #expect(plan.previous == nil, "a batch's reply carries no old value")
        #expect(try c.plan([.set("theme", value("light"))], limits: unlimited).previous == value("light"), "an equal value: the value left in place")
        #expect(c.revision == 2 && c.count == 1 && c["theme"]?.revision == 2)
    }

    @Test func limitsAreCheckedAfterTheRulesAndBeforeAnythingIsApplied() throws {
        var c = core()
        try write(&c, [.set("a", value(1))])
        #expect(throws: WriteRefusal.tooManyKeys(limit: 1)) {
            try c.plan([.set("b", value(1))], limits: WriteLimits(maxKeys: 1, maxRevisionBytes: .max))
        }
        #expect(try c.plan([.set("a", value(2)), .delete("a")].suffix(1), limits: WriteLimits(maxKeys: 1, maxRevisionBytes: .max)).changes.count == 1)
        let big = value(.string(String(repeating: "x", count: 100)))
        #expect(throws: WriteRefusal.revisionTooLarge(bytes: 1 + 100 + 2 + 1 + 32, limit: 64)) {
            try c.plan([.set("a", big)], limits: WriteLimits(maxKeys: 10, maxRevisionBytes: 64))
        }
        #expect(throws: WriteRefusal.conflict(key: "a", expected: 5, actual: 1)) {
            try c.plan([.set("a", big, ifRevision: 5)], limits: WriteLimits(maxKeys: 0, maxRevisionBytes: 0))
        }
        #expect(c.revision == 1 && c["a"]?.value == value(1))
    }

    @Test func aRevisionIsRecordedOnceAsTheEventItsSubscribersGet() throws {
        var c = core()
        try write(&c, [.set("theme", value("light"))])
        try write(&c, [.set("b", value(["x": 1])), .delete("theme"), .set("a\"q", value(nil))], origin: 9)
        let lines = try replay(c, SubscribeRequest(repo: "ui", since: 0, writers: true))
        #expect(lines == [
            #"{"event":"change","sub":7,"by":{"uid":1,"gid":2,"pid":3},"repo":"ui","rev":1,"changes":[{"key":"theme","new":"light"}]}"#,
            #"{"event":"change","sub":7,"by":{"uid":1,"gid":2,"pid":3},"repo":"ui","rev":2,"changes":[{"key":"b","new":{"x":1}},{"key":"theme","old":"light"},{"key":"a\"q","new":null}]}"#,
        ])
        // A selection of some of a revision's changes gets exactly those objects.
        let some = try replay(c, SubscribeRequest(repo: "ui", selection: .keys(["a\"q", "b"]), since: 1))
        #expect(some == [#"{"event":"change","sub":7,"repo":"ui","rev":2,"changes":[{"key":"b","new":{"x":1}},{"key":"a\"q","new":null}]}"#])
        #expect(try replay(c, SubscribeRequest(repo: "ui", selection: .prefix("zz"), since: 0)).isEmpty)
        #expect(try replay(c, SubscribeRequest(repo: "ui", since: 0, echo: false), skip: 9).count == 1, "echo: false skips its own")
        #expect(try replay(c, SubscribeRequest(repo: "ui", since: 0, once: true)).count == 1, "once: one change at most")
        let view = try #require(c.withLastRecord { ($0.revision, $0.changeCount, $0.key(2), $0.info.origin) })
        #expect(view == (2, 3, Key("a\"q"), 9))
    }

    @Test func aSubscriptionStartsFromTheHistoryOrIsToldItIsCompacted() throws {
        var c = core(history: 3)
        for i in 1...5 { try write(&c, [.set("k", value(.int(Int64(i))))], time: Int64(i)) }
        #expect(try replay(c, SubscribeRequest(repo: "ui", since: 2)).count == 3)
        #expect(try replay(c, SubscribeRequest(repo: "ui", since: 5)).isEmpty)
        func compacted(_ request: SubscribeRequest) -> Bool {
            do { _ = try c.start(request, sub: 1, skipOrigin: nil, now: 100); return false } catch {
                if case .compacted = error { return true }
                return false
            }
        }
        #expect(compacted(SubscribeRequest(repo: "ui", since: 1)), "the history starts at revision 3")
        #expect(compacted(SubscribeRequest(repo: "ui", since: 6)), "ahead of the repository")
        #expect(compacted(SubscribeRequest(repo: "ui", since: 4, epoch: "another")), "another history")
        #expect(!compacted(SubscribeRequest(repo: "ui", since: 4, epoch: "e1")))
        let start = try c.start(SubscribeRequest(repo: "ui", initial: true), sub: 1, skipOrigin: nil, now: 100)
        #expect(start.revision == 5 && start.state?.kind == .snapshot && start.state?.keys.count == 1 && start.replay.isEmpty)
        // Age: revisions older than the limit are not served.
        var aged = core(history: 100, maxAge: 10)
        for t in [Int64(1), 50, 95] { try write(&aged, [.set("k", value(.int(t)))], time: t) }
        #expect(aged.history.oldestRevision(now: 100) == 3)
    }

    @Test func revisionsStorageDidNotKeepAreUndoneStateAndHistoryAlike() throws {
        var c = core()
        try write(&c, [.set("a", value(1))])
        for v in 2...3 {
            let plan = try c.plan([.set("a", value(.int(Int64(v)))), .set(Key("n\(v)"), value(true))], limits: unlimited)
            c.commit(plan, time: 0, writer: nil, origin: 0, durable: false)
        }
        #expect(c.revision == 3 && c.pending.count == 2)
        var shown: [UInt64] = []
        #expect(c.confirm(1) { shown.append($0.revision) } == 1)
        #expect(shown == [2])
        let (undone, removedFirst, movedBack) = c.undo(last: c.pendingChanges)
        #expect(undone == 1 && !removedFirst && movedBack.isEmpty)
        #expect(c.revision == 2 && c["a"]?.value == value(2) && c["n3"] == nil && c["n2"] != nil)
        #expect(c.history.newest == 2)
        #expect(try write(&c, [.set("a", value(9))]) == 3, "the next write takes the undone revision's number")
    }

    @Test func attachmentsFollowTheLastSetOfAKey() throws {
        var c = core()
        let ops: [WriteOp<CanonicalJSON>] = [.set("x", value(1)), .set("y", value(1)), .set("z", value(1))]
        try write(&c, ops)
        var moves = c.attach(ops, leases: [7, 7, nil])
        #expect(moves.map(\.key) == ["x", "y"] && moves.allSatisfy { $0.from == nil && $0.to == 7 })
        moves = c.attach([.set("x", value(1)), .delete("y")], leases: [])
        #expect(moves.map(\.key) == ["x", "y"] && moves.allSatisfy { $0.from == 7 && $0.to == nil })
        _ = c.attach([.set("z", value(1))], leases: [7])
        _ = c.attach([.set("x", value(1))], leases: [7])
        #expect(c.keys(attachedTo: 7) == ["x", "z"], "existing keys still attached, in byte order")
        c.detach("x", from: 7)
        #expect(c.lease(of: "x") == nil && c.lease(of: "z") == 7 && c.keys(attachedTo: 7) == ["z"])
    }

    /// A revision storage did not keep takes back the lease attachments its write made —
    /// unless a later write moved the key on — and says which, for the lease table.
    @Test func anUndoneRevisionMovesItsKeysBackToTheLeasesTheyHadBefore() throws {
        var c = core()
        try write(&c, [.set("a", value(1)), .set("b", value(1)), .set("c", value(1))])
        _ = c.attach([.set("c", value(1))], leases: [5])
        // Revision 2 attaches a and c to lease 7 (c from 5); revision 3 moves b to 8.
        let ops2: [WriteOp<CanonicalJSON>] = [.set("a", value(2)), .set("c", value(2))]
        let moves2 = c.attach(ops2, leases: [7, 7])
        c.commit(try c.plan(ops2, limits: unlimited), time: 0, writer: nil, origin: 0, durable: false, moves: moves2)
        let ops3: [WriteOp<CanonicalJSON>] = [.set("b", value(3))]
        let moves3 = c.attach(ops3, leases: [8])
        c.commit(try c.plan(ops3, limits: unlimited), time: 0, writer: nil, origin: 0, durable: false, moves: moves3)
        // An equal write (no revision) moves a on to lease 9 after revision 2 attached it;
        // durable at once (it is not undone with them).
        _ = c.attach([.set("a", value(2))], leases: [9])

        let (undone, _, movedBack) = c.undo(last: c.pendingChanges)
        #expect(undone == 2)
        #expect(c.lease(of: "b") == nil, "revision 3's attachment taken back")
        #expect(c.lease(of: "c") == 5, "back to the lease it had before revision 2")
        #expect(c.lease(of: "a") == 9, "a later write moved it on: it stays")
        #expect(movedBack.map(\.key) == ["b", "c"])
        #expect(movedBack.map(\.from) == [8, 7] && movedBack.map(\.to) == [nil, 5])
        #expect(c.keys(attachedTo: 7).isEmpty, "lease 7's end would delete nothing")
    }

    /// Attachments a write moved without a revision are pending like one: undone with the
    /// changes after them, in order, confirmed in order — and move the key back.
    @Test func attachmentsMovedWithoutARevisionAreUndoneAndConfirmedInOrder() throws {
        var c = core()
        try write(&c, [.set("a", value(1)), .set("b", value(1))])
        let equal: [WriteOp<CanonicalJSON>] = [.set("a", value(1))]
        c.recordAttachments(c.attach(equal, leases: [4]), durable: false)
        let ops: [WriteOp<CanonicalJSON>] = [.set("b", value(2))]
        let moves = c.attach(ops, leases: [5])
        c.commit(try c.plan(ops, limits: unlimited), time: 0, writer: nil, origin: 0, durable: false, moves: moves)
        c.recordAttachments(c.attach([.set("b", value(2))], leases: [6]), durable: false)
        #expect(c.pendingChanges == 3 && c.pending.count == 1)
        #expect(c.keys(attachedTo: 4) == ["a"] && c.keys(attachedTo: 6) == ["b"])
        // The newest two undone: b back to lease 5, then to none (with its revision).
        let (undone, _, movedBack) = c.undo(last: 2)
        #expect(undone == 1 && c.revision == 1 && c["b"]?.value == value(1))
        #expect(movedBack.map(\.key) == ["b", "b"] && movedBack.map(\.to) == [5, nil])
        #expect(c.lease(of: "a") == 4 && c.lease(of: "b") == nil && c.keys(attachedTo: 5).isEmpty)
        var shown: [UInt64] = []
        #expect(c.confirm(1) { shown.append($0.revision) } == 0 && shown.isEmpty, "the first is no revision")
        #expect(c.pendingChanges == 0)
    }

    /// Random writes, batches, deletes and undos against a dictionary: the core's state, its
    /// revisions and its replayed history agree with the model's every step.
    @Test func aRandomWorkloadAgreesWithADictionaryModel() throws {
        var rng = SplitMix(seed: 20261125)
        var c = core(history: 1000)
        var model: [Key: (value: JSONValue, revision: UInt64)] = [:]
        var revisions: [(UInt64, [Key])] = []
        for _ in 0..<3000 {
            let n = Int(rng.next() % 3) + 1
            var keys: [Key] = []
            var ops: [WriteOp<CanonicalJSON>] = []
            for _ in 0..<n {
                let key = Key("k\(rng.next() % 20)")
                guard !keys.contains(key) else { continue }
                keys.append(key)
                if rng.next() % 4 == 0 {
                    ops.append(.delete(key))
                } else {
                    ops.append(.set(key, value(.int(Int64(rng.next() % 5)))))
                }
            }
            let before = c.revision
            let revision = try write(&c, ops)
            var changed: [Key] = []
            for op in ops {
                switch op {
                case .set(let key, let v, _, _):
                    if model[key]?.value != v.json { changed.append(key); model[key] = (v.json, before + 1) }
                case .delete(let key, _):
                    if model.removeValue(forKey: key) != nil { changed.append(key) }
                }
            }
            #expect(revision == (changed.isEmpty ? nil : before + 1))
            if let revision { revisions.append((revision, changed)) }
        }
        #expect(c.count == model.count)
        for (key, entry) in model { #expect(c[key]?.value.json == entry.value && c[key]?.revision == entry.revision, "\(key)") }
        let tail = try replay(c, SubscribeRequest(repo: "ui", since: c.revision - 500))
        #expect(tail.count == 500)
        for (line, (revision, keys)) in zip(tail, revisions.suffix(500)) {
            let event = try JSONParser.parse(line).objectValue
            #expect(event?["rev"]?.uint64Value == revision)
            #expect(event?["changes"]?.arrayValue?.compactMap { $0.objectValue?["key"]?.stringValue } == keys.map(\.string))
        }
    }
}

/// A small deterministic random source.
struct SplitMix: RandomNumberGenerator {
    var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
