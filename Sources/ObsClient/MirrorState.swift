// ObsClient — what a mirror holds, merged from three sources that may arrive in any
// order: snapshots and change events of its watch, and the writes made through its
// session (LocalWrites.swift), which a subscription with `echo: false` never sees as events.
//
// Every key carries the revision its value is at (a deleted key keeps one too), and a
// value only ever replaces one at a lower revision: so a write's reply that is read after
// a later revision's event, or an event that arrives after the write it precedes, leaves
// the newer value in place. A coalesced event (changes at `revision`, covering `from`
// onward) is applied the same way: each of its keys is at `revision`. A snapshot replaces
// everything except the values this process wrote on the snapshot's connection (or a
// later one) after it was taken — those the daemon will not echo.

import ObsProtocol
import ObservableKit

/// A mirror's keys and values with the revision of each.
struct MirrorState: Sendable {
    /// The revision a key's value is at, and for a value this process wrote, the connection
    /// it wrote it on.
    struct Stamp: Sendable, Equatable {
        var revision: UInt64
        var connection: UInt64?
    }

    let selection: Selection
    /// The highest revision applied.
    private(set) var revision: UInt64 = 0
    /// The selected keys that exist.
    private(set) var values: [Key: JSONValue] = [:]
    /// Whether a snapshot was applied.
    private(set) var isLoaded = false
    /// A stamp for every key of `values`, and for keys deleted since the last snapshot.
    private(set) var stamps: [Key: Stamp] = [:]

    init(selection: Selection) {
        self.selection = selection
    }

    /// Applies an event received on connection `connection` (`ObsClient.serial`). Returns
    /// the keys it wrote, or nil for a snapshot (everything).
    mutating func apply(_ event: WatchEvent, connection: UInt64) -> [Key]? {
        switch event {
        case .snapshot(let at, let snapshot, _):
            applySnapshot(at: at, snapshot, connection: connection)
            return nil
        case .change(let event):
            var written: [Key] = []
            for change in event.changes where selection.matches(change.key) {
                if set(change.key, change.new, Stamp(revision: event.revision, connection: nil)) { written.append(change.key) }
            }
            revision = max(revision, event.revision)
            return written
        }
    }

    /// Applies a write of this process; returns the selected keys it wrote.
    mutating func apply(_ write: LocalWrite) -> [Key] {
        var written: [Key] = []
        var selected = false
        for effect in write.effects where selection.matches(effect.key) {
            selected = true
            if set(effect.key, effect.new, Stamp(revision: write.revision, connection: write.connection)) { written.append(effect.key) }
        }
        if selected { revision = max(revision, write.revision) }
        return written
    }

    /// Sets `key` unless its value is at `stamp.revision` or later; whether it did.
    private mutating func set(_ key: Key, _ value: JSONValue?, _ stamp: Stamp) -> Bool {
        if let current = stamps[key], current.revision >= stamp.revision { return false }
        values[key] = value
        stamps[key] = stamp
        return true
    }

    private mutating func applySnapshot(at snapshotRevision: UInt64, _ snapshot: [Key: JSONValue], connection: UInt64) {
        // Writes of this process the snapshot cannot hold: made after it, on its connection
        // or a later one. (On an earlier connection, a write is either in the snapshot or
        // lost with a history the daemon no longer has.)
        let kept = stamps.filter { _, stamp in
            guard let written = stamp.connection else { return false }
            return stamp.revision > snapshotRevision && written >= connection
        }
        var next: [Key: JSONValue] = [:]
        var nextStamps: [Key: Stamp] = [:]
        next.reserveCapacity(snapshot.count)
        nextStamps.reserveCapacity(snapshot.count)
        for (key, value) in snapshot where selection.matches(key) {
            next[key] = value
            nextStamps[key] = Stamp(revision: snapshotRevision, connection: nil)
        }
        var top = snapshotRevision
        for (key, stamp) in kept {
            next[key] = values[key]
            nextStamps[key] = stamp
            top = max(top, stamp.revision)
        }
        values = next
        stamps = nextStamps
        revision = top
        isLoaded = true
    }
}
