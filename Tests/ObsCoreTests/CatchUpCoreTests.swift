// Catch-up in the value core: tombstones kept by every write, undo and install; how a
// subscription that asked for `catchup` is brought up to the current revision (a replay, a
// diff of the keys changed and deleted since, or a snapshot); and a reader that reads the
// state of one revision while writes go on.

import ObsCore
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Testing
import TestSupport

private let unlimited = WriteLimits(maxKeys: .max, maxRevisionBytes: .max)
private func value(_ v: Int64) -> CanonicalJSON { CanonicalJSON(.int(v)) }

private func core(history: Int = 2, tombstones: Int = Tombstones.defaultLimit) -> RepositoryCore {
    RepositoryCore(name: "ui", epoch: "e1", historyLimits: HistoryLimits(count: history, maxBytes: 1 << 30, maxAge: nil, tombstones: tombstones))
}

@discardableResult
private func write(_ c: inout RepositoryCore, _ ops: [WriteOp<CanonicalJSON>], durable: Bool = true) throws -> UInt64? {
    let plan = try c.plan(ops, limits: unlimited)
    guard !plan.changes.isEmpty else { return nil }
    return c.commit(plan, time: 100, writer: nil, origin: 0, durable: durable).revision
}

/// The state a start sends, as key → value text, read in one go (with `reader`, if given).
private func members(_ c: RepositoryCore, _ keys: KeyList, reader: UInt64? = nil) -> [String: String] {
    var bytes: [UInt8] = [UInt8(ascii: "{")]
    _ = c.writeMembers(of: keys.sorted(), from: 0, reader: reader, maxBytes: .max, first: true, into: &bytes)
    bytes.append(UInt8(ascii: "}"))
    guard case .object(let object) = try? bytes.withUnsafeBytes({ try JSONParser.parse($0) }) else { return ["": "unreadable"] }
    return Dictionary(uniqueKeysWithValues: object.members.map { ($0.name, $0.value.jsonText) })
}

private func start(_ c: RepositoryCore, since: UInt64, epoch: String? = nil, keys: Set<Key>? = nil) throws -> RepositoryCore.Start {
    let selection: Selection = keys.map { .keys($0) } ?? .all
    return try c.start(SubscribeRequest(repo: "ui", selection: selection, since: since, epoch: epoch, catchup: true), sub: 1, skipOrigin: nil, now: 100)
}

@Suite(.mayBlock) struct CatchUpCoreTests {
    @Test func aDeletionLeavesATombstoneThatARecreationTakesAway() throws {
        var c = core()
        try write(&c, [.set("a", value(1)), .set("b", value(1))])
        try write(&c, [.delete("a")])
        #expect(c.tombstones["a"] == 2)
        #expect(c.tombstones.count == 1)
        try write(&c, [.set("a", value(2))])
        #expect(c.tombstones["a"] == nil)
        try write(&c, [.delete("a"), .delete("b")])
        #expect(c.tombstones["a"] == 4)
        #expect(c.tombstones["b"] == 4)
        try write(&c, [.delete("zz")])  // absent: no change, no tombstone
        #expect(c.tombstones["zz"] == nil)
    }

    @Test func anUndoPutsTheTombstonesBackAsTheyWere() throws {
        var c = core()
        try write(&c, [.set("a", value(1)), .set("b", value(1))])
        try write(&c, [.delete("a")])
        try write(&c, [.set("a", value(2)), .delete("b")], durable: false)  // re-creates a, deletes b
        #expect(c.tombstones["a"] == nil)
        #expect(c.tombstones["b"] == 3)
        c.undo(last: 1)
        #expect(c.tombstones["a"] == 2, "the creation undone: a's tombstone is back")
        #expect(c.tombstones["b"] == nil, "the deletion undone: b exists again")
        #expect(c["b"] != nil && c["a"] == nil)
    }

    @Test func installedRevisionsKeepTombstonesToo() throws {
        var c = core()
        func install(_ change: Change<CanonicalJSON>, _ revision: UInt64) -> Bool {
            c.install([change], info: RevisionInfo(revision: revision, time: Int64(revision), writer: nil, origin: 0, weight: 1))
        }
        #expect(install(Change(key: "a", old: nil, new: value(1)), 1))
        #expect(install(Change(key: "a", old: value(1), new: nil), 2))
        #expect(c.tombstones["a"] == 2)
        #expect(install(Change(key: "a", old: nil, new: value(3)), 3))
        #expect(c.tombstones["a"] == nil)
    }

    /// What etcd mode's commit relies on: `planned` tells the floor the same steps leave
    /// when applied, whatever the limit, the stale entries, re-creations and ties.
    @Test func plannedStepsLeaveTheFloorTheirApplicationLeaves() {
        var rng = SeededGenerator(seed: 0x70_6D_62)
        for round in 0..<300 {
            let limit = [0, 1, 3, 8, 50][round % 5]
            var tombstones = Tombstones(limit: limit, floor: UInt64(round % 3))
            var revision: UInt64 = 3
            var absent = Set<Key>()
            // A history first (stale entries in the order included), then a planned run.
            for phase in 0..<2 {
                var steps: [Tombstones.Step] = []
                for _ in 0..<Int.random(in: 0...40, using: &rng) {
                    let key = Key("k\(Int.random(in: 0..<20, using: &rng))")
                    if absent.contains(key) {
                        steps.append(.recreated(key))
                        absent.remove(key)
                    } else {
                        if Bool.random(using: &rng) { revision += 1 }  // else another deletion of the same revision
                        steps.append(.deleted(key, at: revision))
                        absent.insert(key)
                    }
                }
                let planned = tombstones.planned(steps)
                for step in steps {
                    switch step {
                    case .deleted(let key, let at): tombstones.deleted(key, at: at)
                    case .recreated(let key): tombstones.remove(key)
                    }
                }
                #expect(planned == tombstones.floor, "round \(round), phase \(phase), limit \(limit)")
                #expect(tombstones.count <= max(limit, 0))
            }
        }
    }

