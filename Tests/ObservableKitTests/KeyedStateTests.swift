// Tests of the write rules: equality, force, compare-and-set, atomic batches, revisions.

import ObservableKit
import Testing

@Suite struct KeyedStateTests {
    @Test func equalValueIsNotAChangeUnlessForced() throws {
        var s = KeyedState<Int>()
        #expect(try s.apply([.set("a", 1)])?.revision == 1)
        #expect(try s.apply([.set("a", 1)]) == nil)
        #expect(s.revision == 1)
        let forced = try s.apply([.set("a", 1, force: true)])
        #expect(forced == ChangeSet(revision: 2, changes: [Change(key: "a", old: 1, new: 1)]))
        #expect(s["a"] == Entry(value: 1, revision: 2))
    }

    @Test func changesCarryOldAndNew() throws {
        var s = KeyedState<String>()
        #expect(try s.apply([.set("k", "x")])?.changes == [Change(key: "k", old: nil, new: "x")])
        #expect(try s.apply([.set("k", "y")])?.changes == [Change(key: "k", old: "x", new: "y")])
        #expect(try s.apply([.delete("k")])?.changes == [Change(key: "k", old: "y", new: nil)])
        #expect(try s.apply([.delete("k")]) == nil)
        #expect(s.revision == 3)
        #expect(s["k"] == nil)
    }

    @Test func compareAndSet() throws {
        var s = KeyedState<Int>()
        #expect(throws: WriteError.conflict(key: "a", expected: 5, actual: 0)) { try s.apply([.set("a", 1, ifRevision: 5)]) }
        #expect(try s.apply([.set("a", 1, ifRevision: 0)])?.revision == 1)
        #expect(throws: WriteError.conflict(key: "a", expected: 0, actual: 1)) { try s.apply([.set("a", 2, ifRevision: 0)]) }
        #expect(try s.apply([.set("a", 2, ifRevision: 1)])?.revision == 2)
        #expect(throws: WriteError.self) { try s.apply([.delete("a", ifRevision: 1)]) }
        #expect(try s.apply([.delete("a", ifRevision: 2)])?.revision == 3)
        #expect(s.revision == 3)
    }

    @Test func batchIsAtomicAndSharesOneRevision() throws {
        var s = KeyedState<Int>()
        _ = try s.apply([.set("a", 1), .set("b", 2)])
        #expect(s.revision == 1)
        #expect(throws: WriteError.self) { try s.apply([.set("a", 10), .set("b", 20, ifRevision: 7)]) }
        #expect(s["a"]?.value == 1)
        #expect(s.revision == 1)
        let cs = try s.apply([.set("a", 1), .set("b", 3), .delete("zz"), .set("c", 4)])
        #expect(cs == ChangeSet(revision: 2, changes: [Change(key: "b", old: 2, new: 3), Change(key: "c", old: nil, new: 4)]))
        #expect(s["a"]?.revision == 1, "a no-op inside a batch does not touch the key's revision")
        #expect(try s.apply([]) == nil)
        #expect(try s.apply([.set("a", 1), .delete("nope")]) == nil)
        #expect(s.revision == 2)
    }

    @Test func batchRejectsRepeatedKeys() {
        var s = KeyedState<Int>()
        #expect(throws: WriteError.duplicateKey("a")) { try s.apply([.set("a", 1), .delete("a")]) }
        #expect(s.revision == 0)
    }

    @Test func keysAreListedInByteOrderWithPrefix() throws {
        var s = KeyedState<Int>()
        _ = try s.apply([.set("b", 1), .set("a/2", 2), .set("a/1", 3), .set("é", 4), .set("Z", 5), .set("e\u{301}", 6)])
        #expect(s.keys().map(\.string) == ["Z", "a/1", "a/2", "b", "e\u{301}", "é"])
        #expect(s.keys(prefix: "a/").map(\.string) == ["a/1", "a/2"])
        #expect(s.count == 6, "canonically equivalent strings are distinct keys")
    }

    @Test func revertRestoresThePreviousEntries() throws {
        var s = KeyedState<Int>()
        _ = try s.apply([.set("a", 1), .set("b", 2)])
        let before = s
        let previous = [s["a"], s["b"], s["c"]]
        let cs = try #require(try s.apply([.set("a", 10), .delete("b"), .set("c", 3)]))
        let wrongRevision = s.revert(ChangeSet(revision: 1, changes: []), previous: [])
        #expect(!wrongRevision, "only the current revision can be reverted")
        let reverted = s.revert(cs, previous: previous)
        #expect(reverted)
        #expect(s.revision == before.revision && s.entries == before.entries)
    }

    @Test func installAppliesStoredRevisionsInOrderOnly() {
        var s = KeyedState<Int>()
        let first = s.install(ChangeSet(revision: 3, changes: [Change(key: "a", old: nil, new: 1)]))
        let stale = s.install(ChangeSet(revision: 3, changes: [Change(key: "a", old: 1, new: 2)]))
        #expect(first && !stale)
        #expect(s["a"] == Entry(value: 1, revision: 3))
    }
}

@Suite struct KeyTests {
    @Test func bytewiseIdentityAndOrder() {
        #expect(Key("\u{E9}") != Key("e\u{301}"))
        #expect(Set([Key("\u{E9}"), Key("e\u{301}")]).count == 2)
        #expect(Key("a") < Key("b"))
        #expect(Key("Z") < Key("a"))
        #expect(Key("ab") < Key("abc"))
        #expect(Key("abcdefghijklmnopq") == Key("abcdefghijklmnop" + "q"))
        #expect(Key("é").hasBytePrefix("\u{E9}"))
        #expect(!Key("e\u{301}").hasBytePrefix("\u{E9}"))
    }

    /// `<` (compared a word at a time) agrees with comparing the UTF-8 bytes one by one, for
    /// keys that share prefixes of every length and differ in any byte, high bits included.
    @Test func orderAgreesWithByteByByteComparison() {
        var generator = SystemRandomNumberGenerator()
        let alphabet: [String] = ["a", "b", "z", "A", "0", "/", "\u{7F}", "\u{E9}", "\u{FF}", "\u{10348}"]
        let stems = ["", "k", "svc/web/", "instance-0000000", "abcdefgh", "abcdefghijklmnop"]
        var keys: [Key] = []
        for _ in 0..<2_000 {
            var s = stems.randomElement(using: &generator) ?? ""
            for _ in 0..<Int.random(in: 0...12, using: &generator) { s += alphabet.randomElement(using: &generator) ?? "" }
            keys.append(Key(s))
        }
        for _ in 0..<20_000 {
            let a = keys.randomElement(using: &generator) ?? "", b = keys.randomElement(using: &generator) ?? ""
            let expected = Array(a.string.utf8).lexicographicallyPrecedes(Array(b.string.utf8))
            #expect((a < b) == expected, "\(a.string.debugDescription) < \(b.string.debugDescription)")
            if (a < b) != expected { return }
        }
    }
}
