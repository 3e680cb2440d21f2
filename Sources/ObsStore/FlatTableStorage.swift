// ObsStore — the memory of a flat table (FlatTable.swift): its slabs of records, its index,
// writing and removing records in place, and compaction.

import ObsValues
import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// The table's memory (see the file header). Mutated only through a `FlatTable` that holds
/// the only reference to it (`makeUnique`), so an instance reachable from two values — or two
/// threads — is never written: that is why it may be `@unchecked Sendable`.
@usableFromInline
final class FlatTableStorage: @unchecked Sendable {
    struct Slab {
        let base: UnsafeMutableRawPointer
        let capacity: Int
        var used = 0
        var dead = 0
    }

    /// Slabs are at most this large (a larger record gets a slab of its own); an address is
    /// `slab << slabShift | offset`.
    static let slabShift = 20
    static let slabLimit = 1 << slabShift
    /// A slot: the stored hash bits above `addressBits`, the address + 1 below (0: empty).
    /// 35 bits: a repository's records may fill 32 GiB. The other 29 are its key's hash bits,
    /// from which the slot's home is chosen (so growing never reads a record) and which a
    /// probe compares first; beyond the bits the home takes (about log2 of the slots), they
    /// are what spares a probe reading records of other keys.
    static let addressBits = 35
    static let addressMask: UInt64 = (1 << addressBits) - 1
    static let tagBits = 64 - addressBits
    static let maxSlabs = 1 << (addressBits - slabShift)

    var slabs: [Slab?] = []
    private var freeIndices: [Int] = []
    var tail = -1
    var slots: UnsafeMutablePointer<UInt64>? = nil
    var capacity = 0
    var count = 0
    var liveBytes = 0
    var deadBytes = 0

    init() {}

    deinit {
        for case let slab? in slabs { FlatMemory.deallocate(slab.base, slab.capacity) }
        if let slots { FlatMemory.deallocate(UnsafeMutableRawPointer(slots), capacity * 8) }
    }

    var memoryBytes: Int { slabs.reduce(capacity * 8) { $0 + ($1?.capacity ?? 0) } }

    func copy() -> FlatTableStorage {
        let copy = FlatTableStorage()
        copy.slabs = slabs.map { slab in
            slab.map { s in
                let base = FlatMemory.allocate(s.capacity)
                base.copyMemory(from: s.base, byteCount: s.used)
                return Slab(base: base, capacity: s.capacity, used: s.used, dead: s.dead)
            }
        }
        copy.freeIndices = freeIndices
        copy.tail = tail
        if let slots {
            let new = FlatMemory.allocate(capacity * 8).bindMemory(to: UInt64.self, capacity: capacity)
            new.update(from: slots, count: capacity)
            copy.slots = new
        }
        copy.capacity = capacity
        copy.count = count
        copy.liveBytes = liveBytes
        copy.deadBytes = deadBytes
        return copy
    }

    // MARK: Hashing and probing

    @usableFromInline
    static func tag(_ key: UnsafeRawBufferPointer) -> UInt64 {
        var hasher = Hasher()
        hasher.combine(bytes: key)
        return UInt64(bitPattern: Int64(hasher.finalize())) >> UInt64(addressBits)
    }

    @inline(__always)
    func home(_ tag: UInt64, _ capacity: Int) -> Int {
        Int(truncatingIfNeeded: (tag &* UInt64(capacity)) >> UInt64(Self.tagBits))
    }

    /// The slot holding `key` (found), or the empty slot where it would go.
    @usableFromInline
    func find(_ key: UnsafeRawBufferPointer, tag: UInt64) -> (slot: Int, found: Bool) {
        guard let slots, capacity > 0 else { return (-1, false) }
        var i = home(tag, capacity)
        while true {
            let s = slots[i]
            if s == 0 { return (i, false) }
            if s >> UInt64(Self.addressBits) == tag, record(at: s).hasKey(key) { return (i, true) }
            i += 1
            if i == capacity { i = 0 }
        }
    }

    @usableFromInline
    func record(in slot: Int) -> FlatRecord { record(at: slots.unsafelyUnwrapped[slot]) }

