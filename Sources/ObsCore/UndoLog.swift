// ObsCore — how the revisions not yet durable are undone: for each, what its keys held before
// it, written as bytes into one buffer (no array, key or value object per revision), and the
// lease attachments its write moved. Revisions are confirmed from the oldest and undone from
// the newest; a steady stream of durable writes reuses the buffer and allocates nothing.
//
// Per change: u32 key length · key · u8 flags (1: the key existed, 2: its value was plain) ·
// u64 the key's revision · u32 value length · value (the last three only if it existed).

import ObsStore
import ObsValues
import ObservableKit

struct UndoLog {
    private var bytes: [UInt8] = []
    /// Per revision, oldest first from `head`: where its changes begin in `bytes`, and the
    /// attachment moves of its write.
    private var entries: [(start: Int, moves: [RepositoryCore.AttachmentMove])] = []
    private var head = 0

    /// The revisions it can undo.
    var count: Int { entries.count - head }

    /// Starts the next revision's record; `add` its changes.
    mutating func begin(moves: [RepositoryCore.AttachmentMove]) {
        entries.append((bytes.count, moves))
    }

    /// Records that the key whose bytes are `key` held `old` (nil: it did not exist) at
    /// `revision` (with `isPlain`) before the revision begun last.
    mutating func add(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, isPlain: Bool, revision: UInt64) {
        put(UInt32(key.count))
        bytes.append(contentsOf: key)
        guard let old else {
            bytes.append(0)
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

    /// Undoes the newest revision in `state`: each of its keys back to what it held before,
    /// newest change first, and the revision down by one. Returns its attachment moves.
    mutating func undoLast(in state: inout FlatState) -> [RepositoryCore.AttachmentMove] {
        let (start, moves) = entries.removeLast()
        var changes: [Range<Int>] = []
        bytes.withUnsafeBytes { raw in
            var at = start
            while at < raw.count {
                let begin = at
                at += 4 + Int(raw.loadUnaligned(fromByteOffset: at, as: UInt32.self))
                if raw[at] & 1 != 0 { at += 1 + 8 + 4 + Int(raw.loadUnaligned(fromByteOffset: at + 9, as: UInt32.self)) } else { at += 1 }
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
                } else {
                    state.restore(key: key, value: nil, isPlain: true, revision: 0)
                }
            }
        }
        state.dropRevision()
        bytes.removeSubrange(start...)
        if entries.count == head { removeFirst(0) }
        return moves
    }

    private mutating func put<I: FixedWidthInteger>(_ value: I) {
        withUnsafeBytes(of: value) { bytes.append(contentsOf: $0) }
    }
}
