// ObsClient — what a mirror holds, merged from three sources that may arrive in any
// order: snapshots and change events of its watch, and the writes made through its
// session (LocalWrites.swift), which a subscription with `echo: false` never sees as events.
//
// Every key carries a stamp: the revision its value is at (a deleted key keeps one too)
// and the connection it was read on. A value only ever replaces an older one. Within one
// connection that is one at a lower revision: so a write's reply that is read after a later
// revision's event, or an event that arrives after the write it precedes, leaves the newer
// value in place. Across connections revisions may belong to different histories (epochs):
// an in-memory daemon that restarted counts from 0 again. Two facts order them: a session's
// connections are one after another, so what was read on a later connection was sent after
// everything read on an earlier one; and a history changes only between connections, and
// the watch's first event in a new one is its resync snapshot, which replaces every stamp.
// So a write's reply read on a later connection is newer than any stamp of an earlier one,
// whatever the revisions say (its history may be the new one, before the resync arrives);
// an event read on a later connection is in the stamps' history and compares by revision
// (a `since` replay repeats older revisions); and anything read on an earlier connection
// than a stamp is older. A coalesced event (changes at `revision`, covering `from` onward)
// is applied the same way: each of its keys is at `revision`, and so is a catch-up (the keys
// that changed after the watch's position, as they are at `revision`; the deleted ones
// removed), of which only the keys whose value it changes count as written. A snapshot
// replaces everything except the values this process wrote after it was taken — on its
// connection at a later revision, or on a later connection — which the daemon will not echo;
// the keys it wrote are those whose value (or lease end) it changed.
//
// A deleted key keeps its stamp as a tombstone, so that an older message read late does not
// bring it back. Tombstones are bounded (`maxTombstones`): past the bound the oldest half
// are forgotten, so a mirror of churning keys (created, deleted, never seen again) does not
// grow between snapshots. A message older than the thousands of deletions kept would have to
// be overtaken by all of them; the daemon's delivery lag is far shorter.

import ObsProtocol
import ObservableKit

/// A mirror's keys and values with the revision of each.
struct MirrorState: Sendable {
    /// The revision a key's value is at, the connection it was read on (`ObsClient.serial`),
    /// and whether this process wrote it (read from its write's reply).
    struct Stamp: Sendable, Equatable {
        var revision: UInt64
        var connection: UInt64
        var own: Bool

        /// Whether a value read as `self` replaces one stamped `current` (see the file header).
        func supersedes(_ current: Stamp) -> Bool {
            if connection == current.connection { return revision > current.revision }
            if connection < current.connection { return false }
            return own || revision > current.revision
        }
    }

    let selection: Selection
    /// The revision of the newest value applied, in the history of the connection it was read on.
    private(set) var revision: UInt64 = 0
    /// The stamp of `revision`.
    private var newest = Stamp(revision: 0, connection: 0, own: false)
    /// The selected keys that exist.
    private(set) var values: [Key: JSONValue] = [:]
    /// Whether a snapshot was applied.
    private(set) var isLoaded = false
    /// A stamp for every key of `values`.
    private(set) var stamps: [Key: Stamp] = [:]
    /// The stamps of the newest deletions since the last snapshot (at most `maxTombstones`).
    private(set) var tombstones: [Key: Stamp] = [:]
    /// For the deleted keys whose deletion was a lease's end (an event with `lease`): which
    /// lease, and why it ended. A subset of `tombstones`' keys; a snapshot clears it.
    private(set) var leaseEnds: [Key: LeaseEnd] = [:]
    /// The most tombstones kept; past it, the newest half of them are.
    static let maxTombstones = 4096

    init(selection: Selection) {
        self.selection = selection
    }