    func record(at slot: UInt64) -> FlatRecord {
        FlatRecordCodec.read(at: pointer(Int(truncatingIfNeeded: slot & Self.addressMask) - 1)).record.unsafelyUnwrapped
    }

    private func pointer(_ address: Int) -> UnsafeMutableRawPointer {
        slabs[address >> Self.slabShift].unsafelyUnwrapped.base + (address & (Self.slabLimit - 1))
    }

    // MARK: Writing

    /// Makes room in the index for `more` keys beyond the current count.
    func reserve(_ more: Int) {
        let needed = count + more
        guard needed * 20 > capacity * 17 else { return }  // load factor at most 0.85
        var new = max(16, capacity + capacity / 2)
        while needed * 20 > new * 17 { new += new / 2 }
        rehash(to: new)
    }

    func set(_ key: UnsafeRawBufferPointer, _ value: UnsafeRawBufferPointer, isPlain: Bool, revision: UInt64) {
        let tag = Self.tag(key)
        let (slot, found) = find(key, tag: tag)
        set(key, value, isPlain: isPlain, revision: revision, slot: slot, tag: tag, found: found)
    }

    /// `set`, where `find(key, tag:)` (`tag`: the key's) answered `slot` and `found` and nothing
    /// was changed since.
    func set(_ key: UnsafeRawBufferPointer, _ value: UnsafeRawBufferPointer, isPlain: Bool, revision: UInt64, slot: Int, tag: UInt64, found: Bool) {
        var slot = slot
        let size = FlatRecordCodec.size(keyCount: key.count, valueCount: value.count, revision: revision)
        if found {
            let old = slots.unsafelyUnwrapped[slot]
            let address = Int(truncatingIfNeeded: old & Self.addressMask) - 1
            let oldSize = record(at: old).encoded.count
            if size <= oldSize {
                let at = pointer(address)
                _ = FlatRecordCodec.write(to: at, key: key, value: value, isPlain: isPlain, revision: revision)
                FlatRecordCodec.writeDead(to: at + size, count: oldSize - size)
                markDead(address >> Self.slabShift, oldSize - size)
                liveBytes -= oldSize - size
            } else {
                let new = append(size) { FlatRecordCodec.write(to: $0, key: key, value: value, isPlain: isPlain, revision: revision) }
                FlatRecordCodec.writeDead(to: pointer(address), count: oldSize)
                markDead(address >> Self.slabShift, oldSize)
                liveBytes += size - oldSize
                slots.unsafelyUnwrapped[slot] = tag << UInt64(Self.addressBits) | UInt64(new + 1)
            }
            compactIfNeeded()
            return
        }
        if (count + 1) * 20 > capacity * 17 {
            reserve(1)
            slot = find(key, tag: tag).slot
        }
        let new = append(size) { FlatRecordCodec.write(to: $0, key: key, value: value, isPlain: isPlain, revision: revision) }
        slots.unsafelyUnwrapped[slot] = tag << UInt64(Self.addressBits) | UInt64(new + 1)
        count += 1
        liveBytes += size
    }

    func remove(_ key: UnsafeRawBufferPointer) -> Bool {
        let (slot, found) = find(key, tag: Self.tag(key))
        return remove(slot: slot, found: found)
    }

    /// `remove`, where `find` answered `slot` and `found` and nothing was changed since.
    func remove(slot: Int, found: Bool) -> Bool {
        guard found, let slots else { return false }
        let address = Int(truncatingIfNeeded: slots[slot] & Self.addressMask) - 1
        let size = record(at: slots[slot]).encoded.count
        FlatRecordCodec.writeDead(to: pointer(address), count: size)
        markDead(address >> Self.slabShift, size)
        liveBytes -= size
        count -= 1
        // Backward shift: pull later slots of the run into the hole while their home allows.
        var hole = slot
        var j = slot
        while true {
            j += 1
            if j == capacity { j = 0 }
            let s = slots[j]
            if s == 0 { break }
            let k = home(s >> UInt64(Self.addressBits), capacity)
            let movable = hole <= j ? (k <= hole || k > j) : (k <= hole && k > j)
            if movable {
                slots[hole] = s
                hole = j
            }
        }
        slots[hole] = 0
        compactIfNeeded()
        return true
    }

