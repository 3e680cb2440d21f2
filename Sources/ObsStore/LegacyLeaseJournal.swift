// ObsStore — the lease journal an earlier obsd kept beside its log (`leases` in the data
// directory), read once to migrate it: leases and their attachments now ride in the log's own
// records and in the snapshot (LogFrame.swift). Start-up reads the journal, folds it into the
// state it loaded, writes a snapshot holding it all, and removes the journal.
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

import SystemPackage

/// What an earlier obsd's lease journal held.
struct LegacyLeases: Sendable {
    /// Keys a lease's end deleted (or was about to) in one repository.
    struct Deletion: Sendable, Equatable {
        let lease: UInt64
        let reason: LeaseEnd.Reason
        let owner: Writer
        let repo: String
        /// The repository's revision before the deletion's revision.
        let before: UInt64
        let keys: [Key]
    }

    var leases = PersistedLeases()
    /// Repository → key → the lease it is attached to (the last `attach` of each key).
    var attachments: [String: [Key: UInt64]] = [:]
    /// The deletions lease ends made, newest last.
    var deletions: [Deletion] = []

    /// Reads the journal at `path`: nil if there is none. A torn last frame is ignored (a
    /// record a crash interrupted); a damaged or foreign file refuses start-up, naming it.
    static func read(_ path: String) throws(StorageError) -> LegacyLeases? {
        let fd: FileDescriptor
        do throws(Errno) {
            fd = try FilePath(path).open(.readOnly)
        } catch where error == .noSuchFileOrDirectory {
            return nil
        } catch {
            throw StorageError(error, "cannot open \(path)")
        }
        defer { try? fd.close() }
        let bytes = try fd.contents(of: path)
        if bytes.count < LeaseJournalRecord.magic.count, LeaseJournalRecord.magic.starts(with: bytes) { return LegacyLeases() }
        guard Array(bytes.prefix(LeaseJournalRecord.magic.count)) == LeaseJournalRecord.magic else {
            throw StorageError(.corrupt, "\(path) is not an obsd lease journal (bad header); refusing to start")
        }
        var found = LegacyLeases()
        try bytes.withUnsafeBytes { raw in Result { () throws(StorageError) in
            var offset = LeaseJournalRecord.magic.count
            while offset < raw.count {
                var header = PayloadReader(UnsafeRawBufferPointer(rebasing: raw[offset...]))
                guard let length = header.u32(), let crc = header.u32(), Int(length) <= raw.count - offset - LeaseJournalRecord.frameHeader else {
                    return  // a frame cut short: the last write a crash interrupted
                }
                let start = offset + LeaseJournalRecord.frameHeader
                let payload = UnsafeRawBufferPointer(rebasing: raw[start..<(start + Int(length))])
                guard CRC32C.checksum(payload) == crc else {
                    if start + Int(length) == raw.count { return }
                    throw StorageError(.corrupt, "\(path) is damaged at byte \(offset) (a record whose checksum does not match, with more after it); refusing to start")
                }
                guard LeaseJournalRecord.apply(payload, to: &found) else {
                    throw StorageError(.corrupt, "\(path) holds a record obsd cannot read at byte \(offset); refusing to start")
                }
                offset = start + Int(length)
            }
        } }.get()
        return found
    }
}

/// The records of the lease journal an earlier obsd kept beside the log (read once, to
/// migrate it), and the codes of a lease's end reasons, which the log and the snapshot reuse.
/// (Not `ObsCluster`'s `LeaseRecord`, a lease as etcd holds it.)
enum LeaseJournalRecord {
    /// The journal's name in the data directory.
    static let fileName = "leases"
    static let magic: [UInt8] = Array("OBSDLSE1".utf8)
    static let frameHeader = 8

    enum Kind: UInt8 { case grant = 1, end, attach, deletion, next }

    /// `reason`'s code in the journal, the log and the snapshot (of `reason.toStore`: a reason
    /// other than the three stored ones, which the daemon never makes, as `closed`).
    static func code(_ reason: LeaseEnd.Reason) -> UInt8 {
        switch reason {
        case .expired: 1
        case .revoked: 2
        default: 3
        }
    }

    /// The reason coded `code`: nil for a code no obsd writes (the record does not decode).
    static func reason(_ code: UInt8) -> LeaseEnd.Reason? {
        (1...LeaseEnd.Reason.stored.count).contains(Int(code)) ? LeaseEnd.Reason.stored[Int(code) - 1] : nil
    }

    // MARK: Encoding (what an earlier obsd wrote: tests write a journal to migrate)

    static func grant(_ lease: PersistedLeases.Lease, into out: inout [UInt8]) {
        frame(into: &out) { w in
            w.u8(Kind.grant.rawValue)
            w.u64(lease.id)
            owner(lease.owner, &w)
            w.u64(UInt64(bitPattern: lease.ttl ?? 0))
        }
    }

    static func end(_ id: UInt64, _ reason: LeaseEnd.Reason, into out: inout [UInt8]) {
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

    static func deletion(_ d: LegacyLeases.Deletion, into out: inout [UInt8]) {
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

    /// Applies one checksummed payload to `found`; false if it does not decode.
    static func apply(_ payload: UnsafeRawBufferPointer, to found: inout LegacyLeases) -> Bool {
        var r = PayloadReader(payload)
        guard let byte = r.u8(), let kind = Kind(rawValue: byte) else { return false }
        switch kind {
        case .grant:
            guard let id = r.u64(), let owner = owner(&r), let ttl = r.u64(), r.atEnd, id > 0 else { return false }
            found.leases.granted(PersistedLeases.Lease(id: id, owner: owner, ttl: ttl == 0 ? nil : Int64(bitPattern: ttl)))
        case .end:
            guard let id = r.u64(), let reason = r.u8().flatMap(reason), r.atEnd else { return false }
            let owner = found.leases.live[id]?.owner ?? found.leases.ended[id]?.owner ?? Writer(uid: 0, gid: 0, pid: 0)
            found.leases.ended(id, reason, owner: owner)
        case .attach:
            guard let lease = r.u64(), let repo = r.text(lengthBytes: 2), let key = r.text(lengthBytes: 2), r.atEnd else { return false }
            found.attachments[repo, default: [:]][Key(key)] = lease == 0 ? nil : lease
            if found.attachments[repo]?.isEmpty == true { found.attachments[repo] = nil }
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
            found.deletions.append(LegacyLeases.Deletion(lease: lease, reason: reason, owner: owner, repo: repo, before: before, keys: keys))
            // The deletion detaches them: an `attach` to the ended lease after it means the
            // deletion was undone (storage failed it), and is owed again.
            for key in keys where found.attachments[repo]?[key] == lease { found.attachments[repo]![key] = nil }
            if found.attachments[repo]?.isEmpty == true { found.attachments[repo] = nil }
        case .next:
            guard let id = r.u64(), r.atEnd else { return false }
            found.leases.nextID = max(found.leases.nextID, id)
        }
        return true
    }

    private static func owner(_ r: inout PayloadReader) -> Writer? {
        guard let uid = r.u32(), let gid = r.u32(), let pid = r.u32() else { return nil }
        return Writer(uid: uid, gid: gid, pid: Int32(bitPattern: pid))
    }
}
