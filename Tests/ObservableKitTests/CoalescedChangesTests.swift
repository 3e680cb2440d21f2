// Tests of coalesced delivery to a slow async consumer (`coalescedChanges`): a consumer
// that keeps up gets every revision as it is; one that lags gets one change per key that
// differs from what it last received, in byte order, changed-back keys left out; memory is
// bounded by keys under a write storm; the consumer ends with exactly the repository's
// state; adding and removing observers during fan-out never deadlocks.

@testable import ObservableKit
import Synchronization
import Testing

/// Applies a change set to a dictionary, as a consumer mirroring the repository would.
func apply<V>(_ changeSet: ChangeSet<V>, to state: inout [Key: V]) {
    for change in changeSet.changes { state[change.key] = change.new }
}

@Suite(.timeLimit(.minutes(2))) struct CoalescedChangesTests {
    @Test func aConsumerThatKeepsUpGetsEveryRevisionAsItIs() async throws {
        let repo = ObservableRepository<Int>()
        try repo.set(1, for: "a")
        var changes = repo.coalescedChanges().makeAsyncIterator()
        try repo.set(2, for: "a")
        #expect(await changes.next() == ChangeSet(revision: 2, changes: [Change(key: "a", old: 1, new: 2)]))
        try repo.set(2, for: "a", force: true)
        #expect(await changes.next() == ChangeSet(revision: 3, changes: [Change(key: "a", old: 2, new: 2)]), "a forced write, as it is")
        try repo.apply([.set("z", 1), .set("b", 1)])
        let batch = await changes.next()
        #expect(batch?.changes.map(\.key) == ["z", "b"], "one revision keeps its order of application")
        #expect(batch?.from == nil && batch?.isCoalesced == false)
    }

    @Test func aLaggingConsumerGetsOneChangePerKeyInByteOrderFromWhatItLastReceived() async throws {
        let repo = ObservableRepository<Int>()
        for key: Key in ["z", "a", "B", "é"] { try repo.set(0, for: key) }  // revisions 1–4
        let changes = repo.coalescedChanges()
        try repo.set(1, for: "z")  // 5
        try repo.set(1, for: "a")
        try repo.set(1, for: "m")
        try repo.set(2, for: "a")
        try repo.set(7, for: "é")
        try repo.apply([.set("B", 3), .delete("z")])  // 10
        var iterator = changes.makeAsyncIterator()
        let coalesced = try #require(await iterator.next())
        #expect(coalesced.revision == 10 && coalesced.from == 5 && coalesced.isCoalesced)
        #expect(coalesced.changes == [
            Change(key: "B", old: 0, new: 3), Change(key: "a", old: 0, new: 2), Change(key: "m", old: nil, new: 1),
            Change(key: "z", old: 0, new: nil), Change(key: "é", old: 0, new: 7),
        ], "UTF-8 byte order: uppercase before lowercase, é (0xC3) after z")

        try repo.set(3, for: "a")
        try repo.set(4, for: "a")
        #expect(await iterator.next() == ChangeSet(revision: 12, changes: [Change(key: "a", old: 2, new: 4)], from: 11),
            "old is the value last received, not the one before the latest write")
    }

    @Test func keysThatChangedBackAreLeftOutAndNothingIsSentWhenAllDid() async throws {
        let repo = ObservableRepository<String>()
        try repo.set("light", for: "theme")
        try repo.set("en", for: "lang")
        let sequence = repo.coalescedChanges()
        var changes = sequence.makeAsyncIterator()
        try repo.set("dark", for: "theme")
        try repo.set("light", for: "theme")  // back
        try repo.set("tmp", for: "scratch")
        try repo.delete("scratch")  // created and deleted: absent before and after
        try repo.set("en", for: "lang", force: true)  // forced, equal
        try repo.set("fr", for: "lang")
        try repo.set("en", for: "lang")  // back
        #expect(CoalescingBufferProbe.held(sequence) == 3, "one entry per key, after seven writes")
        try repo.set("x", for: "other")
        let next = await changes.next()
        #expect(next?.changes == [Change(key: "other", old: nil, new: "x")], "only the key whose value differs")
        #expect(next?.revision == repo.revision)

        try repo.set("dark", for: "theme")
        try repo.set("light", for: "theme")
        // Every key changed back: nothing to deliver; the next real change comes alone.
        let waiting = Task {
            var changes = sequence.makeAsyncIterator()  // the same buffer: one consumer at a time
            return await changes.next()
        }
        try repo.set("de", for: "lang")
        let last = await waiting.value
        #expect(last?.changes == [Change(key: "lang", old: "en", new: "de")])
    }

    @Test func aWriteStormAgainstAStalledConsumerCostsOneEntryPerKeyAndEndsInTheRepositoryState() async throws {
        let repo = ObservableRepository<Int>()
        let keys = (0..<10).map { Key("k\($0)") }
        for key in keys { try repo.set(-1, for: key) }
        var mirror = repo.snapshot().values
        let start = repo.revision
        let changes = repo.coalescedChanges()
        let maxHeld = Maximum()
        await withTaskGroup(of: Void.self) { group in
            for writer in 0..<4 {
                group.addTask {
                    for i in 0..<25_000 {
                        let key = keys[(i * 7 + writer) % keys.count]
                        if i % 13 == 0 { _ = try? repo.delete(key) } else { _ = try? repo.set(i * 4 + writer, for: key) }
                        if i % 1000 == 0 { maxHeld.record(CoalescingBufferProbe.held(changes)) }
                    }
                }
            }
        }
        maxHeld.record(CoalescingBufferProbe.held(changes))
        #expect(repo.revision > start + 80_000, "the storm wrote (almost every write changed something)")
        #expect(maxHeld.value <= keys.count, "memory bounded by keys, not by writes")
        var iterator = changes.makeAsyncIterator()
        let coalesced = try #require(await iterator.next())
        #expect(coalesced.from == start + 1 && coalesced.revision == repo.revision)
        #expect(coalesced.changes.map(\.key) == coalesced.changes.map(\.key).sorted())
        apply(coalesced, to: &mirror)
        #expect(mirror == repo.snapshot().values, "one change set brings the consumer to the final state")
        #expect(CoalescingBufferProbe.held(changes) == 0)
    }

    @Test func aSlowConsumerFollowingLiveWritesEndsCorrectWithIncreasingRevisionsAndFewerEvents() async throws {
        let repo = ObservableRepository<Int>()
        let changes = repo.coalescedChanges(.prefix("k"))
        let (chunks, chunkDone) = AsyncStream.makeStream(of: Void.self)
        let rounds = 50, perRound = 200
        let consumer = Task {
            var mirror: [Key: Int] = [:]
            var revisions: [UInt64] = []
            var chunkSignals = chunks.makeAsyncIterator()
            for await changeSet in changes {
                revisions.append(changeSet.revision)
                apply(changeSet, to: &mirror)
                if mirror["k-done"] != nil { break }
                _ = await chunkSignals.next()  // slow: at most one read per chunk of writes
            }
            return (mirror, revisions)
        }
        for round in 0..<rounds {
            for i in 0..<perRound {
                let key = Key("k\(i % 16)")
                if (round + i) % 11 == 0 { try repo.delete(key) } else { try repo.set(round * perRound + i, for: key) }
            }
            try repo.set(round, for: "unselected")
            chunkDone.yield()
        }
        try repo.set(1, for: "k-done")
        chunkDone.finish()
        let (mirror, revisions) = await consumer.value
        #expect(mirror == repo.snapshot(.prefix("k")).values, "exactly the repository's state")
        #expect(zip(revisions, revisions.dropFirst()).allSatisfy { $0 < $1 }, "strictly increasing revisions")
        #expect(revisions.count <= rounds + 2 && revisions.count < rounds * perRound, "fewer events than writes")
    }

    @Test func cancellingTheConsumerEndsTheSequenceAndDroppingItEndsTheObservation() async throws {
        let repo = ObservableRepository<Int>()
        do {
            let changes = repo.coalescedChanges()
            #expect(repo.observerCount == 1)
            let consumer = Task {
                var n = 0
                for await _ in changes { n += 1 }
                return n
            }
            try repo.set(1, for: "a")
            consumer.cancel()
            #expect(await consumer.value <= 1)
            var after = changes.makeAsyncIterator()
            #expect(await after.next() == nil, "a cancelled sequence stays finished")
        }
        #expect(repo.observerCount == 0, "the observation ends with the sequence")
    }

    @Test func observersAddedAndRemovedDuringFanOutNeverDeadlock() async throws {
        let repo = ObservableRepository<Int>()
        let held = Locked<[CoalescedChanges<Int>]>([])
        // An observer that, inside its callback, starts coalesced sequences and drops old ones.
        let token = repo.observe(.prefix("w")) { changeSet in
            let fresh = repo.coalescedChanges(.key("w0"))
            held.withLock { list in
                list.append(fresh)
                if list.count > 3 { list.removeFirst(2) }
            }
        }
        let consumer = Task {
            var last: UInt64 = 0
            for await changeSet in repo.coalescedChanges() {
                #expect(changeSet.revision > last)
                last = changeSet.revision
                if changeSet.changes.contains(where: { $0.key == "end" }) { break }
                // Read from inside the loop, and observe and stop observing from it.
                _ = repo.coalescedChanges(.key("w1"))
            }
            return last
        }
        await withTaskGroup(of: Void.self) { group in
            for writer in 0..<3 {
                group.addTask {
                    for i in 0..<3_000 { _ = try? repo.set(i, for: Key("w\((i + writer) % 4)")) }
                }
            }
        }
        try repo.set(1, for: "end")
        #expect(await consumer.value == repo.revision)
        held.withLock { $0 = [] }
        withExtendedLifetime(token) {}
    }
}

/// Reads how many changes a coalesced sequence holds for its consumer.
enum CoalescingBufferProbe {
    static func held<V>(_ changes: CoalescedChanges<V>) -> Int { changes.buffer.heldChanges }
}

/// The largest number recorded, from any thread.
final class Maximum: Sendable {
    private let largest = Atomic<Int>(0)

    func record(_ candidate: Int) {
        var current = largest.load(ordering: .relaxed)
        while candidate > current {
            let (exchanged, original) = largest.compareExchange(expected: current, desired: candidate, ordering: .relaxed)
            if exchanged { return }
            current = original
        }
    }

    var value: Int { largest.load(ordering: .relaxed) }
}
