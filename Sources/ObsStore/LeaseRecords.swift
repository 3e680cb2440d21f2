// ObsStore — the lease journal's records (LeaseJournal.swift) and what reading them yields.
//
// The file is `OBSDLSE1` then frames `u32 length · u32 CRC-32C of the payload · payload`,
// little-endian. A payload starts with its kind:
//
//   1 grant      u64 id · u32 uid · u32 gid · i32 pid · i64 ttl (0: bound to its connection)
//   2 end        u64 id · u8 reason (1 expired, 2 revoked, 3 closed)
//   3 attach     u64 lease (0: none) · u16 repo length, repo · u16 key length, key
//   4 deletion   u64 lease · u8 reason · u32 uid · u32 gid · i32 pid · u16 repo length, repo ·
//                u64 the repository's revision before the deletion · u32 count · (u16, key)…
//   5 next       u64 the next id a grant hands out
//
// A deletion record says "lease L's end deletes these keys of this repository in revision
// rev + 1": a restart that finds the repository at rev or below (the kill came before that
// revision was durable) makes the deletion again. It also detaches those keys from L: an
// `attach` of one to L after it means the deletion's revision was undone (storage failed it)
// and is owed again.

import ObsValues
import ObservableKit

/// The leases a data directory holds, as a restart finds them.
public struct PersistedLeases: Sendable {
    /// A lease that had not ended.
    public struct Lease: Sendable, Equatable {
        public let id: UInt64
        public let owner: Writer
        /// Seconds; nil: bound to a connection (which a restart has ended).
        public let ttl: Int64?

        public init(id: UInt64, owner: Writer, ttl: Int64?) {
            self.id = id
            self.owner = owner
            self.ttl = ttl
        }
    }

    /// Keys a lease's end deleted (or was about to) in one repository.
    public struct Deletion: Sendable, Equatable {
        public let lease: UInt64
        public let reason: SharedLeaseReason
        public let owner: Writer
        public let repo: String
        /// The repository's revision before the deletion's revision.
        public let before: UInt64
        public let keys: [Key]

        public init(lease: UInt64, reason: SharedLeaseReason, owner: Writer, repo: String, before: UInt64, keys: [Key]) {
            self.lease = lease
            self.reason = reason
            self.owner = owner
            self.repo = repo
            self.before = before
            self.keys = keys
        }
    }

    /// The id the next grant hands out (ids are never reused while the data persists).
    public var nextID: UInt64 = 1
    /// Leases not ended, by id.
    public var live: [UInt64: Lease] = [:]
    /// Leases that ended, why, and who held them.
    public var ended: [UInt64: (reason: SharedLeaseReason, owner: Writer?)] = [:]
    /// Repository → key → the lease it is attached to (the last `attach` of each key).
    public var attachments: [String: [Key: UInt64]] = [:]
    /// The deletions lease ends made, newest last.
    public var deletions: [Deletion] = []

    public init() {}
}

enum LeaseRecord {
    static let magic: [UInt8] = Array("OBSDLSE1".utf8)
    static let frameHeader = 8

    enum Kind: UInt8 { case grant = 1, end, attach, deletion, next }

    static func code(_ reason: SharedLeaseReason) -> UInt8 {
        switch reason {
        case .expired: 1
        case .revoked: 2
        case .closed: 3
        }
    }

    static func reason(_ code: UInt8) -> SharedLeaseReason? {
        switch code {
        case 1: .expired
        case 2: .revoked
        case 3: .closed
        default: nil
        }
    }

    // MARK: Encoding

