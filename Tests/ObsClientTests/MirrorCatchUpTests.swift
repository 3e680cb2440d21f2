// Tests of how a mirror's state takes a catch-up, a snapshot after a resume, and a `sync`
// (MirrorState), without a daemon: a catch-up sets and removes in place and counts as
// written only the keys whose value it changed; it is state at its revision, so it replaces
// an own write it covers and leaves one made after it; a snapshot reports the keys whose
// value (or lease end) differs; a `sync` moves the revision forward only.

@testable import ObsClient
import ObsProtocol
import ObservableKit
import Testing

func catchUp(from: UInt64, _ revision: UInt64, _ values: [(Key, JSONValue)], deleted: [Key] = []) -> WatchEvent {
    .catchUp(CatchUpEvent(subscription: 1, repository: "ui", from: from, revision: revision, entries: values.map { ($0.0, $0.1) }, deleted: deleted))
}

@Suite struct MirrorCatchUpTests {
    @Test func aCatchUpSetsAndRemovesInPlaceAndCountsOnlyWhatItChanged() {
        var state = MirrorState(selection: .prefix("k"))
        _ = state.apply(.snapshot(revision: 5, values: ["k1": 1, "k2": 2, "k3": 3, "k4": 4], resync: false), connection: 1)
        // k2 changed, k3 written back to its value, k5 new, k1 deleted, k9 created and deleted
        // again; x is not selected.
        let written = state.apply(catchUp(from: 5, 9, [("k2", 20), ("k3", 3), ("k5", 5), ("x", 0)], deleted: ["k1", "k9"]), connection: 2)
        #expect(Set(written) == ["k1", "k2", "k5"])
        #expect(state.values == ["k2": 20, "k3": 3, "k4": 4, "k5": 5] && state.revision == 9)
        // A later event of the resumed subscription applies on top, by revision.
        #expect(state.apply(change(10, [Change(key: "k3", old: 3, new: 30)]), connection: 2) == ["k3"])
        #expect(state.apply(change(9, [Change(key: "k2", old: 2, new: 21)]), connection: 2) == [], "a key it set is at its revision")
    }

    @Test func anEmptyCatchUpMovesTheRevisionOnly() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 5, values: ["a": 1], resync: false), connection: 1)
        #expect(state.apply(catchUp(from: 5, 12, []), connection: 2) == [])
        #expect(state.values == ["a": 1] && state.revision == 12)
    }

    @Test func aCatchUpIsStateAtItsRevisionForOwnWritesToo() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 5, values: ["a": 1, "b": 1], resync: false), connection: 1)
        // Own writes on the resumed connection: one the catch-up covers (7 ≤ 9), whose key
        // another writer changed after it, and one made after the catch-up's revision.
        _ = state.apply(write(7, [("a", "mine")], connection: 2))
        _ = state.apply(write(11, [("b", "mine")], connection: 2))
        let written = state.apply(catchUp(from: 5, 9, [("a", "theirs"), ("b", "older")]), connection: 2)
        #expect(written == ["a"], "b's own write at 11 is newer than the state at 9")
        #expect(state.values == ["a": "theirs", "b": "mine"] && state.revision == 11)
    }

    @Test func aCatchUpDeletionKeepsATombstoneAndClearsALeaseEnd() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 1, values: ["a": 1, "b": 1], resync: false), connection: 1)
        _ = state.apply(
            .change(ChangeEvent(subscription: 1, repository: "ui", revision: 2, changes: [Change(key: "b", old: 1, new: nil)], lease: LeaseEnd(lease: 3, reason: .closed))),
            connection: 1)
        #expect(state.leaseEnds["b"] == LeaseEnd(lease: 3, reason: .closed))
        #expect(state.apply(catchUp(from: 2, 6, [("b", 2)], deleted: ["a"]), connection: 2) == ["b", "a"])
        #expect(state.values == ["b": 2] && state.leaseEnds.isEmpty)
        // A late reply of an older write does not bring the deleted key back.
        #expect(state.apply(write(4, [("a", 9)], connection: 2)) == [])
        #expect(state.values == ["b": 2])
    }

    @Test func aSnapshotReportsTheKeysWhoseValueOrLeaseEndDiffers() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 1, values: ["a": 1, "b": 2, "c": 3], resync: false), connection: 1)
        _ = state.apply(
            .change(ChangeEvent(subscription: 1, repository: "ui", revision: 2, changes: [Change(key: "d", old: 1, new: nil)], lease: LeaseEnd(lease: 3, reason: .expired))),
            connection: 1)
        let changed = state.apply(.snapshot(revision: 7, values: ["a": 1, "b": 20, "e": 5], resync: true), connection: 2)
        #expect(Set(changed) == ["b", "c", "d", "e"], "a is unchanged; d's lease end is gone")
        #expect(state.values == ["a": 1, "b": 20, "e": 5] && state.revision == 7)
    }

    @Test func syncMovesTheRevisionForwardOnly() {
        var state = MirrorState(selection: .keys(["a"]))
        _ = state.apply(.snapshot(revision: 3, values: ["a": 1], resync: false), connection: 1)
        state.markCurrent(at: 10, connection: 1)
        #expect(state.revision == 10 && state.values == ["a": 1])
        state.markCurrent(at: 8, connection: 1)
        #expect(state.revision == 10, "an older answer does not move it back")
        #expect(state.apply(change(9, [Change(key: "a", old: 1, new: 2)]), connection: 1) == ["a"], "a value is still taken by its own stamp")
        #expect(state.revision == 10)
    }
}
