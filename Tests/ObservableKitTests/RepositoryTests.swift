// Tests of the in-process observable repository: notifications, keyed filtering, batches
// as one notification, once, weak observers, snapshots without gaps, reentrancy.

import ObservableKit
import Synchronization
import Testing

/// Collects notifications, thread-safely.
final class Collector<Value: Sendable>: Sendable {
    let items = Locked<[ChangeSet<Value>]>([])
    func add(_ c: ChangeSet<Value>) { items.withLock { $0.append(c) } }
    var all: [ChangeSet<Value>] { items.withLock { $0 } }
}

final class TypedObserver: RepositoryObserver, Sendable {
    let seen = Collector<String>()
    func repositoryDidChange(_ changes: ChangeSet<String>) { seen.add(changes) }
}

@Suite struct ObservableRepositoryTests {
    @Test func notifiesOldAndNewOncePerRevision() throws {
        let repo = ObservableRepository<String>(name: "ui")
        let seen = Collector<String>()
        let token = repo.observe { seen.add($0) }
        try repo.set("light", for: "theme")
        try repo.set("dark", for: "theme")
        try repo.set("dark", for: "theme")  // equal: not a change
        let r = try repo.delete("theme")
        #expect(r.changed && r.previous?.value == "dark")
        #expect(seen.all == [
            ChangeSet(revision: 1, changes: [Change(key: "theme", old: nil, new: "light")]),
            ChangeSet(revision: 2, changes: [Change(key: "theme", old: "light", new: "dark")]),
            ChangeSet(revision: 3, changes: [Change(key: "theme", old: "dark", new: nil)]),
        ])
        token.cancel()
        try repo.set("x", for: "theme")
        #expect(seen.all.count == 3)
    }

    @Test func keyedObserversSeeOnlyTheirKeysAndBatchesArriveAsOne() throws {
        let repo = ObservableRepository<Int>()
        let theme = Collector<Int>()
        let prefix = Collector<Int>()
        let t1 = repo.observe(.keys(["theme"])) { theme.add($0) }
        let t2 = repo.observe(.prefix("ui/")) { prefix.add($0) }
        try repo.apply([.set("theme", 1), .set("ui/a", 2), .set("ui/b", 3), .set("other", 4)])
        try repo.set(5, for: "other")
        #expect(theme.all == [ChangeSet(revision: 1, changes: [Change(key: "theme", old: nil, new: 1)])])
        #expect(prefix.all == [ChangeSet(revision: 1, changes: [Change(key: "ui/a", old: nil, new: 2), Change(key: "ui/b", old: nil, new: 3)])])
        withExtendedLifetime((t1, t2)) {}
    }

    @Test func forceNotifiesWithEqualOldAndNew() throws {
        let repo = ObservableRepository<Int>()
        let seen = Collector<Int>()
        let token = repo.observe { seen.add($0) }
        try repo.set(1, for: "a")
        let r = try repo.set(1, for: "a", force: true)
        #expect(r.changed && r.revision == 2)
        #expect(seen.all.last == ChangeSet(revision: 2, changes: [Change(key: "a", old: 1, new: 1)]))
        withExtendedLifetime(token) {}
    }

    @Test func onceFiresASingleTime() throws {
        let repo = ObservableRepository<Int>()
        let seen = Collector<Int>()
        let token = repo.observe(.key("a"), once: true) { seen.add($0) }
        try repo.set(1, for: "b")
        try repo.set(1, for: "a")
        try repo.set(2, for: "a")
        #expect(seen.all.map(\.revision) == [2])
        #expect(repo.observerCount == 0)
        withExtendedLifetime(token) {}
    }

    @Test func weakProtocolObserversStopWhenDropped() throws {
        let repo = ObservableRepository<String>()
        var observer: TypedObserver? = TypedObserver()
        let seen = observer!.seen
        repo.addObserver(observer!, for: .key("k"))
        try repo.set("a", for: "k")
        observer = nil
        try repo.set("b", for: "k")
        #expect(seen.all.count == 1)
        #expect(repo.observerCount == 0)
        let other = TypedObserver()
        repo.addObservers([other], for: .all)
        repo.removeObserver(other)
        try repo.set("c", for: "k")
        #expect(other.seen.all.isEmpty)
    }

    @Test func conflictsChangeNothingAndNotifyNobody() throws {
        let repo = ObservableRepository<Int>()
        let seen = Collector<Int>()
        let token = repo.observe { seen.add($0) }
        try repo.set(1, for: "a")
        #expect(throws: WriteError.self) { try repo.apply([.set("b", 1), .set("a", 2, ifRevision: 9)]) }
        #expect(repo["b"] == nil && repo.revision == 1 && seen.all.count == 1)
        withExtendedLifetime(token) {}
    }

    @Test func writesFromInsideACallbackAreDeliveredInOrderAfterIt() throws {
        let repo = ObservableRepository<Int>()
        let order = Locked<[UInt64]>([])
        let token = repo.observe { [repo] changes in
            order.withLock { $0.append(changes.revision) }
            if let v = changes.changes.first?.new, v < 5 { _ = try? repo.set(v + 1, for: "n") }
        }
        try repo.set(0, for: "n")
        #expect(order.withLock { $0 } == [1, 2, 3, 4, 5, 6])
        #expect(repo["n"] == 5)
        withExtendedLifetime(token) {}
    }

    @Test func asyncSequenceOfChanges() async throws {
        let repo = ObservableRepository<Int>()
        let stream = repo.changes(.key("a"))
        try repo.set(1, for: "b")
        try repo.set(1, for: "a")
        try repo.set(2, for: "a")
        var iterator = stream.makeAsyncIterator()
        #expect(await iterator.next()?.revision == 2)
        #expect(await iterator.next()?.revision == 3)
    }
}

