// ObsCluster — every daemon's leases as this daemon's watch has shown them (`lease-id`,
// `lease/<id>` and `alive/<id>`, KeyLayout.swift): which are live, whose they are, what keeps
// each alive in etcd, and where the id counter is.
//
// The watch applies each etcd revision's lease events in order — records and alive keys
// first, then the repositories' revisions, then the alive keys deleted — and learns which
// leases ended there, and why: a record marked revoked, else expired for a lease with a TTL,
// else closed. A lease a read found in etcd before the watch got there is added only if the
// watch has not passed the read's revision (so an end the watch already applied is never
// undone). A lease this daemon stops vouching for (it lost its liveness lease) is *dropped*:
// no longer live here, its end still to come from the watch.

import ObsProtocol
import ObsStore
import ObsValues
import Synchronization

/// A lease's record (`lease/<id>`), kept until no key is attached to it any more.
struct LeaseRecord: Sendable, Equatable {
    let id: UInt64
    let owner: Writer
    /// As granted by etcd (nil: bound to a connection of `daemon`).
    let ttl: Int64?
    /// The daemon that granted it.
    let daemon: String
    /// The grant's nonce: settles a grant whose outcome etcd did not report.
    let grant: String
    /// A `revoke` ended it.
    var revoked = false
}

extension Codec {
    /// `{"id":N,"by":{…},"ttl":T,"daemon":"…","w":"…","end":"revoked"}` (`ttl` and `end` only when set).
    static func lease(_ record: LeaseRecord) -> [UInt8] {
        var out: [UInt8] = []
        out.writeMember("{\"id\":", record.id)
        EventEncoder.writeBy(&out, record.owner)
        if let ttl = record.ttl { out.writeMember(",\"ttl\":", UInt64(max(0, ttl))) }
        out.writeMember(",\"daemon\":", record.daemon)
        out.writeMember(",\"w\":", record.grant)
        if record.revoked { out.writeMember(",\"end\":", LeaseEnd.Reason.revoked.rawValue) }
        out.writeByte(UInt8(ascii: "}"))
        return out
    }

    static func lease(from bytes: [UInt8]) throws(Malformed) -> LeaseRecord {
        let tree: JSONValue
        do { tree = try JSONParser.parse(bytes) } catch { throw Malformed(description: "a lease record that is not JSON (\(error))") }
        guard case .object(let o) = tree, let id = o["id"]?.uint64Value, let by = o["by"], let daemon = o["daemon"]?.stringValue else {
            throw Malformed(description: "a lease record without id, by or daemon")
        }
        let owner = try writer(from: by, in: "a lease record")
        var record = LeaseRecord(id: id, owner: owner, ttl: o["ttl"]?.int64Value, daemon: daemon, grant: o["w"]?.stringValue ?? "")
        record.revoked = o["end"]?.stringValue == LeaseEnd.Reason.revoked.rawValue
        return record
    }
}

final class LeaseMirror: Sendable {
    /// What keeps a lease alive in etcd: the etcd lease its alive key is attached to, and the
    /// key's create revision (a lease's generation: commits naming it compare it).
    struct Alive: Sendable, Equatable {
        let etcdLease: Int64
        let created: Int64
    }

    private struct Entry {
        var record: LeaseRecord?
        var alive: Alive?
        var dropped = false

        var isLive: Bool { record != nil && alive != nil && !dropped }
    }

    /// One etcd revision's lease events.
    struct Events {
        var counter: (id: UInt64, position: Int64)?
        var records: [LeaseRecord] = []
        var alive: [(id: UInt64, alive: Alive)] = []
        var aliveGone: [UInt64] = []
        var recordsGone: [UInt64] = []
    }

    private struct State {
        var entries: [UInt64: Entry] = [:]
        /// The last id handed out, and the counter's mod revision.
        var lastID: UInt64 = 0
        var counterPosition: Int64 = 0
        /// The etcd revision applied last.
        var position: Int64 = 0
    }

    private let state = Mutex(State())

    // MARK: Reading

    /// Lease `id` if it is live here.
    func live(_ id: UInt64) -> SharedLease? {
        state.withLock { s in s.entries[id].flatMap { $0.isLive ? Self.lease($0) : nil } }
    }

    /// Whether this daemon knows lease `id` at all (live, dropped, or ended and not yet forgotten).
    func knows(_ id: UInt64) -> Bool { state.withLock { $0.entries[id] != nil } }

    /// The record of lease `id`, if known.
    func record(_ id: UInt64) -> LeaseRecord? { state.withLock { $0.entries[id]?.record } }

    /// What keeps lease `id` alive, if it is live here.
    func alive(_ id: UInt64) -> Alive? { state.withLock { s in s.entries[id].flatMap { $0.isLive ? $0.alive : nil } } }

