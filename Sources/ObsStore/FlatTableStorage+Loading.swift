// ObsStore — a flat table loaded from a snapshot: its blocks adopted as slabs as they are
// read (each record checked), then indexed in one pass.

import ObsValues
import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

extension FlatTableStorage {
    /// Whether slabs were adopted (or written).
    var hasBlocks: Bool { !slabs.isEmpty }

    /// Adopts `block` (from `FlatMemory.allocate(blockCapacity)`, freed with the table) as a
    /// slab of records read from a snapshot, checking every record; returns how many it
    /// holds. `buildIndex` indexes them once every block is in.
    func adoptBlock(_ block: UnsafeMutableRawPointer, blockCapacity: Int, used: Int) throws(FlatRecordCodec.Malformed) -> Int {
        let index = slabs.count
        guard index < Self.maxSlabs else {
            FlatMemory.deallocate(block, blockCapacity)
            throw FlatRecordCodec.Malformed(offset: 0, reason: "more than the \(Self.maxSlabs) blocks of entries a repository may hold")
        }
        slabs.append(Slab(base: block, capacity: blockCapacity, used: used))
        tail = index
        let bytes = UnsafeRawBufferPointer(start: block, count: used)
        var offset = 0
        var records = 0
        while offset < used {
            let (record, size) = try FlatRecordCodec.readChecked(bytes, at: offset)
            if let record {
                guard !record.isDeletion else { throw FlatRecordCodec.Malformed(offset: offset, reason: "a record without a value") }
                // Past a slab's size only the first record has an address.
                guard offset < Self.slabLimit else { throw FlatRecordCodec.Malformed(offset: offset, reason: "a block larger than a slab with more than one record") }
                records += 1
                liveBytes += size
            } else {
                slabs[index]!.dead += size
                deadBytes += size
            }
            offset += size
        }
        count += records
        return records
    }

    /// Indexes the records of the adopted slabs (checked by `adoptBlock`). A key stored twice
    /// is damage.
    ///
    /// Records are hashed in the order they lie, their slots sorted by hash (so by home slot),
    /// then placed in one pass — writing the index in order, not at random: for millions of
    /// keys, placing slot by slot waits on memory at every key.
    func buildIndex() throws(FlatRecordCodec.Malformed) {
        let records = count
        guard records > 0 else { return }
        if capacity * 4 < records * 5 { rehash(to: max(16, records * 5 / 4 + 16)) }  // a load factor of 0.8: room to grow a little
        let bytes = records * 8
        let sorted = FlatMemory.allocate(bytes, populate: true).bindMemory(to: UInt64.self, capacity: records)
        let scratch = FlatMemory.allocate(bytes, populate: true).bindMemory(to: UInt64.self, capacity: records)
        defer {
            FlatMemory.deallocate(UnsafeMutableRawPointer(sorted), bytes)
            FlatMemory.deallocate(UnsafeMutableRawPointer(scratch), bytes)
        }
        var n = 0
        for (index, slab) in slabs.enumerated() {
            guard let slab else { continue }
            var offset = 0
            while offset < slab.used {
                let (record, size) = FlatRecordCodec.read(at: slab.base + offset)
                if let record {
                    sorted[n] = Self.tag(record.keyBytes) << UInt64(Self.addressBits) | UInt64(index << Self.slabShift | offset) + 1
                    n += 1
                }
                offset += size
            }
        }
        Self.sortByTag(sorted, scratch, count: n)
        // Placed in home order, each at its home or just after the one placed before it — the
        // table linear probing would build. Those that run past the end wrap around, placed
        // the ordinary way once the rest are in.
        guard let slots else { return }
        var last = -1
        var wrapped: [UInt64] = []
        var run = 0  // where the run of equal tags, checked for a key stored twice, begins
        for i in 0..<n {
            let s = sorted[i]
            let tag = s >> UInt64(Self.addressBits)
            if i > 0, tag == sorted[i - 1] >> UInt64(Self.addressBits) {
                let key = record(at: s).keyBytes
                for j in run..<i where record(at: sorted[j]).hasKey(key) {
                    throw FlatRecordCodec.Malformed(offset: 0, reason: "key \(record(at: s).key.debugDescription) stored twice")
                }
            } else {
                run = i
            }
            let position = max(home(tag, capacity), last + 1)
            if position >= capacity {
                wrapped.append(s)
                continue
            }
            slots[position] = s
            last = position
        }
        for s in wrapped {
            var i = 0
            while slots[i] != 0 { i += 1 }
            slots[i] = s
        }
    }

    /// Sorts `values` by their top `tagBits` bits: two passes of a radix sort.
    fileprivate static func sortByTag(_ values: UnsafeMutablePointer<UInt64>, _ scratch: UnsafeMutablePointer<UInt64>, count: Int) {
        let low = tagBits / 2
        var from = values
        var to = scratch
        for (shift, width) in [(addressBits, low), (addressBits + low, tagBits - low)] {
            var counts = [Int](repeating: 0, count: (1 << width) + 1)
            let mask = UInt64(1 << width) - 1
            for i in 0..<count { counts[Int((from[i] >> UInt64(shift)) & mask) + 1] += 1 }
            for d in 1..<counts.count { counts[d] += counts[d - 1] }
            for i in 0..<count {
                let digit = Int((from[i] >> UInt64(shift)) & mask)
                to[counts[digit]] = from[i]
                counts[digit] += 1
            }
            swap(&from, &to)
        }
        // Two passes: the sorted values are back in `values`.
    }
}