    @Test func withinTheHistoryACatchUpIsAReplay() throws {
        var c = core(history: 10)
        for i in 1...3 { try write(&c, [.set("k", value(Int64(i)))]) }
        let s = try start(c, since: 1)
        #expect(s.catchUp == .replay && s.replayed == 2 && s.state == nil)
        let plain = try c.start(SubscribeRequest(repo: "ui", since: 1), sub: 1, skipOrigin: nil, now: 100)
        #expect(plain.catchUp == nil && plain.replay == s.replay, "a plain since replays the same")
    }

    @Test func pastTheHistoryACatchUpIsADiffOfWhatChangedAndWhatWasDeleted() throws {
        var c = core(history: 2)
        try write(&c, [.set("same", value(0)), .set("gone", value(0)), .set("back", value(0)), .set("moved", value(0))])  // 1
        try write(&c, [.set("moved", value(1))])  // 2
        try write(&c, [.delete("gone")])  // 3
        try write(&c, [.set("back", value(9))])  // 4
        try write(&c, [.set("back", value(0)), .set("new", value(5))])  // 5: back to its value at 1
        try write(&c, [.set("temp", value(1))])  // 6
        try write(&c, [.delete("temp")])  // 7
        #expect(throws: RepositoryCore.StartRefusal.self) {
            try c.start(SubscribeRequest(repo: "ui", since: 1), sub: 1, skipOrigin: nil, now: 100)
        }
        let s = try start(c, since: 1, epoch: "e1")
        guard case .diff(let from, let deleted) = s.state?.kind else { Issue.record("not a diff: \(s)"); return }
        #expect(s.catchUp == .diff && from == 1 && s.revision == 7)
        #expect(deleted == ["gone", "temp"], "the deleted keys in byte order (temp: created and deleted again, allowed)")
        #expect(members(c, s.state!.keys) == ["moved": "1", "back": "0", "new": "5"], "changed after 1, even back to the old value; same is left out")
        // A selection: only its keys.
        let selected = try start(c, since: 1, keys: ["gone", "same", "back"])
        guard case .diff(_, let selectedDeleted) = selected.state?.kind else { Issue.record("not a diff"); return }
        #expect(selectedDeleted == ["gone"] && members(c, selected.state!.keys) == ["back": "0"])
    }

    @Test func anotherHistoryAFutureRevisionOrForgottenDeletionsGetASnapshot() throws {
        var c = core(history: 1, tombstones: 2)
        try write(&c, [.set("a", value(1)), .set("b", value(1)), .set("c", value(1)), .set("d", value(1))])  // 1
        #expect(try start(c, since: 0, epoch: "other").catchUp == .snapshot, "another epoch")
        #expect(try start(c, since: 5).catchUp == .snapshot, "ahead of the repository")
        try write(&c, [.delete("a")])  // 2
        try write(&c, [.delete("b")])  // 3
        try write(&c, [.delete("c")])  // 4: a's tombstone forgotten (bound 2)
        #expect(c.tombstones.floor == 2)
        #expect(c.tombstones.count == 2)
        let old = try start(c, since: 1)
        #expect(old.catchUp == .snapshot && old.state?.kind == .snapshot, "the deletion at 2 is forgotten")
        #expect(members(c, old.state!.keys) == ["d": "1"])
        let recent = try start(c, since: 2)
        guard case .diff(_, let deleted) = recent.state?.kind else { Issue.record("not a diff"); return }
        #expect(deleted == ["b", "c"])
    }

    @Test func aReaderReadsItsRevisionWhileWritesGoOn() throws {
        var c = core()
        try write(&c, [.set("a", value(1)), .set("b", value(1)), .set("c", value(1))])
        let keys = c.keys(.all)
        let reader = c.openReader()
        try write(&c, [.set("a", value(2)), .delete("b"), .set("new", value(1))])
        try write(&c, [.set("a", value(3)), .set("b", value(5))])
        #expect(members(c, keys, reader: reader) == ["a": "1", "b": "1", "c": "1"], "the values at the reader's revision")
        #expect(members(c, keys) == ["a": "3", "b": "5", "c": "1"], "without the reader: as they are now")
        // Read in pieces: each key once, whatever the piece size.
        var bytes: [UInt8] = []
        var next = 0
        var first = true
        let sorted = keys.sorted()
        while next < sorted.count {
            let before = bytes.count
            next = c.writeMembers(of: sorted, from: next, reader: reader, maxBytes: 1, first: first, into: &bytes)
            if bytes.count > before { first = false }
        }
        #expect(String(decoding: bytes, as: UTF8.self) == #""a":1,"b":1,"c":1"#)
        c.closeReader(reader)
        #expect(c.openReaders == 0)
    }
}