    /// Live leases (in etcd, as far as the watch has shown: dropped ones count until it shows
    /// their end) — of `uid` only, when given.
    func count(uid: UInt32? = nil) -> Int {
        state.withLock { s in s.entries.values.count { $0.alive != nil && (uid == nil || $0.record?.owner.uid == uid) } }
    }

    /// The id the next grant takes, and the counter position its compare names.
    var next: (id: UInt64, position: Int64) { state.withLock { ($0.lastID + 1, $0.counterPosition) } }

    private static func lease(_ entry: Entry) -> SharedLease? {
        guard let record = entry.record, let alive = entry.alive else { return nil }
        return SharedLease(id: record.id, owner: record.owner, ttl: record.ttl, generation: alive.created)
    }

    private static func reason(_ record: LeaseRecord) -> LeaseEnd.Reason {
        record.revoked ? .revoked : record.ttl != nil ? .expired : .closed
    }

    // MARK: The watch

    /// Applies an etcd revision's new records and alive keys (before its repositories').
    func applyPuts(_ events: Events) {
        state.withLock { s in
            if let counter = events.counter {
                s.lastID = max(s.lastID, counter.id)
                s.counterPosition = max(s.counterPosition, counter.position)
            }
            for record in events.records { s.entries[record.id, default: Entry()].record = record }
            for (id, alive) in events.alive { s.entries[id, default: Entry()].alive = alive }
        }
    }

    /// Applies an etcd revision's deletions (after its repositories'), and moves to
    /// `revision`: the leases that ended there, and why.
    func applyEnds(_ events: Events, at revision: Int64) -> [(lease: SharedLease, reason: LeaseEnd.Reason)] {
        state.withLock { s in
            var ended: [(lease: SharedLease, reason: LeaseEnd.Reason)] = []
            for id in events.aliveGone {
                guard var entry = s.entries[id] else { continue }
                if let lease = Self.lease(entry), let record = entry.record { ended.append((lease, Self.reason(record))) }
                entry.alive = nil
                s.entries[id] = entry
            }
            for id in events.recordsGone { s.entries[id] = nil }
            s.position = max(s.position, revision)
            return ended
        }
    }

    // MARK: Reads and start-up

    /// A linearizable read at `revision` found lease `record` live (`alive`): added unless
    /// the watch has already applied that revision (then it knows better).
    func learn(_ record: LeaseRecord, _ alive: Alive, at revision: Int64) {
        state.withLock { s in
            guard s.position < revision, s.entries[record.id] == nil else { return }
            s.entries[record.id] = Entry(record: record, alive: alive)
        }
    }

    /// Takes every lease as read at `revision` (start-up, or after the watch resumed behind
    /// a compaction): the leases that ended since this daemon last knew them — those read
    /// without their alive key that were live here or unknown — and why.
    func reconcile(records: [LeaseRecord], alive: [UInt64: Alive], counter: (id: UInt64, position: Int64), at revision: Int64) -> [(
        lease: SharedLease, reason: LeaseEnd.Reason
    )] {
        state.withLock { s in
            var ended: [(lease: SharedLease, reason: LeaseEnd.Reason)] = []
            var entries: [UInt64: Entry] = [:]
            for record in records {
                let known = s.entries[record.id]
                let entry = Entry(record: record, alive: alive[record.id], dropped: known?.dropped ?? false)
                if entry.alive == nil, known == nil || known?.alive != nil {
                    // Its generation is gone with its alive key: a generation no commit names.
                    let generation = known?.alive?.created ?? 0
                    ended.append((SharedLease(id: record.id, owner: record.owner, ttl: record.ttl, generation: generation), Self.reason(record)))
                }
                entries[record.id] = entry
            }
            s.entries = entries
            s.lastID = max(s.lastID, counter.id)
            s.counterPosition = max(s.counterPosition, counter.position)
            s.position = max(s.position, revision)
            return ended
        }
    }

    /// This daemon no longer vouches for the leases kept alive by etcd lease `etcdLease` (its
    /// liveness lease, lost): they are no longer live here. Returns their ids.
    func drop(keptBy etcdLease: Int64) -> [UInt64] {
        state.withLock { s in
            var dropped: [UInt64] = []
            for (id, entry) in s.entries where entry.isLive && entry.alive?.etcdLease == etcdLease {
                s.entries[id]?.dropped = true
                dropped.append(id)
            }
            return dropped.sorted()
        }
    }

    /// A commit found these leases ended in etcd: no longer live here (the watch shows their
    /// end in its turn).
    func drop(_ ids: some Sequence<UInt64>) {
        state.withLock { s in
            for id in ids where s.entries[id] != nil { s.entries[id]?.dropped = true }
        }
    }
}
