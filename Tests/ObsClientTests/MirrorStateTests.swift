// Tests of how a mirror merges its watch's events with the writes made through its
// session (MirrorState), without a daemon: with `echo: false` its own writes arrive only
// from their replies, in any order relative to other writers' events; coalesced events
// carry several revisions; a snapshot keeps only the writes it cannot hold; revisions of
// another history (a daemon restarted in memory) do not compare; tombstones are bounded.
// Randomized models of a daemon check that whatever the interleaving — on one connection,
// and across reconnections and restarts — the mirror ends with the daemon's state.

@testable import ObsClient
import ObsProtocol
import ObservableKit
import Testing

func change(_ revision: UInt64, _ changes: [Change<JSONValue>], from: UInt64? = nil) -> WatchEvent {
    .change(ChangeEvent(subscription: 1, repository: "ui", revision: revision, changes: changes, from: from))
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
        #expect(state.tombstones["gone"] == MirrorState.Stamp(revision: 9, connection: 2, own: true))

        // A resync from a daemon that lost its history: revisions start again lower.
        _ = state.apply(.snapshot(revision: 2, values: ["x": 5], resync: true), connection: 3)
        #expect(state.values == ["x": 5] && state.revision == 2 && state.stamps.count == 1 && state.tombstoneCount == 0)
        #expect(state.apply(change(3, [Change(key: "after", old: nil, new: 7)]), connection: 3) == ["after"])
    }

    @Test func theTombstonesOfChurningKeysAreBounded() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 0, values: [:], resync: false), connection: 1)
        var revision: UInt64 = 0
        for i in 0..<20_000 {  // each key created and deleted, and never seen again: by others, and by us
            let key = Key("k\(i)")
            if i % 2 == 0 {
                _ = state.apply(change(revision + 1, [Change(key: key, old: nil, new: 1)]), connection: 1)
                _ = state.apply(change(revision + 2, [Change(key: key, old: 1, new: nil)]), connection: 1)
            } else {
                _ = state.apply(write(revision + 1, [(key, 1)]))
                _ = state.apply(write(revision + 2, [(key, nil)]))
            }
            revision += 2
        }
        #expect(state.values.isEmpty && state.revision == revision)
        #expect(state.tombstoneCount <= 4096, "bounded, not one per key deleted")
        // The newest deletions still hold: an older message read late does not bring their keys back.
        #expect(state.apply(change(revision - 1, [Change(key: "k19999", old: nil, new: 2)]), connection: 1) == [])
        #expect(state.apply(write(revision - 3, [("k19998", 2)])) == [])
        #expect(state.values.isEmpty)
    }

    @Test func aWriteInANewHistoryIsShownAtOnceAndKeptByTheResync() {
        // History A: the mirror holds k at revision 41, read on connection 1.
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 40, values: ["k": "a40", "other": 1], resync: false), connection: 1)
        _ = state.apply(change(41, [Change(key: "k", old: "a40", new: "a41")]), connection: 1)
        // The daemon restarted in memory (history B counts from 0 again); the session's
        // connection 2 writes k at revision 1 before the watch has resubscribed there.
        #expect(state.apply(write(1, [("k", "b1")], connection: 2)) == ["k"], "newer than anything read on connection 1")
        #expect(state.values == ["k": "b1", "other": 1] && state.revision == 1)
        // An event of history A read on connection 1 before it closed, applied late, is older.
        #expect(state.apply(change(42, [Change(key: "k", old: "a41", new: "a42")]), connection: 1) == [])
        #expect(state.values["k"] == "b1" && state.revision == 1)
        // The resync snapshot on connection 2 was taken before the write: the write stays.
        _ = state.apply(.snapshot(revision: 0, values: [:], resync: true), connection: 2)
        #expect(state.values == ["k": "b1"] && state.revision == 1)
        // History B goes on as usual: by revision on connection 2.
        #expect(state.apply(change(1, [Change(key: "k", old: nil, new: "b1")]), connection: 2) == [])
        #expect(state.apply(change(2, [Change(key: "k", old: "b1", new: "b2")]), connection: 2) == ["k"])
        #expect(state.values == ["k": "b2"] && state.revision == 2)
    }

    @Test func aSnapshotReadOnAnEarlierConnectionKeepsTheWritesOfALaterOne() {
        var state = MirrorState(selection: .all)
        _ = state.apply(.snapshot(revision: 3, values: ["a": 1], resync: false), connection: 1)
        // Connection 3 (the daemon restarted twice) writes a at revision 1; the watch still
        // holds a resync snapshot it read on connection 2, at revision 50 of another history.
        #expect(state.apply(write(1, [("a", 2)], connection: 3)) == ["a"])
        _ = state.apply(.snapshot(revision: 50, values: ["a": 9, "b": 9], resync: true), connection: 2)
        #expect(state.values == ["a": 2, "b": 9] && state.revision == 1)
        // A replay on a later connection in the same history compares by revision: an own
        // write on connection 3 is not undone by an older revision replayed on connection 4.
        #expect(state.apply(change(1, [Change(key: "a", old: nil, new: 2)]), connection: 4) == [])
        #expect(state.apply(change(2, [Change(key: "a", old: 2, new: 3)]), connection: 4) == ["a"])
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

/// A daemon's histories across dropped connections and in-memory restarts, as a session
/// sees them: the session's connections one after another, a watch with `echo: false` that
/// resubscribes on the current connection once it has delivered what it read on the last one
/// — resuming with `since` in the same history (a replay of every revision not written on
/// its new connection), or with a resync snapshot in a new one — while this process writes
/// on the current connection. Replies and events of one connection are read in either order;
/// what was not read when a connection drops is lost (a write whose reply is lost was still
/// applied). The mirror applies the writes read so far at any moment, and every one of them
/// before the watch's next event (MirrorLink). Whatever happens, it ends with the daemon's state.
@Suite struct MirrorStateAcrossConnectionsTests {
    @Test(arguments: 0..<300)
    func whateverTheReconnectionsAndRestartsTheMirrorEndsWithTheDaemonsState(seed: UInt64) {
        var random = SplitMix64(seed: seed)
        func chance(_ n: UInt64) -> Bool { random.next() % n == 0 }
        let keys: [Key] = ["a", "b", "c"]
        // The daemon: its history (a new one after each in-memory restart) and that history's log.
        var (history, revision) = (0, UInt64(0))
        var daemon: [Key: JSONValue] = [:]
        var log: [(revision: UInt64, key: Key, value: JSONValue?, writer: UInt64?)] = []
        // The session's connection, and what the daemon sent on it that was not read yet.
        var (connection, connected) = (UInt64(1), true)
        var unreadEvents: [(event: WatchEvent, history: Int)] = []
        var unreadReplies: [LocalWrite] = []
        // The watch (subscribed on `watchConnection`, 0 before the first subscription; its
        // position and the history it is in, which a resync changes when its snapshot is
        // delivered) and the mirror's two queues: events read, waiting in the watch's stream;
        // writes read, in its inbox.
        var (watchConnection, watchHistory, position) = (UInt64(0), -1, UInt64?.none)
        var stream: [(event: WatchEvent, history: Int, connection: UInt64)] = []
        var inbox: [LocalWrite] = []
        var state = MirrorState(selection: .all)
        var trace: [String] = []

        func write(by writer: UInt64?) {
            let key = keys[Int(random.next() % 3)]
            let value: JSONValue? = chance(4) ? nil : .int(Int64(random.next() % 4))
            guard daemon[key] != value else { return }
            daemon[key] = value
            revision += 1
            log.append((revision, key, value, writer))
            trace.append("daemon h\(history) r\(revision) \(key)=\(String(describing: value)) by \(String(describing: writer))")
            if let writer {
                unreadReplies.append(ObsClientTests.write(revision, [(key, value)], connection: writer))
            } else if watchConnection == connection && connected {
                unreadEvents.append((change(revision, [Change(key: key, old: nil, new: value)]), history))
            }
        }
        func subscribe() {
            if let position, watchHistory == history {
                for entry in log where entry.revision > position && entry.writer != connection {
                    unreadEvents.append((change(entry.revision, [Change(key: entry.key, old: nil, new: entry.value)]), history))
                }
            } else {
                unreadEvents.append((.snapshot(revision: revision, values: daemon, resync: position != nil), history))
            }
            watchConnection = connection
            trace.append("subscribe c\(connection) pos \(String(describing: position)) -> \(unreadEvents.count)")
        }
        func read() {
            // A reply may overtake the events of earlier revisions, never those of later ones.
            let eventReadable = unreadEvents.first.map { next in unreadReplies.first.map { $0.revision > next.event.revision } ?? true } ?? false
            if !unreadReplies.isEmpty && (!eventReadable || chance(2)) {
                inbox.append(unreadReplies.removeFirst())
            } else if eventReadable {
                let (event, history) = unreadEvents.removeFirst()
                stream.append((event, history, connection))
            }
        }
        func process(event: Bool) {
            for write in inbox { _ = state.apply(write); trace.append("apply write \(write.revision) c\(write.connection) \(write.effects.map { "\($0.key)=\(String(describing: $0.new))" }) -> \(state.values)") }
            inbox = []
            guard event, !stream.isEmpty else { return }
            let (next, history, on) = stream.removeFirst()
            _ = state.apply(next, connection: on)
            if case .snapshot = next { watchHistory = history }
            trace.append("apply event \(next) c\(on) -> \(state.values)")
            position = next.revision
        }

        for _ in 0..<120 {
            switch random.next() % 16 {
            case 0..<3: write(by: nil)
            case 3..<6: if connected { write(by: connection) }
            case 6..<10: if connected { read() }
            case 10..<13: process(event: chance(4) == false)
            case 13:
                guard connected, chance(3) else { break }
                (connected, unreadEvents, unreadReplies) = (false, [], [])
                trace.append("drop c\(connection)")
                if chance(2) { (history, revision, daemon, log) = (history + 1, 0, [:], []) }  // restarted in memory
            case 14: if !connected { (connection, connected) = (connection + 1, true) }
            default: if connected && watchConnection != connection && stream.isEmpty { subscribe() }
            }
        }
        if !connected { (connection, connected) = (connection + 1, true) }
        while !stream.isEmpty { process(event: true) }
        if watchConnection != connection { subscribe() }
        while !unreadEvents.isEmpty || !unreadReplies.isEmpty { read() }
        while !stream.isEmpty || !inbox.isEmpty { process(event: true) }
        #expect(state.values == daemon, "seed \(seed)")
        if state.values != daemon { print(trace.joined(separator: "\n")) }
    }
}

extension MirrorState {
    var tombstoneCount: Int { tombstones.count }
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