/// A thread-safe counter shared by concurrent test tasks.
final class Counter: Sendable {
    private let value = Atomic<Int>(0)
    func add(_ n: Int = 1) { value.add(n, ordering: .sequentiallyConsistent) }
    func load() -> Int { value.load(ordering: .sequentiallyConsistent) }
}

/// Concurrency: several writers and several threads adding and removing observers (some
/// from inside callbacks) while events fan out. Must finish (no deadlock), deliver each
/// observer's revisions in strictly increasing order, and let a snapshot-observer see every
/// revision after its snapshot exactly once.
@Suite struct ConcurrentFanOutTests {
    @Test func addRemoveDuringFanOutIsSafeAndOrdered() async throws {
        let repo = ObservableRepository<Int>()
        let writers = 4
        let writesPerWriter = 5_000
        let violations = Counter()

        // Long-lived observers with a snapshot: must see every later revision, in order, no gaps.
        final class GapChecker: Sendable {
            let last: Locked<UInt64>
            let bad = Counter()
            init(start: UInt64) { self.last = Locked(start) }
            func see(_ rev: UInt64) {
                last.withLock { last in
                    if rev != last + 1 { bad.add() }
                    last = rev
                }
            }
        }
        var checkers: [(GapChecker, ObservationToken)] = []
        for _ in 0..<3 {
            let box = Locked<GapChecker?>(nil)
            let (token, snapshot) = repo.observeWithSnapshot(.all) { c in box.withLock { $0 }!.see(c.revision) }
            let checker = GapChecker(start: snapshot.revision)
            box.withLock { $0 = checker }
            checkers.append((checker, token))
        }

        await withTaskGroup(of: Void.self) { group in
            for w in 0..<writers {
                group.addTask {
                    for i in 0..<writesPerWriter { _ = try? repo.set(i, for: Key("w\(w)/k\(i % 17)")) }
                }
            }
            // Churn: observers that add and remove themselves and others during fan-out.
            for c in 0..<4 {
                let prefix = "w\(c % writers)/"
                group.addTask {
                    for i in 0..<500 {
                        let lastSeen = Atomic<UInt64>(0)
                        let selfRemoving = Locked<ObservationToken?>(nil)
                        let token = repo.observe(i % 2 == 0 ? .prefix(prefix) : .all) { changes in
                            let previous = lastSeen.exchange(changes.revision, ordering: .relaxed)
                            if previous >= changes.revision { violations.add() }
                            if changes.revision % 7 == 0 {
                                selfRemoving.withLock { $0 }?.cancel()  // remove itself from inside
                            }
                            if changes.revision % 11 == 0 {
                                _ = repo.observe(.key("never")) { _ in }  // add another, dropped at once
                            }
                        }
                        selfRemoving.withLock { $0 = token }
                        if i % 3 == 0 { await Task.yield() }
                        token.cancel()
                    }
                }
            }
        }
        #expect(violations.load() == 0)
        #expect(repo.revision == UInt64(writers * writesPerWriter))
        for (checker, token) in checkers {
            #expect(checker.bad.load() == 0)
            #expect(checker.last.withLock { $0 } == repo.revision)
            token.cancel()
        }
        #expect(repo.observerCount == 0)
    }
}

@Suite struct ObserverRegistrationRaceTests {
    @Test func aRemovalRacingAnAdditionNeverLeavesARegistrationBehind() async throws {
        let repo = ObservableRepository<String>(name: "race")
        for _ in 0..<20_000 {
            let observer = TypedObserver()
            // Add and remove the same observer at once, then remove it once more: whatever
            // the interleaving, nothing of it may stay registered.
            await withTaskGroup(of: Void.self) { group in
                group.addTask { repo.addObserver(observer, for: .all) }
                group.addTask { repo.removeObserver(observer) }
            }
            repo.removeObserver(observer)
            #expect(repo.observerCount == 0)
            if repo.observerCount != 0 { return }
        }
    }
}