    private func markDead(_ slab: Int, _ bytes: Int) {
        guard bytes > 0 else { return }
        slabs[slab]!.dead += bytes
        deadBytes += bytes
    }

    /// Writes a record of `size` bytes at the end of the last slab (or a new one) with
    /// `write`; returns its address.
    private func append(_ size: Int, _ write: (UnsafeMutableRawPointer) -> Int) -> Int {
        if tail < 0 || slabs[tail]!.capacity - slabs[tail]!.used < size {
            // Slabs grow with the table, so a small repository holds a small one.
            var slabCapacity = 256
            while slabCapacity < size || (slabCapacity < Self.slabLimit && slabCapacity < liveBytes / 4) { slabCapacity *= 2 }
            tail = newSlab(size > Self.slabLimit ? size : min(slabCapacity, Self.slabLimit))
        }
        let offset = slabs[tail]!.used
        let written = write(slabs[tail]!.base + offset)
        assert(written == size)
        slabs[tail]!.used += size
        return tail << Self.slabShift | offset
    }

    private func newSlab(_ capacity: Int) -> Int {
        let slab = Slab(base: FlatMemory.allocate(capacity), capacity: capacity)
        if let free = freeIndices.popLast() {
            slabs[free] = slab
            return free
        }
        // Resource exhaustion, as running out of memory is: 32 GiB of records in one repository.
        precondition(slabs.count < Self.maxSlabs, "a repository's records cannot fill more than \(Self.maxSlabs) slabs of 1 MiB")
        slabs.append(slab)
        return slabs.count - 1
    }

    func rehash(to newCapacity: Int) {
        let new = FlatMemory.allocate(newCapacity * 8, populate: true).bindMemory(to: UInt64.self, capacity: newCapacity)
        new.initialize(repeating: 0, count: newCapacity)
        if let slots {
            for i in 0..<capacity where slots[i] != 0 {
                var j = home(slots[i] >> UInt64(Self.addressBits), newCapacity)
                while new[j] != 0 {
                    j += 1
                    if j == newCapacity { j = 0 }
                }
                new[j] = slots[i]
            }
            FlatMemory.deallocate(UnsafeMutableRawPointer(slots), capacity * 8)
        }
        slots = new
        capacity = newCapacity
    }

    // MARK: Compaction

    /// Once dead bytes pass a quarter of the slabs' contents, empties the slabs with the most
    /// of them until they are below an eighth.
    private func compactIfNeeded() {
        guard deadBytes > 4096, deadBytes * 4 > liveBytes + deadBytes else { return }
        let candidates = slabs.indices.filter { $0 != tail && (slabs[$0]?.dead ?? 0) > 0 }.sorted { slabs[$0]!.dead > slabs[$1]!.dead }
        for index in candidates {
            evacuate(index)
            if deadBytes * 8 <= liveBytes + deadBytes { break }
        }
    }

    /// Moves slab `index`'s live records to the end and frees it.
    private func evacuate(_ index: Int) {
        let slab = slabs[index]!
        var offset = 0
        while offset < slab.used {
            let (record, size) = FlatRecordCodec.read(at: slab.base + offset)
            if let record {
                let address = UInt64(index << Self.slabShift | offset) + 1
                var i = home(Self.tag(record.keyBytes), capacity)
                while slots.unsafelyUnwrapped[i] & Self.addressMask != address {
                    i += 1
                    if i == capacity { i = 0 }
                }
                let source = slab.base + offset
                let new = append(size) { at in
                    at.copyMemory(from: source, byteCount: size)
                    return size
                }
                slots.unsafelyUnwrapped[i] = slots.unsafelyUnwrapped[i] & ~Self.addressMask | UInt64(new + 1)
            }
            offset += size
        }
        deadBytes -= slab.dead
        FlatMemory.deallocate(slab.base, slab.capacity)
        slabs[index] = nil
        freeIndices.append(index)
    }

    // MARK: Reading

    func forEach<E: Error>(_ body: (FlatRecord) throws(E) -> Void) throws(E) {
        for case let slab? in slabs {
            var offset = 0
            while offset < slab.used {
                let (record, size) = FlatRecordCodec.read(at: slab.base + offset)
                if let record { try body(record) }
                offset += size
            }
        }
    }
}
