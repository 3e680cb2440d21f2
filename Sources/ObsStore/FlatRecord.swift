// ObsStore — one key's entry as flat bytes: how a repository's table keeps it in memory
// (FlatTable.swift) and how the snapshot file stores it (Snapshot.swift), byte for byte, so
// a snapshot loads by reading its blocks straight into the table's slabs.
//
// A record is
//
//   varint (key length + 2) · varint (value length << 1 | plain) · varint revision · key · value
//
// (LEB128 varints), so a small entry costs its key and value plus 4–6 bytes. A record's first
// byte is never 0 or 1; those mark dead bytes in a slab: `0` one dead byte, `1` followed by
// a varint a run of that many dead bytes (its own two or more bytes included). A value of
// length 0 (never a JSON value) marks a deleted key in the checkpointer's table of changes.

import ObsValues
import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// One entry read in place: valid while the table (or buffer) that holds it is not mutated.
public struct FlatRecord {
    /// The whole record (to copy it).
    public let encoded: UnsafeRawBufferPointer
    public let keyBytes: UnsafeRawBufferPointer
    /// The canonical value (empty: a deletion, in a table of changes).
    public let valueBytes: UnsafeRawBufferPointer
    public let isPlain: Bool
    public let revision: UInt64

    /// The key.
    public var key: Key { Key(String(decoding: keyBytes, as: UTF8.self)) }
    /// The value, copied out.
    public var value: CanonicalJSON { CanonicalJSON(canonical: Array(valueBytes), isPlain: isPlain) }
    /// The entry, copied out.
    public var entry: Entry<CanonicalJSON> { Entry(value: value, revision: revision) }
    /// Whether this record marks a deleted key (tables of changes only).
    public var isDeletion: Bool { valueBytes.isEmpty }

    /// Whether the value is equal, as JSON, to `other` (the contract's "changes nothing").
    public func valueEquals(_ other: CanonicalJSON) -> Bool {
        other.bytes.withUnsafeBytes { valueEquals(canonical: $0, isPlain: other.isPlain) }
    }

    /// Whether the value is equal, as JSON, to the value whose canonical encoding is `other`.
    @inlinable
    public func valueEquals(canonical other: UnsafeRawBufferPointer, isPlain otherIsPlain: Bool) -> Bool {
        if other.count == valueBytes.count, other.isEmpty || memcmp(other.baseAddress!, valueBytes.baseAddress!, other.count) == 0 {
            return true
        }
        if isPlain && otherIsPlain { return false }
        return value == CanonicalJSON(canonical: Array(other), isPlain: otherIsPlain)
    }

    /// Whether the key's bytes are `key`'s.
    @inline(__always)
    func hasKey(_ key: UnsafeRawBufferPointer) -> Bool {
        key.count == keyBytes.count && (key.isEmpty || memcmp(key.baseAddress!, keyBytes.baseAddress!, key.count) == 0)
    }
}

/// Encodes and decodes records (see the file header).
public enum FlatRecordCodec {
    /// Why bytes are not a record (a damaged or foreign snapshot).
    public struct Malformed: Error, Sendable {
        public let offset: Int
        public let reason: String
    }

    /// The size of the record of a key of `keyCount` bytes and a value of `valueCount` bytes at `revision`.
    @inline(__always)
    public static func size(keyCount: Int, valueCount: Int, revision: UInt64) -> Int {
        varintSize(UInt64(keyCount + 2)) + varintSize(UInt64(valueCount) << 1 | 1) + varintSize(revision) + keyCount + valueCount
    }

    /// Writes the record at `at`, which has room for `size(…)` bytes; returns its size.
    @inline(__always)
    public static func write(
        to at: UnsafeMutableRawPointer, key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer, isPlain: Bool, revision: UInt64
    ) -> Int {
        var n = writeVarint(UInt64(key.count + 2), to: at)
        n += writeVarint(UInt64(value.count) << 1 | (isPlain ? 1 : 0), to: at + n)
        n += writeVarint(revision, to: at + n)
        if let base = key.baseAddress, key.count > 0 { (at + n).copyMemory(from: base, byteCount: key.count) }
        n += key.count
        if let base = value.baseAddress, value.count > 0 { (at + n).copyMemory(from: base, byteCount: value.count) }
        return n + value.count
    }

    /// Marks `count` bytes at `at` dead (see the file header).
    @inline(__always)
    public static func writeDead(to at: UnsafeMutableRawPointer, count: Int) {
        if count == 1 {
            at.storeBytes(of: 0, as: UInt8.self)
        } else if count > 1 {
            at.storeBytes(of: 1, as: UInt8.self)
            _ = writeVarint(UInt64(count), to: at + 1)
        }
    }

