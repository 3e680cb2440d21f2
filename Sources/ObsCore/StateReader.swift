// ObsCore — a repository's state read as it was at one revision, a piece at a time, while
// writes go on: what a subscription's `snapshot` and a catch-up's `values` send. Of any size,
// without a copy of the values: the keys to send are copied once (their bytes, in one buffer),
// and each piece reads their values under the lock where they lie. A write that changes a key
// while a reader is open first keeps the key's entry as it was when the reader opened (once per
// key), so every piece reads the values of the reader's revision — the memory an open reader
// costs is its key list and the keys written meanwhile, never the repository's values.

import ObsStore
import ObsValues
import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// Keys, their bytes in one buffer: no object per key.
public struct KeyList: Sendable {
    private var bytes: [UInt8] = []
    /// Where each key begins in `bytes`, and where the last ends.
    private var starts: [Int] = [0]

    public init() {}

    public var count: Int { starts.count - 1 }
    public var isEmpty: Bool { starts.count == 1 }
    /// The bytes of every key.
    public var byteCount: Int { bytes.count }

    mutating func append(_ key: UnsafeRawBufferPointer) {
        bytes.append(contentsOf: key)
        starts.append(bytes.count)
    }

    /// Calls `body` with the bytes of key `i`.
    public func withKey<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R {
        bytes.withUnsafeBytes { body(UnsafeRawBufferPointer(rebasing: $0[starts[i]..<starts[i + 1]])) }
    }

    /// The same keys in byte order.
    public func sorted() -> KeyList {
        bytes.withUnsafeBytes { raw -> KeyList in
            func key(_ i: Int) -> UnsafeRawBufferPointer { UnsafeRawBufferPointer(rebasing: raw[starts[i]..<starts[i + 1]]) }
            let order = (0..<count).sorted { a, b in
                let x = key(a)
                let y = key(b)
                let common = min(x.count, y.count)
                let c = common == 0 ? 0 : memcmp(x.baseAddress!, y.baseAddress!, common)
                return c != 0 ? c < 0 : x.count < y.count
            }
            var list = KeyList()
            list.bytes.reserveCapacity(bytes.count)
            list.starts.reserveCapacity(starts.count)
            for i in order { list.append(key(i)) }
            return list
        }
    }
}

extension RepositoryCore {
    /// The keys `selection` selects — of those last changed after `revision`, when it is given
    /// (a catch-up's `values`) — unsorted.
    public func keys(_ selection: Selection, changedAfter revision: UInt64? = nil) -> KeyList {
        var list = KeyList()
        let after = revision ?? 0
        switch selection {
        case .keys(let keys):
            for key in keys {
                key.withUTF8 { utf8 in
                    let bytes = UnsafeRawBufferPointer(utf8)
                    data.withRecord(key: bytes) { record, _ in
                        if let record, record.revision > after { list.append(bytes) }
                    }
                }
            }
        case .prefix(let prefix) where !prefix.isEmpty:
            let prefixBytes = Array(prefix.utf8)
            data.forEach { record in
                if record.revision > after, record.keyBytes.starts(with: prefixBytes) { list.append(record.keyBytes) }
            }
        case .all, .prefix:
            data.forEach { record in
                if record.revision > after { list.append(record.keyBytes) }
            }
        }
        return list
    }

    /// Opens a reader of the state as it is now: from now on, a change keeps what its keys
    /// held for it, until `closeReader`. Returns its number.
    public mutating func openReader() -> UInt64 {
        nextReader += 1
        readers[nextReader] = StateReader(revision: data.revision)
        return nextReader
    }

    /// Closes reader `id` (what it kept is dropped).
    public mutating func closeReader(_ id: UInt64) {
        readers[id] = nil
    }

    /// How many readers are open (in-process tests look).
    public var openReaders: Int { readers.count }

    /// Writes the keys of `keys` from `start` with their values — as they were when reader
    /// `reader` opened (nil: as they are now) — as members of a JSON object (`"key":value`,
    /// comma-separated; `first`: no comma before the first written), until `sink` has grown by
    /// `maxBytes` or more. A key absent at that revision (storage undid what it was read at) is
    /// left out. Returns the index of the first key not written.
    public func writeMembers(of keys: KeyList, from start: Int, reader: UInt64?, maxBytes: Int, first: Bool, into sink: inout [UInt8]) -> Int {
        let kept = reader.flatMap { readers[$0]?.kept } ?? [:]
        let limit = maxBytes > Int.max - sink.count ? Int.max : sink.count + maxBytes
        var i = start
        var first = first
        while i < keys.count, sink.count < limit {
            keys.withKey(i) { key in
                func member(_ value: UnsafeRawBufferPointer) {
                    if !first { sink.append(UInt8(ascii: ",")) }
                    first = false
                    sink.writeJSONString(utf8: key)
                    sink.append(UInt8(ascii: ":"))
                    sink.append(contentsOf: value)
                }
                if !kept.isEmpty, let entry = kept[Key(bytes: key)] {
                    if let entry { entry.value.bytes.withUnsafeBytes { member($0) } }
                } else {
                    data.withRecord(key: key) { record, _ in
                        if let record { member(record.valueBytes) }
                    }
                }
            }
            i += 1
        }
        return i
    }

    /// Before a change of the key whose bytes are `key` (its entry now `record`): each open
    /// reader keeps the entry, unless it kept one for the key already.
    mutating func keepForReaders(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, isPlain: Bool, revision: UInt64) {
        let k = Key(bytes: key)
        for id in readers.keys where readers[id]!.kept[k] == nil {
            readers[id]!.kept[k] = .some(old.map { Entry(value: CanonicalJSON(canonical: Array($0), isPlain: isPlain), revision: revision) })
        }
    }
}

/// An open reader: the revision it reads, and the entries of the keys changed since, as they
/// were at it (`.some(nil)`: absent).
struct StateReader: Sendable {
    let revision: UInt64
    var kept: [Key: Entry<CanonicalJSON>?] = [:]
}
