// ObsCore — how the changes not yet durable are undone: for each revision, what its keys held
// before it, written as bytes into one buffer (no array, key or value object per revision),
// and the lease attachments its write moved (a write that made no revision but moved
// attachments has an entry of its own, with no keys). Changes are confirmed from the oldest
// and undone from the newest; a steady stream of durable writes reuses the buffer and
// allocates nothing.
//
// Per change: u32 key length · key · u8 flags (1: the key existed, 2: its value was plain,
// 4: it was absent with a tombstone) · u64 the key's revision (or its tombstone's) · u32 value
// length · value (the revision only if it existed or had a tombstone; the value only if it
// existed). An undo also puts the tombstones back as they were: a deletion undone takes its
// key's away, a creation undone restores the one it removed.

import ObsStore
import ObsValues
import ObservableKit

struct UndoLog {
    private var bytes: [UInt8] = []
    /// Per change, oldest first from `head`: where its keys begin in `bytes`, the attachment
    /// moves of its write, and whether it is a revision.
    private var entries: [(start: Int, moves: [RepositoryCore.AttachmentMove], revision: Bool)] = []
    private var head = 0

    /// The changes it can undo.
    var count: Int { entries.count - head }

    /// Starts the next change's record (a revision: `add` its keys).
    mutating func begin(moves: [RepositoryCore.AttachmentMove], revision: Bool) {
        entries.append((bytes.count, moves, revision))
    }

    /// How many of the `n` oldest changes are revisions.
    func revisions(inFirst n: Int) -> Int {
        var count = 0
        for i in head..<min(head + n, entries.count) where entries[i].revision { count += 1 }
        return count
    }

    /// Records that the key whose bytes are `key` held `old` (nil: it did not exist — with
    /// `tombstone`, the revision it was deleted at, if one is remembered) at `revision` (with
    /// `isPlain`) before the revision begun last.
    mutating func add(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, isPlain: Bool, revision: UInt64, tombstone: UInt64? = nil) {
        put(UInt32(key.count))
        bytes.append(contentsOf: key)
        guard let old else {
            if let tombstone {
                bytes.append(4)
                put(tombstone)
            } else {
                bytes.append(0)
            }
            return
        }
        bytes.append(1 | (isPlain ? 2 : 0))
        put(revision)
        put(UInt32(old.count))
        bytes.append(contentsOf: old)
    }

    /// `add` for a key and its entry as values.
    mutating func add(_ key: Key, _ entry: Entry<CanonicalJSON>?) {
        key.withUTF8 { key in
            guard let entry else { return add(key: UnsafeRawBufferPointer(key), old: nil, isPlain: true, revision: 0) }
            entry.value.bytes.withUnsafeBytes { add(key: UnsafeRawBufferPointer(key), old: $0, isPlain: entry.value.isPlain, revision: entry.revision) }
        }
    }

    /// Forgets how to undo the `n` oldest revisions (they are durable).
    mutating func removeFirst(_ n: Int) {
        head += n
        if head >= entries.count {
            bytes.removeAll(keepingCapacity: bytes.capacity <= 1 << 20)
            entries.removeAll(keepingCapacity: true)
            head = 0
        } else if head >= 64 && head * 2 >= entries.count {
            let cut = entries[head].start
            bytes.removeFirst(cut)
            entries.removeFirst(head)
            for i in entries.indices { entries[i].start -= cut }
            head = 0
        }
    }

    /// Undoes the newest change in `state` — a revision: each of its keys back to what it held
    /// before, newest first, and the revision down by one. Returns its attachment moves, and
    /// whether it was a revision.
    mutating func undoLast(in state: inout FlatState, tombstones: inout Tombstones) -> (moves: [RepositoryCore.AttachmentMove], revision: Bool) {
        let (start, moves, revision) = entries.removeLast()
        guard revision else {
            if entries.count == head { removeFirst(0) }
            return (moves, false)
        }
        var changes: [Range<Int>] = []
        bytes.withUnsafeBytes { raw in
            var at = start
            while at < raw.count {
                let begin = at
                at += 4 + Int(raw.loadUnaligned(fromByteOffset: at, as: UInt32.self))
                if raw[at] & 1 != 0 {
                    at += 1 + 8 + 4 + Int(raw.loadUnaligned(fromByteOffset: at + 9, as: UInt32.self))
                } else {
                    at += raw[at] & 4 != 0 ? 1 + 8 : 1
                }
                changes.append(begin..<at)
            }
            for change in changes.reversed() {
                let keyCount = Int(raw.loadUnaligned(fromByteOffset: change.lowerBound, as: UInt32.self))
                let key = UnsafeRawBufferPointer(rebasing: raw[(change.lowerBound + 4)..<(change.lowerBound + 4 + keyCount)])
                let flags = raw[change.lowerBound + 4 + keyCount]
                if flags & 1 != 0 {
                    let revision = raw.loadUnaligned(fromByteOffset: change.lowerBound + 5 + keyCount, as: UInt64.self)
                    let value = UnsafeRawBufferPointer(rebasing: raw[(change.lowerBound + 17 + keyCount)..<change.upperBound])
                    state.restore(key: key, value: value, isPlain: flags & 2 != 0, revision: revision)
                    if !tombstones.isEmpty { tombstones.remove(Key(bytes: key)) }  // a deletion undone
                } else {
                    state.restore(key: key, value: nil, isPlain: true, revision: 0)
                    if flags & 4 != 0 {
                        tombstones.restore(Key(bytes: key), at: raw.loadUnaligned(fromByteOffset: change.lowerBound + 5 + keyCount, as: UInt64.self))
                    }
                }
            }
        }
        state.dropRevision()
        bytes.removeSubrange(start...)
        if entries.count == head { removeFirst(0) }
        return (moves, true)
    }

    private mutating func put<I: FixedWidthInteger>(_ value: I) {
        withUnsafeBytes(of: value) { bytes.append(contentsOf: $0) }
    }
}