    /// What lies at `at` in memory this process wrote: a record, or dead bytes; with its size.
    @inline(__always)
    public static func read(at: UnsafeRawPointer) -> (record: FlatRecord?, size: Int) {
        let first = at.load(as: UInt8.self)
        if first == 0 { return (nil, 1) }
        if first == 1 {
            var n = 1
            return (nil, Int(readVarint(at, &n)))
        }
        var n = 0
        let keyCount = Int(readVarint(at, &n)) - 2
        let lengthAndPlain = readVarint(at, &n)
        let revision = readVarint(at, &n)
        let valueCount = Int(lengthAndPlain >> 1)
        let key = UnsafeRawBufferPointer(start: at + n, count: keyCount)
        let value = UnsafeRawBufferPointer(start: at + n + keyCount, count: valueCount)
        let size = n + keyCount + valueCount
        return (
            FlatRecord(
                encoded: UnsafeRawBufferPointer(start: at, count: size), keyBytes: key, valueBytes: value, isPlain: lengthAndPlain & 1 != 0,
                revision: revision),
            size
        )
    }

    /// The record or dead run at `offset` of bytes read from a file, every length checked.
    public static func readChecked(_ bytes: UnsafeRawBufferPointer, at offset: Int) throws(Malformed) -> (record: FlatRecord?, size: Int) {
        guard offset < bytes.count, let base = bytes.baseAddress else { throw Malformed(offset: offset, reason: "nothing to read") }
        var n = offset
        let first = bytes[offset]
        if first == 0 { return (nil, 1) }
        if first == 1 {
            n += 1
            let run = try checkedVarint(bytes, &n)
            guard run >= 2, run <= UInt64(bytes.count - offset) else { throw Malformed(offset: offset, reason: "a dead run of \(run) bytes") }
            return (nil, Int(run))
        }
        let keyField = try checkedVarint(bytes, &n)
        let lengthAndPlain = try checkedVarint(bytes, &n)
        let revision = try checkedVarint(bytes, &n)
        let rest = UInt64(bytes.count - n)
        guard keyField >= 2, keyField - 2 <= rest, lengthAndPlain >> 1 <= rest - (keyField - 2) else {
            throw Malformed(offset: offset, reason: "a record longer than its block")
        }
        let keyCount = Int(keyField - 2)
        let valueCount = Int(lengthAndPlain >> 1)
        let size = n - offset + keyCount + valueCount
        return (
            FlatRecord(
                encoded: UnsafeRawBufferPointer(start: base + offset, count: size),
                keyBytes: UnsafeRawBufferPointer(start: base + n, count: keyCount),
                valueBytes: UnsafeRawBufferPointer(start: base + n + keyCount, count: valueCount), isPlain: lengthAndPlain & 1 != 0,
                revision: revision),
            size
        )
    }

    // MARK: Varints

    @inline(__always)
    public static func varintSize(_ value: UInt64) -> Int {
        var v = value
        var n = 1
        while v >= 0x80 {
            v >>= 7
            n += 1
        }
        return n
    }

    @inline(__always)
    public static func writeVarint(_ value: UInt64, to at: UnsafeMutableRawPointer) -> Int {
        var v = value
        var n = 0
        while v >= 0x80 {
            at.storeBytes(of: UInt8(truncatingIfNeeded: v) | 0x80, toByteOffset: n, as: UInt8.self)
            v >>= 7
            n += 1
        }
        at.storeBytes(of: UInt8(truncatingIfNeeded: v), toByteOffset: n, as: UInt8.self)
        return n + 1
    }

    @inline(__always)
    static func readVarint(_ at: UnsafeRawPointer, _ n: inout Int) -> UInt64 {
        var value: UInt64 = 0
        var shift: UInt64 = 0
        while true {
            let byte = at.load(fromByteOffset: n, as: UInt8.self)
            n += 1
            value |= UInt64(byte & 0x7F) << shift
            if byte < 0x80 { return value }
            shift += 7
        }
    }

    static func checkedVarint(_ bytes: UnsafeRawBufferPointer, _ n: inout Int) throws(Malformed) -> UInt64 {
        var value: UInt64 = 0
        var shift: UInt64 = 0
        let start = n
        while true {
            guard n < bytes.count, shift < 64 else { throw Malformed(offset: start, reason: "a length that does not end") }
            let byte = bytes[n]
            n += 1
            value |= UInt64(byte & 0x7F) << shift
            if byte < 0x80 { return value }
            shift += 7
        }
    }
}