    /// Applies an event received on connection `connection` (`ObsClient.serial`). Returns the
    /// keys it wrote: for a snapshot, those whose value (or lease end) it changed.
    mutating func apply(_ event: WatchEvent, connection: UInt64) -> [Key] {
        switch event {
        case .snapshot(let at, let snapshot, _):
            let (before, endsBefore) = (values, leaseEnds)
            applySnapshot(at: at, snapshot, connection: connection)
            var changed = Swift.Set(endsBefore.keys)
            for (key, value) in values where before[key] != value { changed.insert(key) }
            for key in before.keys where values[key] == nil { changed.insert(key) }
            return Array(changed)
        case .change(let event):
            let stamp = Stamp(revision: event.revision, connection: connection, own: false)
            var written: [Key] = []
            for change in event.changes where selection.matches(change.key) {
                if set(change.key, change.new, stamp) {
                    written.append(change.key)
                    if change.new == nil, let lease = event.lease { leaseEnds[change.key] = lease }
                }
            }
            advance(to: stamp)
            return written
        case .catchUp(let event):
            // State, not history: a key it lists may hold the value it had, a deleted key may
            // never have existed here; neither is a change.
            let stamp = Stamp(revision: event.revision, connection: connection, own: false)
            var written: [Key] = []
            for (key, value) in event.entries where selection.matches(key) {
                let before = values[key]
                if set(key, value, stamp), before != value { written.append(key) }
            }
            for key in event.deleted where selection.matches(key) {
                let existed = values[key] != nil
                if set(key, nil, stamp), existed { written.append(key) }
            }
            advance(to: stamp)
            return written
        }
    }

    /// Records that the values are those of `revision` (of the history of connection
    /// `connection`): a `sync` found every selected change through it applied.
    mutating func markCurrent(at revision: UInt64, connection: UInt64) {
        advance(to: Stamp(revision: revision, connection: connection, own: false))
    }

    /// Applies a write of this process; returns the selected keys it wrote.
    mutating func apply(_ write: LocalWrite) -> [Key] {
        let stamp = Stamp(revision: write.revision, connection: write.connection, own: true)
        var written: [Key] = []
        var selected = false
        for effect in write.effects where selection.matches(effect.key) {
            selected = true
            if set(effect.key, effect.new, stamp) { written.append(effect.key) }
        }
        if selected { advance(to: stamp) }
        return written
    }

    /// Sets `key` (deletes it for nil) unless its value is as new as `stamp` or newer; whether it did.
    private mutating func set(_ key: Key, _ value: JSONValue?, _ stamp: Stamp) -> Bool {
        if let current = stamps[key] ?? tombstones[key], !stamp.supersedes(current) { return false }
        leaseEnds[key] = nil
        if let value {
            values[key] = value
            stamps[key] = stamp
            tombstones[key] = nil
        } else {
            values[key] = nil
            stamps[key] = nil
            tombstones[key] = stamp
            if tombstones.count > Self.maxTombstones { forgetOldestTombstones() }
        }
        return true
    }

    /// Keeps the newest half of the tombstones (by connection, then revision).
    private mutating func forgetOldestTombstones() {
        let newest = tombstones.sorted { a, b in
            (a.value.connection, a.value.revision) > (b.value.connection, b.value.revision)
        }.prefix(Self.maxTombstones / 2)
        tombstones = Dictionary(uniqueKeysWithValues: newest.map { ($0.key, $0.value) })
        leaseEnds = leaseEnds.filter { tombstones[$0.key] != nil }
    }

    private mutating func advance(to stamp: Stamp) {
        guard stamp.supersedes(newest) else { return }
        newest = stamp
        revision = stamp.revision
    }

    private mutating func applySnapshot(at snapshotRevision: UInt64, _ snapshot: [Key: JSONValue], connection: UInt64) {
        // Writes of this process the snapshot cannot hold: made after it — on its connection
        // at a later revision, or on a later connection, whatever its revision (its history
        // may be a newer one). (On an earlier connection, a write is either in the snapshot or
        // lost with a history the daemon no longer has.)
        let taken = Stamp(revision: snapshotRevision, connection: connection, own: false)
        let kept = stamps.filter { _, stamp in stamp.own && stamp.supersedes(taken) }
        tombstones = tombstones.filter { _, stamp in stamp.own && stamp.supersedes(taken) }
        leaseEnds = [:]
        var next: [Key: JSONValue] = [:]
        var nextStamps: [Key: Stamp] = [:]
        next.reserveCapacity(snapshot.count)
        nextStamps.reserveCapacity(snapshot.count)
        for (key, value) in snapshot where selection.matches(key) && tombstones[key] == nil {
            next[key] = value
            nextStamps[key] = taken
        }
        newest = taken
        revision = snapshotRevision
        for (key, stamp) in kept {
            next[key] = values[key]
            nextStamps[key] = stamp
            advance(to: stamp)
        }
        for stamp in tombstones.values { advance(to: stamp) }
        values = next
        stamps = nextStamps
        isLoaded = true
    }
}
