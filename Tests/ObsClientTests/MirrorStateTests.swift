// Tests of how a mirror merges its watch's events with the writes made through its
// session (MirrorState), without a daemon: with `echo: false` its own writes arrive only
// from their replies, in any order relative to other writers' events; coalesced events
// carry several revisions; a snapshot keeps only the writes it cannot hold. A randomized
// model of a daemon checks that whatever the interleaving, the mirror ends with the
// daemon's state.

@testable import ObsClient
import ObsProtocol
import ObservableKit
import Testing

func change(_ revision: UInt64, _ changes: [Change<JSONValue>], from: UInt64? = nil) -> WatchEvent {
    .change(ChangeEvent(revision: revision, changes: changes, from: from))
}

func write(_ revision: UInt64, _ effects: [(Key, JSONValue?)], connection: UInt64 = 1, repository: String = "ui") -> LocalWrite {
    LocalWrite(
        repository: repository, revision: revision, effects: effects.map { LocalWrite.Effect(key: $0.0, new: $0.1) },
        connection: connection)
}

@Suite struct MirrorStateTests {
    @Test func anOwnWriteIsNotUndoneByAnOlderEventReadAfterItsReply() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 4, values: ["theme": "light"], resync: false), connection: 1)
        #expect(state.apply(write(6, [("theme", "dark")])) == ["theme"])
        // Another writer's revision 5 of the same key, read after our reply for 6.
        #expect(state.apply(change(5, [Change(key: "theme", old: "light", new: "blue")]), connection: 1) == [])
        #expect(state.values == ["theme": "dark"] && state.revision == 6)
        // An echo of our own write (a daemon or an option that echoes) changes nothing.
        #expect(state.apply(change(6, [Change(key: "theme", old: "blue", new: "dark")]), connection: 1) == [])
        #expect(state.apply(change(7, [Change(key: "theme", old: "dark", new: "red")]), connection: 1) == ["theme"])
        #expect(state.values == ["theme": "red"] && state.revision == 7)
    }

    @Test func aLateReplyDoesNotBringBackAKeyALaterRevisionDeleted() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 1, values: ["a": 1], resync: false), connection: 1)
        _ = state.apply(change(3, [Change(key: "a", old: 2, new: nil)]), connection: 1)
        #expect(state.apply(write(2, [("a", 2)])) == [], "our revision 2 is older than the deletion at 3")
        #expect(state.values.isEmpty && state.revision == 3)
    }

    @Test func aCoalescedEventBringsTheMirrorToTheStateAtItsRevision() {
        var state = MirrorState(selection: .prefix("k"))
        _ = state.apply(.snapshot(revision: 10, values: ["k1": 1, "k2": 2, "k3": 3], resync: false), connection: 1)
        _ = state.apply(write(12, [("k4", 40)]))  // ours, not echoed
        // Revisions 11–15 coalesced: k1 changed, k2 deleted, k3 changed and back (left out),
        // k4 written by us at 12 and by another writer at 14.
        let coalesced = change(
            15, [Change(key: "k1", old: 1, new: 11), Change(key: "k2", old: 2, new: nil), Change(key: "k4", old: nil, new: 44)],
            from: 11)
        #expect(state.apply(coalesced, connection: 1) == ["k1", "k2", "k4"])
        #expect(state.values == ["k1": 11, "k3": 3, "k4": 44] && state.revision == 15)
    }

    @Test func writesToKeysTheMirrorDoesNotSelectAreIgnored() {
        var state = MirrorState(selection: .prefix("win/"))
        _ = state.apply(.snapshot(revision: 3, values: [:], resync: false), connection: 1)
        #expect(state.apply(write(4, [("other", 1)])) == [])
        #expect(state.revision == 3, "the mirror's revision moves with its own keys only")
        #expect(state.apply(write(5, [("other", 2), ("win/1", "open")])) == ["win/1"])
        #expect(state.values == ["win/1": "open"] && state.revision == 5)
    }

    @Test func aSnapshotKeepsOnlyTheWritesItCannotHold() {
        var state = MirrorState(selection: .all)
        _ = state.apply(write(3, [("before", 1)], connection: 2))  // before the subscription: in the snapshot
        _ = state.apply(write(9, [("after", 1), ("gone", nil)], connection: 2))  // after it, on its connection
        _ = state.apply(write(8, [("old", 1)], connection: 1))  // on an earlier connection
        _ = state.apply(.snapshot(revision: 5, values: ["before": 1, "gone": 0, "x": 0], resync: false), connection: 2)
        #expect(state.values == ["before": 1, "after": 1, "x": 0], "the deletion at 9 stays; connection 1's write is dropped")
        #expect(state.revision == 9 && state.isLoaded)
        #expect(state.stamps["gone"] == MirrorState.Stamp(revision: 9, connection: 2))

        // A resync from a daemon that lost its history: revisions start again lower.
        _ = state.apply(.snapshot(revision: 2, values: ["x": 5], resync: true), connection: 3)
        #expect(state.values == ["x": 5] && state.revision == 2 && state.stamps.count == 1)
        #expect(state.apply(change(3, [Change(key: "after", old: nil, new: 7)]), connection: 3) == ["after"])
    }

    /// A daemon's history written by this process (connection 1) and by others, delivered to
    /// the mirror as a subscription with `echo: false` would see it — other writers'
    /// revisions as events, one by one or coalesced over a stretch — while the replies of
    /// our writes are read at any moment after they were made.
    @Test(arguments: 0..<200)
    func whateverTheInterleavingTheMirrorEndsWithTheDaemonsState(seed: UInt64) {
        var random = SplitMix64(seed: seed)
        let keys: [Key] = ["a", "b", "c", "d"]
        var daemon: [Key: JSONValue] = ["a": 0, "b": 0]
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 0, values: daemon, resync: false), connection: 1)
        var revision: UInt64 = 0
        var lastSent = daemon  // what the subscription last delivered, per key
        var coalescingFrom: UInt64?  // set while the subscription lags
        var replies: [LocalWrite] = []  // our writes whose replies are not read yet

        func sendCoalesced() {
            guard let from = coalescingFrom else { return }
            coalescingFrom = nil
            let changes = keys.compactMap { key -> Change<JSONValue>? in
                lastSent[key] == daemon[key] ? nil : Change(key: key, old: lastSent[key], new: daemon[key])
            }
            lastSent = daemon
            if !changes.isEmpty { _ = state.apply(change(revision, changes, from: from), connection: 1) }
        }

        for _ in 0..<60 {
            let key = keys[Int(random.next() % 4)]
            let value: JSONValue? = random.next() % 4 == 0 ? nil : .int(Int64(random.next() % 5))
            let ours = random.next() % 2 == 0
            guard daemon[key] != value else { continue }  // no change, no revision
            let old = daemon[key]
            daemon[key] = value
            revision += 1
            if ours {
                replies.append(write(revision, [(key, value)]))
                // echo: false — the subscription is sent no event, and the daemon counts the
                // value as received (the client has it from the reply): a later coalesced
                // event compares against it. (Were it compared against the value last *sent*,
                // another writer putting that value back would be left out as "changed back",
                // and the mirror would keep our overwritten value: seed 108 shows it.)
                lastSent[key] = value
            } else if coalescingFrom != nil || random.next() % 3 == 0 {
                if coalescingFrom == nil { coalescingFrom = revision }
            } else {
                lastSent[key] = value
                _ = state.apply(change(revision, [Change(key: key, old: old, new: value)]), connection: 1)
            }
            if coalescingFrom != nil, random.next() % 4 == 0 { sendCoalesced() }
            // Read some replies, in order, at random moments.
            while !replies.isEmpty, random.next() % 3 == 0 { _ = state.apply(replies.removeFirst()) }
        }
        sendCoalesced()
        for reply in replies { _ = state.apply(reply) }
        #expect(state.values == daemon, "seed \(seed)")
    }
}

/// A small deterministic random number generator (SplitMix64).
struct SplitMix64: RandomNumberGenerator {
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
