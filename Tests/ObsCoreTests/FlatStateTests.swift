// Tests of the value core's flat state — the daemon's write rules, on its operations' bytes —
// against ObservableKit's `KeyedState`, which keeps the same rules for observation in process:
// random batches (conditions, forced and equal writes, deletions of absent keys, values equal
// as JSON but not as bytes) must plan the same changes or the same refusal, install to the
// same state, and undo to the same state. (A batch naming a key twice is the protocol
// decoder's to refuse: none is generated.)

import ObsCore
import ObsStore
import ObsValues
import ObservableKit
import TestSupport
import Testing

@Suite(.mayBlock) struct FlatStateTests {
    /// Values with twins that are equal as JSON but differ in bytes.
    static let values: [CanonicalJSON] = [
        CanonicalJSON(.int(1)), CanonicalJSON(.double(1.0)), CanonicalJSON(.double(1.5)), CanonicalJSON(.string("a")),
        CanonicalJSON(.string(String(repeating: "long ", count: 40))), CanonicalJSON(.null), CanonicalJSON(.bool(true)),
        CanonicalJSON(.object(JSONObject(uniqueMembers: [("a", .int(1)), ("b", .int(2))]))),
        CanonicalJSON(.object(JSONObject(uniqueMembers: [("b", .int(2)), ("a", .int(1))]))),
        CanonicalJSON(.array([.int(1), .double(2.5)])),
    ]

    func entries(_ state: FlatState) -> [Key: Entry<CanonicalJSON>] {
        var all: [Key: Entry<CanonicalJSON>] = [:]
        state.forEach { all[$0.key] = $0.entry }
        return all
    }

    @Test(arguments: [11 as UInt64, 12, 13])
    func randomBatchesMatchKeyedState(seed: UInt64) {
        var rng = SeededGenerator(seed: seed)
        var flat = FlatState()
        var model = KeyedState<CanonicalJSON>()
        var undo: [[(key: Key, entry: Entry<CanonicalJSON>?)]] = []
        for step in 0..<4_000 {
            var ops: [WriteOp<CanonicalJSON>] = []
            for _ in 0..<Int.random(in: 0...4, using: &rng) {
                let key = Key("k\(Int.random(in: 0..<12, using: &rng))")
                guard !ops.contains(where: { $0.key == key }) else { continue }
                let condition: UInt64? =
                    switch Int.random(in: 0..<6, using: &rng) {
                    case 0: 0
                    case 1: model[key]?.revision ?? UInt64.random(in: 1...5, using: &rng)
                    case 2: UInt64.random(in: 1...(model.revision + 1), using: &rng)
                    default: nil
                    }
                if Int.random(in: 0..<4, using: &rng) == 0 {
                    ops.append(.delete(key, ifRevision: condition))
                } else {
                    let value = Self.values.randomElement(using: &rng)!
                    ops.append(.set(key, value, ifRevision: condition, force: Int.random(in: 0..<8, using: &rng) == 0))
                }
            }
            let expected = Result { () throws(WriteError) in try model.plan(ops) }
            let actual = WriteOps(ops).withRawOps { raw in
                Result { () throws(WriteError) -> [Change<CanonicalJSON>] in
                    var buffer = OpPlanBuffer()
                    let plans = buffer.room(for: raw.count)
                    do throws(WriteRefusal) { try flat.plan(raw, into: plans) } catch {
                        // The same verdict in the model's terms (a flat state refuses only conditions).
                        guard case .conflict(let key, let expected, let actual) = error else { preconditionFailure("\(error)") }
                        throw .conflict(key: key, expected: expected, actual: actual)
                    }
                    return RepositoryCore.withChanges(raw, plans, changed: plans.filter(\.changes).count) { $0.map(\.materialized) }
                }
            }
            switch (expected, actual) {
            case (.success(let a), .success(let b)): #expect(a == b, "step \(step): \(ops)")
            case (.failure(let a), .failure(let b)): #expect(a == b, "step \(step): \(ops)")
            default: Issue.record("step \(step): \(expected) against \(actual) for \(ops)")
            }
            guard case .success(let changes) = expected, !changes.isEmpty else { continue }
            if Int.random(in: 0..<5, using: &rng) == 0, let previous = undo.popLast() {
                // Undo the newest revision instead, on both.
                flat.undoLast(restoring: previous)
                model.undoLast(restoring: previous)
            } else {
                undo.append(changes.map { ($0.key, model[$0.key]) })
                let replaced = flat.entries(replacedBy: changes)
                #expect(replaced.map(\.key) == undo.last!.map(\.key) && replaced.map(\.entry) == undo.last!.map(\.entry), "step \(step)")
                let changeSet = ChangeSet(revision: model.revision + 1, changes: changes)
                let installed = (flat.install(changeSet), model.install(changeSet))
                #expect(installed == (true, true))
            }
            #expect(flat.revision == model.revision && flat.count == model.entries.count)
            if step % 50 == 0 { #expect(entries(flat) == model.entries, "step \(step)") }
        }
        #expect(entries(flat) == model.entries)
        let refused = flat.install(ChangeSet(revision: flat.revision, changes: []))
        #expect(!refused, "a revision not above the current one is refused")
    }
}
