// Tests of the keyed observer index and the observer sets: routing by exact key, prefix
// and all; one routing per observer per revision; removal; weak multi-protocol observers,
// including a new object at the address of a freed one.

import ObservableKit
import Synchronization
import Testing

@Suite struct KeyedObserverIndexTests {
    @Test func routesExactPrefixAndAll() {
        let index = KeyedObserverIndex<String>()
        index.insert("theme", for: .keys(["theme"]))
        index.insert("theme+lang", for: .keys(["theme", "lang"]))
        index.insert("ui/", for: .prefix("ui/"))
        index.insert("u", for: .prefix("u"))
        index.insert("all", for: .all)
        index.insert("emptyPrefix", for: .prefix(""))
        #expect(Set(index.observers(of: "theme").map(\.observer)) == ["theme", "theme+lang", "all", "emptyPrefix"])
        #expect(Set(index.observers(of: "ui/x").map(\.observer)) == ["ui/", "u", "all", "emptyPrefix"])
        #expect(Set(index.observers(of: "u").map(\.observer)) == ["u", "all", "emptyPrefix"])
        #expect(Set(index.observers(of: "v").map(\.observer)) == ["all", "emptyPrefix"])
    }

    @Test func routesEachObserverOnceWithItsChanges() {
        let index = KeyedObserverIndex<String>()
        index.insert("ab", for: .keys(["a", "b"]))
        index.insert("c", for: .keys(["c"]))
        index.insert("all", for: .all)
        let routed = Dictionary(uniqueKeysWithValues: index.route(["a", "c", "b"]).map { ($0.observer, $0.selected) })
        #expect(routed == ["ab": .some([0, 2]), "c": .some([1]), "all": .all])
        #expect(SelectedChanges.some([0, 2]).apply(to: ["x", "y", "z"]) == ["x", "z"])
    }

    @Test func prefixMatchingIsByBytesAndRespectsCharacterBoundaries() {
        let index = KeyedObserverIndex<String>()
        index.insert("e", for: .prefix("e"))
        index.insert("é", for: .prefix("é"))
        #expect(index.observers(of: "e\u{301}").map(\.observer) == ["e"])
        #expect(index.observers(of: "éa").map(\.observer) == ["é"])
        // A key whose first bytes are a cut multi-byte character matches no prefix of that length.
        index.insert("\u{FFFD}", for: .prefix("\u{FFFD}"))
        #expect(index.observers(of: "\u{FFFD}x").map(\.observer) == ["\u{FFFD}"])
        #expect(index.observers(of: "😀").isEmpty)
    }

    @Test func removalWorksForEveryKindAndManyObservers() {
        let index = KeyedObserverIndex<Int>()
        var ids: [ObserverID] = []
        for i in 0..<200 {
            let selection: Selection = i % 3 == 0 ? .all : (i % 3 == 1 ? .keys(["k", Key("k\(i)")]) : .prefix("k"))
            ids.append(index.insert(i, for: selection))
        }
        #expect(index.observers(of: "k").count == 200)
        for id in ids.shuffled().prefix(150) { index.remove(id) }
        #expect(index.observers(of: "k").count == 50)
        #expect(index.count == 50)
        index.remove(contentsOf: ids)
        #expect(index.count == 0)
        #expect(index.observers(of: "k").isEmpty)
        #expect(index.remove(ids[0]) == nil)
    }
}

protocol ThemeObserver: AnyObject, Sendable { func themeChanged(_ theme: String) }
protocol LanguageObserver: AnyObject, Sendable { func languageChanged(_ lang: String) }

final class Recorder: ThemeObserver, LanguageObserver, Sendable {
    let seen = Locked<[String]>([])
    func themeChanged(_ theme: String) { seen.withLock { $0.append("theme:\(theme)") } }
    func languageChanged(_ lang: String) { seen.withLock { $0.append("lang:\(lang)") } }
}

final class ThemeOnly: ThemeObserver, Sendable {
    let count = Atomic<Int>(0)
    func themeChanged(_ theme: String) { count.add(1, ordering: .relaxed) }
}

@Suite struct ObjectObserverTests {
    @Test func severalProtocolsOnOneObservable() {
        let observers = ObjectObservers()
        let both = Recorder()
        let themeOnly = ThemeOnly()
        observers.add([both, themeOnly])
        observers.add(both)  // no effect
        observers.notify { (o: ThemeObserver) in o.themeChanged("dark") }
        observers.notify { (o: LanguageObserver) in o.languageChanged("fr") }
        #expect(both.seen.withLock { $0 } == ["theme:dark", "lang:fr"])
        #expect(themeOnly.count.load(ordering: .relaxed) == 1)
        observers.remove([both, themeOnly])
        observers.notify { (o: ThemeObserver) in o.themeChanged("light") }
        #expect(themeOnly.count.load(ordering: .relaxed) == 1)
    }

