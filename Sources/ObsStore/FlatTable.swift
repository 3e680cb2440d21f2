// ObsStore — a repository's keys, values and key revisions in flat storage: records
// (FlatRecord.swift) in slabs, one allocation per slab (up to 1 MiB), never one per key; and
// an open-addressing index of 8-byte slots, each a record's address (35 bits: up to 32 GiB of
// records per repository) and 29 bits of its key's hash, so a probe reads a record only when
// those bits match.
//
// - Writing a key whose record fits where its old one was overwrites it in place (the rest
//   of the old bytes marked dead); otherwise the record goes to the end of the last slab
//   and the old one is marked dead. Once dead bytes pass a quarter of what the slabs hold,
//   the slabs with the most of them are emptied — their live records moved to the end —
//   and freed.
// - The index probes linearly from a slot chosen by the stored hash bits alone, so growing
//   it and deleting from it (backward shift, no tombstones) never read a record. Keys are
//   hashed with Swift's seeded `Hasher`: clients choose keys, and cannot choose collisions.
// - Slabs and the index of a large table are mapped pages (`FlatMemory`): freeing them gives
//   the memory back to the system at once.
//
// `FlatTable` is a value (copy on write), like the dictionary it replaces; it is not
// thread-safe — the server keeps it under its repository's lock. Its memory is
// `FlatTableStorage` (FlatTableStorage.swift; loading a snapshot: +Loading).

import ObsValues
import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// A repository's entries and revision, flat (see the file header).
public struct FlatTable: Sendable {
    @usableFromInline var storage: FlatTableStorage
    /// The repository revision the entries are at.
    public var revision: UInt64

    /// An empty table.
    public init(revision: UInt64 = 0) {
        self.storage = FlatTableStorage()
        self.revision = revision
    }

    /// A table holding `entries` (a shared store's, read as a dictionary).
    public init(revision: UInt64, entries: [Key: Entry<CanonicalJSON>]) {
        self.init(revision: revision)
        storage.reserve(entries.count)
        for (key, entry) in entries { set(key, to: entry.value, revision: entry.revision) }
    }

    init(revision: UInt64, storage: FlatTableStorage) {
        self.storage = storage
        self.revision = revision
    }

    /// The number of keys.
    public var count: Int { storage.count }

    /// Bytes of memory the table holds (slabs and index).
    public var memoryBytes: Int { storage.memoryBytes }

    /// The entry of `key`, copied out.
    public subscript(key: Key) -> Entry<CanonicalJSON>? {
        withRecord(key) { $0?.entry }
    }

    /// Calls `body` with the record of `key` read in place (nil: absent).
    @inlinable  // specialized where it is called: no generic metadata per lookup
    public func withRecord<R>(_ key: Key, _ body: (FlatRecord?) -> R) -> R {
        key.withUTF8 { bytes in
            let raw = UnsafeRawBufferPointer(bytes)
            let found = storage.find(raw, tag: FlatTableStorage.tag(raw))
            return body(found.found ? storage.record(in: found.slot) : nil)
        }
    }

    /// Where a lookup found a key, or would put it: valid until the table changes.
    public struct Position: Sendable {
        @usableFromInline let slot: Int
        @usableFromInline let tag: UInt64
        @usableFromInline let found: Bool

        @inlinable
        init(slot: Int, tag: UInt64, found: Bool) {
            self.slot = slot
            self.tag = tag
            self.found = found
        }
    }

    /// Calls `body` with the record of the key whose bytes are `key`, read in place (nil:
    /// absent), and where it lies: a write of the same key before any other change to the
    /// table (`set(key:…:at:)`, `remove(key:at:)`) needs no second lookup.
    @inlinable
    public func withRecord<R>(key: UnsafeRawBufferPointer, _ body: (FlatRecord?, Position) -> R) -> R {
        let tag = FlatTableStorage.tag(key)
        let found = storage.find(key, tag: tag)
        return body(found.found ? storage.record(in: found.slot) : nil, Position(slot: found.slot, tag: tag, found: found.found))
    }