    static func grant(_ lease: PersistedLeases.Lease, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.grant.rawValue)
            w.u64(lease.id)
            owner(lease.owner, &w)
            w.u64(UInt64(bitPattern: lease.ttl ?? 0))
        }
    }

    static func end(_ id: UInt64, _ reason: SharedLeaseReason, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.end.rawValue)
            w.u64(id)
            w.u8(code(reason))
        }
    }

    static func attach(repo: String, key: Key, lease: UInt64?, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.attach.rawValue)
            w.u64(lease ?? 0)
            w.text(repo, lengthBytes: 2)
            w.text(key.string, lengthBytes: 2)
        }
    }

    static func deletion(_ d: PersistedLeases.Deletion, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.deletion.rawValue)
            w.u64(d.lease)
            w.u8(code(d.reason))
            owner(d.owner, &w)
            w.text(d.repo, lengthBytes: 2)
            w.u64(d.before)
            w.u32(UInt32(d.keys.count))
            for key in d.keys { w.text(key.string, lengthBytes: 2) }
        }
    }

    static func next(_ id: UInt64, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.next.rawValue)
            w.u64(id)
        }
    }

    private static func owner(_ owner: Writer, _ w: inout PayloadWriter) {
        w.u32(owner.uid)
        w.u32(owner.gid)
        w.u32(UInt32(bitPattern: owner.pid))
    }

    private static func frame(into out: inout [UInt8], _ payload: (inout PayloadWriter) -> Void) {
        var w = PayloadWriter()
        payload(&w)
        var header = PayloadWriter()
        header.u32(UInt32(w.bytes.count))
        header.u32(w.bytes.withUnsafeBytes { CRC32C.checksum($0) })
        out.append(contentsOf: header.bytes)
        out.append(contentsOf: w.bytes)
    }

    // MARK: Decoding

    /// Applies one checksummed payload to `leases`; false if it does not decode.
    static func apply(_ payload: UnsafeRawBufferPointer, to leases: inout PersistedLeases) -> Bool {
        var r = PayloadReader(payload)
        guard let byte = r.u8(), let kind = Kind(rawValue: byte) else { return false }
        switch kind {
        case .grant:
            guard let id = r.u64(), let owner = owner(&r), let ttl = r.u64(), r.atEnd, id > 0 else { return false }
            leases.live[id] = PersistedLeases.Lease(id: id, owner: owner, ttl: ttl == 0 ? nil : Int64(bitPattern: ttl))
            leases.nextID = max(leases.nextID, id + 1)
        case .end:
            guard let id = r.u64(), let reason = r.u8().flatMap(reason), r.atEnd else { return false }
            let owner = leases.live.removeValue(forKey: id)?.owner ?? leases.ended[id]?.owner
            leases.ended[id] = (reason, owner)
            leases.nextID = max(leases.nextID, id + 1)
        case .attach:
            guard let lease = r.u64(), let repo = r.text(lengthBytes: 2), let key = r.text(lengthBytes: 2), r.atEnd else { return false }
            leases.attachments[repo, default: [:]][Key(key)] = lease == 0 ? nil : lease
            if leases.attachments[repo]?.isEmpty == true { leases.attachments[repo] = nil }
        case .deletion:
            guard let lease = r.u64(), let reason = r.u8().flatMap(reason), let owner = owner(&r), let repo = r.text(lengthBytes: 2),
                let before = r.u64(), let count = r.u32(), Int(count) <= payload.count
            else { return false }
            var keys: [Key] = []
            for _ in 0..<count {
                guard let key = r.text(lengthBytes: 2) else { return false }
                keys.append(Key(key))
            }
            guard r.atEnd else { return false }
            leases.deletions.append(PersistedLeases.Deletion(lease: lease, reason: reason, owner: owner, repo: repo, before: before, keys: keys))
            // The deletion detaches them: an `attach` to the ended lease after it means the
            // deletion was undone (storage failed it), and is owed again.
            for key in keys where leases.attachments[repo]?[key] == lease { leases.attachments[repo]![key] = nil }
            if leases.attachments[repo]?.isEmpty == true { leases.attachments[repo] = nil }
        case .next:
            guard let id = r.u64(), r.atEnd else { return false }
            leases.nextID = max(leases.nextID, id)
        }
        return true
    }

    private static func owner(_ r: inout PayloadReader) -> Writer? {
        guard let uid = r.u32(), let gid = r.u32(), let pid = r.u32() else { return nil }
        return Writer(uid: uid, gid: gid, pid: Int32(bitPattern: pid))
    }
}