    @Test func droppedObserversStopReceivingAndArePruned() {
        let observers = ObjectObservers()
        var transient: ThemeOnly? = ThemeOnly()
        let kept = ThemeOnly()
        observers.add(transient!)
        observers.add(kept)
        #expect(observers.count == 2)
        transient = nil
        observers.notify { (o: ThemeObserver) in o.themeChanged("x") }
        #expect(observers.count == 1)
        #expect(kept.count.load(ordering: .relaxed) == 1)
    }

    @Test func keyedObjectObserversSeeOnlyTheirKeys() {
        let observers = KeyedObjectObservers()
        let theme = ThemeOnly()
        let all = ThemeOnly()
        observers.add(theme, for: .key("theme"))
        observers.add([all], for: .all)
        observers.notify(key: "theme") { (o: ThemeObserver) in o.themeChanged("dark") }
        observers.notify(key: "lang") { (o: ThemeObserver) in o.themeChanged("fr") }
        #expect(theme.count.load(ordering: .relaxed) == 1)
        #expect(all.count.load(ordering: .relaxed) == 2)
        observers.remove(all)
        observers.notify(key: "lang") { (o: ThemeObserver) in o.themeChanged("de") }
        #expect(all.count.load(ordering: .relaxed) == 2)
    }

    @Test func aNewObserverAtAFreedObserversAddressIsRegisteredAndNotified() throws {
        let observers = ObjectObservers()
        let reused = try #require(objectAtAFreedAddress { observers.add($0) }, "the allocator never reused an address")
        observers.add(reused)
        observers.notify { (o: ThemeObserver) in o.themeChanged("dark") }  // prunes the freed observer
        observers.notify { (o: ThemeObserver) in o.themeChanged("light") }
        #expect(reused.count.load(ordering: .relaxed) == 2)
        #expect(observers.count == 1)
        observers.remove(reused)
        #expect(observers.count == 0)
    }

    @Test func pruningAFreedKeyedObserverLeavesTheOneAtItsAddress() throws {
        let observers = KeyedObjectObservers()
        let reused = try #require(objectAtAFreedAddress { observers.add($0, for: .all) }, "the allocator never reused an address")
        observers.add(reused, for: .key("theme"))
        observers.notify(key: "theme") { (o: ThemeObserver) in o.themeChanged("dark") }  // prunes the freed observer
        observers.notify(key: "theme") { (o: ThemeObserver) in o.themeChanged("light") }
        #expect(reused.count.load(ordering: .relaxed) == 2)
    }

    @Test func observerSetSnapshotsAndRemovesInOneCall() {
        let set = ObserverSet<Int>()
        let ids = set.insert(contentsOf: [1, 2, 3])
        var seen: [Int] = []
        set.forEach { id, value in
            seen.append(value)
            set.remove(id)  // removing during iteration is safe
            set.insert(value * 10)  // adding too; it is not visited by this iteration
        }
        #expect(seen.sorted() == [1, 2, 3])
        #expect(set.snapshot().map(\.observer).sorted() == [10, 20, 30])
        set.remove(contentsOf: ids)
        #expect(set.count == 3)
    }

    @Test func tokensCancelOnceAndOnDeinit() {
        let count = Atomic<Int>(0)
        do {
            let token = ObservationToken { count.add(1, ordering: .relaxed) }
            token.cancel()
            token.cancel()
            #expect(token.isCancelled)
        }
        do {
            _ = ObservationToken { count.add(1, ordering: .relaxed) }
        }
        #expect(count.load(ordering: .relaxed) == 2)
    }
}

/// A new observer at the address of one that `register` was given and that was then freed:
/// a freed block comes back for the next object of its size (tried until it does, with every
/// registration left in place, as a freed observer's is until it is pruned).
func objectAtAFreedAddress(register: (ThemeOnly) -> Void) -> ThemeOnly? {
    for _ in 0..<1_000 {
        let freed: ObjectIdentifier
        do {
            let first = ThemeOnly()
            register(first)
            freed = ObjectIdentifier(first)
        }
        let next = ThemeOnly()
        if ObjectIdentifier(next) == freed { return next }
    }
    return nil
}