    /// Sets the key whose bytes are `key`, where a lookup of it found it (or its place), the
    /// table unchanged since.
    public mutating func set(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer, isPlain: Bool, revision: UInt64, at position: Position) {
        makeUnique()  // a copy keeps every record where it was
        storage.set(key, value, isPlain: isPlain, revision: revision, slot: position.slot, tag: position.tag, found: position.found)
    }

    /// Removes the key whose bytes are `key`, where a lookup of it found it, the table
    /// unchanged since; whether it was there.
    @discardableResult
    public mutating func remove(key: UnsafeRawBufferPointer, at position: Position) -> Bool {
        makeUnique()
        return storage.remove(slot: position.slot, found: position.found)
    }

    /// Whether the key whose bytes are `key` is present.
    public func contains(key: UnsafeRawBufferPointer) -> Bool {
        storage.find(key, tag: FlatTableStorage.tag(key)).found
    }

    /// Sets `key` to `value`, changed at `revision`.
    public mutating func set(_ key: Key, to value: CanonicalJSON, revision: UInt64) {
        makeUnique()
        key.withUTF8 { k in
            value.bytes.withUnsafeBytes { v in storage.set(UnsafeRawBufferPointer(k), v, isPlain: value.isPlain, revision: revision) }
        }
    }

    /// Sets a key to a value given as bytes (a record read elsewhere).
    public mutating func set(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer, isPlain: Bool, revision: UInt64) {
        makeUnique()
        storage.set(key, value, isPlain: isPlain, revision: revision)
    }

    /// Removes `key`; whether it was there.
    @discardableResult
    public mutating func remove(_ key: Key) -> Bool {
        makeUnique()
        return key.withUTF8 { storage.remove(UnsafeRawBufferPointer($0)) }
    }

    /// Removes the key whose bytes are `key`; whether it was there.
    @discardableResult
    public mutating func remove(key: UnsafeRawBufferPointer) -> Bool {
        makeUnique()
        return storage.remove(key)
    }

    /// Sets or removes `key` as `entry` says (nil: absent).
    public mutating func restore(_ key: Key, _ entry: Entry<CanonicalJSON>?) {
        if let entry { set(key, to: entry.value, revision: entry.revision) } else { remove(key) }
    }

    /// Installs a change set whose revision follows the current one (its write rules were
    /// checked when it was first applied). Returns `false`, changing nothing, when its
    /// revision is not above the current one.
    @discardableResult
    public mutating func install(_ changeSet: ChangeSet<CanonicalJSON>) -> Bool {
        guard changeSet.revision > revision else { return false }
        revision = changeSet.revision
        for change in changeSet.changes {
            if let new = change.new { set(change.key, to: new, revision: revision) } else { remove(change.key) }
        }
        return true
    }

    /// Calls `body` with every record, in the order they lie in memory.
    public func forEach<E: Error>(_ body: (FlatRecord) throws(E) -> Void) throws(E) {
        try storage.forEach(body)
    }

    private mutating func makeUnique() {
        if !isKnownUniquelyReferenced(&storage) { storage = storage.copy() }
    }
}

/// Memory for slabs and indexes: mapped pages from 64 KiB up (freed at once, whatever the
/// allocator's thresholds), the allocator below.
enum FlatMemory {
    static let mapThreshold = 64 << 10

    /// `populate`: the memory is about to be written whole (a block read, an index built):
    /// its pages are mapped at once rather than one fault at a time.
    static func allocate(_ bytes: Int, populate: Bool = false) -> UnsafeMutableRawPointer {
        guard bytes >= mapThreshold else { return UnsafeMutableRawPointer.allocate(byteCount: max(bytes, 1), alignment: 16) }
        let mapped = mmap(nil, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0), -1, 0)
        // Out of memory, as when the allocator fails: the Swift runtime traps there too.
        guard let mapped, mapped != MAP_FAILED else { preconditionFailure("out of memory: cannot map \(bytes) bytes") }
        return mapped
    }

    static func deallocate(_ pointer: UnsafeMutableRawPointer, _ bytes: Int) {
        if bytes >= mapThreshold { munmap(pointer, bytes) } else { pointer.deallocate() }
    }
}
