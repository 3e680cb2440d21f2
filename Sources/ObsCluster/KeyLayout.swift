// ObsCluster — where obsd's data lies in etcd, and how it is encoded. Every key is under the
// configured prefix P (default `/obsd/`):
//
//   P epoch                      the epoch of every repository under P (created once, 32 hex digits)
//   P rev/<repo>                 the repository's revision counter, decimal; one obsd write is
//                                one txn that compares this key's mod_revision and puts it
//   P data/<repo>/<key>          a key's value: "<revision that last changed it> <canonical JSON>",
//                                or "<revision> @<lease> <canonical JSON>" when the key is attached
//                                to a lease (a set that keeps the value but moves the attachment
//                                rewrites it: the attachment is shared state, not a revision)
//   P log/<repo>/<revision>      the change log, one record per revision (20-digit revision, so
//                                keys sort by revision): JSON {"rev","time","w","by","changes"},
//                                and "lease":{"id","end"} for a lease's end
//   P tomb/<repo>/<revision>/<key>
//                                "": a tombstone — <key> is absent, last deleted at <revision>
//                                (20 digits: a repository's tombstones sort by revision, so the
//                                oldest go with one range delete). Put by the txn that deletes
//                                the key, deleted by the one that re-creates it
//   P tombfloor/<repo>           "<floor> <through>": every deletion above <floor> of revisions up
//                                to <through> whose key is still absent has its tomb key (none is
//                                at or below <floor>). Every commit of revisions puts it, <through>
//                                its last revision, and raises <floor> (deleting the tomb keys at
//                                or below) where the deletions take the repository past the bound
//                                on tombstones; absent, or <through> behind the counter (revisions
//                                committed by a daemon that kept no tombstones): the deletions up
//                                to the counter are unknown
//   P lease-id                   the last lease id handed out, decimal (a grant compares its
//                                mod_revision and puts it + 1: ids are small and never reused)
//   P lease/<id>                 a lease (20-digit id): JSON {"id","by","ttl"?,"daemon","w","end"?},
//                                kept until no key is attached to it any more
//   P alive/<id>                 "" while lease <id> lives, attached to the etcd lease that keeps it:
//                                its own (a lease with a TTL) or its daemon's liveness lease (a
//                                lease bound to a connection); its deletion is the lease's end
//
// Repository names are `[A-Za-z0-9._-]`, so the first `/` after `data/`, `log/` or `tomb/` ends
// the name. Values and the log are JSON so that `etcdctl get --prefix /obsd/` reads as text.

import ObsEtcd
import ObsProtocol
import ObsStore
import ObservableKit

/// The keys of one prefix.
struct KeyLayout: Sendable {
    let prefix: [UInt8]

    init(prefix: String) {
        self.prefix = Array(prefix.utf8)
    }

    var epochKey: [UInt8] { prefix + Array("epoch".utf8) }
    var counterPrefix: [UInt8] { prefix + Array("rev/".utf8) }
    var dataPrefix: [UInt8] { prefix + Array("data/".utf8) }
    var logPrefix: [UInt8] { prefix + Array("log/".utf8) }
    var leaseCounterKey: [UInt8] { prefix + Array("lease-id".utf8) }
    var leasePrefix: [UInt8] { prefix + Array("lease/".utf8) }
    var alivePrefix: [UInt8] { prefix + Array("alive/".utf8) }
    var tombPrefix: [UInt8] { prefix + Array("tomb/".utf8) }
    var tombFloorPrefix: [UInt8] { prefix + Array("tombfloor/".utf8) }

    func leaseKey(_ id: UInt64) -> [UInt8] { leasePrefix + Self.digits(id) }
    func aliveKey(_ id: UInt64) -> [UInt8] { alivePrefix + Self.digits(id) }

    func counterKey(_ repo: String) -> [UInt8] { counterPrefix + Array(repo.utf8) }
    func dataPrefix(_ repo: String) -> [UInt8] { dataPrefix + Array(repo.utf8) + [UInt8(ascii: "/")] }
    func dataKey(_ repo: String, _ key: Key) -> [UInt8] { dataPrefix(repo) + Array(key.string.utf8) }
    func logPrefix(_ repo: String) -> [UInt8] { logPrefix + Array(repo.utf8) + [UInt8(ascii: "/")] }

    func logKey(_ repo: String, _ revision: UInt64) -> [UInt8] { logPrefix(repo) + Self.digits(revision) }

    func tombPrefix(_ repo: String) -> [UInt8] { tombPrefix + Array(repo.utf8) + [UInt8(ascii: "/")] }
    /// Where the tomb keys of deletions at `revision` begin (and those below it end).
    func tombPrefix(_ repo: String, revision: UInt64) -> [UInt8] { tombPrefix(repo) + Self.digits(revision) + [UInt8(ascii: "/")] }
    func tombKey(_ repo: String, _ revision: UInt64, _ key: Key) -> [UInt8] { tombPrefix(repo, revision: revision) + Array(key.string.utf8) }
    func tombFloorKey(_ repo: String) -> [UInt8] { tombFloorPrefix + Array(repo.utf8) }

    /// The revision and obsd key of a tomb key of `repo`.
    func tombstone(ofTombKey etcdKey: [UInt8], repo: String) -> (revision: UInt64, key: Key)? {
        let head = tombPrefix(repo)
        let start = head.count + 21
        guard etcdKey.count > start, etcdKey.starts(with: head), etcdKey[start - 1] == UInt8(ascii: "/"),
            let revision = UInt64(String(decoding: etcdKey[head.count..<(start - 1)], as: UTF8.self))
        else { return nil }
        return (revision, Key(String(decoding: etcdKey[start...], as: UTF8.self)))
    }

    /// 20 decimal digits, so that keys sort by number.
    private static func digits(_ n: UInt64) -> [UInt8] {
        var digits = Array(String(n).utf8)
        if digits.count < 20 { digits.insert(contentsOf: repeatElement(UInt8(ascii: "0"), count: 20 - digits.count), at: 0) }
        return digits
    }

    /// What a key under the prefix is.
    enum Kind: Equatable {
        case epoch
        case counter(repo: String)
        case data(repo: String)
        case log(repo: String)
        case leaseCounter
        case lease(id: UInt64)
        case alive(id: UInt64)
        case tomb(repo: String)
        case tombFloor(repo: String)
        /// Not obsd's (or not under the prefix).
        case other
    }

    func classify(_ key: [UInt8]) -> Kind {
        guard key.count > prefix.count, key.starts(with: prefix) else { return .other }
        let rest = key[prefix.count...]
        if rest.elementsEqual("epoch".utf8) { return .epoch }
        if let name = Self.after("rev/", in: rest, nameEnds: false) { return .counter(repo: name) }
        if let name = Self.after("data/", in: rest, nameEnds: true) { return .data(repo: name) }
        if let name = Self.after("log/", in: rest, nameEnds: true) { return .log(repo: name) }
        if rest.elementsEqual("lease-id".utf8) { return .leaseCounter }
        if let id = Self.after("lease/", in: rest, nameEnds: false).flatMap(UInt64.init) { return .lease(id: id) }
        if let id = Self.after("alive/", in: rest, nameEnds: false).flatMap(UInt64.init) { return .alive(id: id) }
        if let name = Self.after("tomb/", in: rest, nameEnds: true) { return .tomb(repo: name) }
        if let name = Self.after("tombfloor/", in: rest, nameEnds: false) { return .tombFloor(repo: name) }
        return .other
    }

    /// The repository name after `section` — up to the next `/` when `nameEnds`, else all
    /// of the rest.
    private static func after(_ section: String, in rest: ArraySlice<UInt8>, nameEnds: Bool) -> String? {
        let head = Array(section.utf8)
        guard rest.starts(with: head) else { return nil }
        let tail = rest.dropFirst(head.count)
        let name: ArraySlice<UInt8>
        if nameEnds {
            guard let slash = tail.firstIndex(of: UInt8(ascii: "/")) else { return nil }
            name = tail[..<slash]
        } else {
            name = tail
        }
        guard !name.isEmpty else { return nil }
        return String(decoding: name, as: UTF8.self)
    }

    /// The obsd key of a data key of `repo`.
    func key(ofDataKey etcdKey: [UInt8], repo: String) -> Key? {
        let head = dataPrefix(repo)
        guard etcdKey.count > head.count, etcdKey.starts(with: head) else { return nil }
        return Key(String(decoding: etcdKey[head.count...], as: UTF8.self))
    }
}

/// What a repository's `tombfloor` key says: the tomb keys hold every deletion above `floor`
/// of the revisions up to `through` whose key is still absent.
struct TombFloor: Sendable, Equatable {
    var floor: UInt64
    var through: UInt64

    /// The floor of what etcd holds at `revision`: the deletions of revisions past `through`
    /// (committed by a daemon that kept no tombstones; or all of them, with no key) are unknown.
    static func floor(of found: TombFloor?, at revision: UInt64) -> UInt64 {
        guard let found, found.through == revision else { return revision }
        return found.floor
    }
}

/// Why something under the prefix cannot be read as obsd's.
struct Malformed: Error, CustomStringConvertible {
    let description: String
}

/// The encodings of counters, values and log records.
enum Codec {
    static func counter(_ revision: UInt64) -> [UInt8] { Array(String(revision).utf8) }

    static func counter(from bytes: [UInt8]) -> UInt64? { UInt64(String(decoding: bytes, as: UTF8.self)) }

    /// A repository's tombstone floor: `"<floor> <through>"`.
    static func tombFloor(_ floor: TombFloor) -> [UInt8] { Array("\(floor.floor) \(floor.through)".utf8) }

    static func tombFloor(from bytes: [UInt8]) -> TombFloor? {
        let parts = bytes.split(separator: UInt8(ascii: " "), omittingEmptySubsequences: false)
        guard parts.count == 2, let floor = UInt64(String(decoding: parts[0], as: UTF8.self)),
            let through = UInt64(String(decoding: parts[1], as: UTF8.self)), floor <= through
        else { return nil }
        return TombFloor(floor: floor, through: through)
    }

    /// `"<revision> <canonical JSON>"`, or `"<revision> @<lease> <canonical JSON>"` for a key
    /// attached to a lease (JSON never starts with `@`).
    static func data(revision: UInt64, value: CanonicalJSON, lease: UInt64? = nil) -> [UInt8] {
        var out = Array(String(revision).utf8)
        out.append(UInt8(ascii: " "))
        if let lease {
            out.append(UInt8(ascii: "@"))
            out.append(contentsOf: String(lease).utf8)
            out.append(UInt8(ascii: " "))
        }
        out.append(contentsOf: value.bytes)
        return out
    }

    static func data(from bytes: [UInt8]) throws(Malformed) -> Entry<CanonicalJSON> {
        guard let space = bytes.firstIndex(of: UInt8(ascii: " ")),
            let revision = UInt64(String(decoding: bytes[..<space], as: UTF8.self))
        else { throw Malformed(description: "a value without its revision") }
        var start = space + 1
        if start < bytes.endIndex, bytes[start] == UInt8(ascii: "@") {
            guard let end = bytes[start...].firstIndex(of: UInt8(ascii: " ")) else { throw Malformed(description: "a lease without its value") }
            start = end + 1
        }
        do {
            let value = try bytes[start...].withUnsafeBytes { (raw) throws(JSONParseError) in try CanonicalJSON(validating: raw) }
            return Entry(value: value, revision: revision)
        } catch {
            throw Malformed(description: "a value that is not JSON (\(error))")
        }
    }

    /// A writer (`{"uid","gid","pid"}`) read from `by` of `what`.
    static func writer(from by: JSONValue, in what: String) throws(Malformed) -> Writer {
        guard let by = by.objectValue, let uid = by["uid"]?.uint64Value, let gid = by["gid"]?.uint64Value, let pid = by["pid"]?.int64Value,
            let u = UInt32(exactly: uid), let g = UInt32(exactly: gid), let p = Int32(exactly: pid)
        else { throw Malformed(description: "\(what) with a malformed writer") }
        return Writer(uid: u, gid: g, pid: p)
    }

    /// The lease a value's key is attached to (nil: none), without reading the value.
    static func lease(ofData bytes: [UInt8]) -> UInt64? {
        guard let space = bytes.firstIndex(of: UInt8(ascii: " ")), space + 1 < bytes.endIndex, bytes[space + 1] == UInt8(ascii: "@"),
            let end = bytes[(space + 1)...].firstIndex(of: UInt8(ascii: " "))
        else { return nil }
        return UInt64(String(decoding: bytes[(space + 2)..<end], as: UTF8.self))
    }

    /// A log record: `{"rev":N,"time":T,"w":"<write id>","by":{…},"changes":[{"key","old","new"}…]}`,
    /// and `"lease":{"id":L,"end":E}` when it deleted a lease's keys.
    static func log(_ record: RevisionRecord, writeID: String, lease: LeaseEnd? = nil) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(record.byteSize + 96)
        out.writeMember("{\"rev\":", record.revision)
        out.writeRaw(",\"time\":")
        out.writeDecimal(record.time)
        out.writeMember(",\"w\":", writeID)
        if let writer = record.writer { EventEncoder.writeBy(&out, writer) }
        out.writeRaw(",\"changes\":[")
        for (i, change) in record.changes.enumerated() {
            if i > 0 { out.writeByte(UInt8(ascii: ",")) }
            EventEncoder.writeChange(&out, change) { sink, value in sink.writeCanonical(value) }
        }
        out.writeByte(UInt8(ascii: "]"))
        if let lease { LeaseEnd(lease: lease.lease, reason: lease.reason.toStore).writeMember(into: &out) }
        out.writeByte(UInt8(ascii: "}"))
        return out
    }

    static func log(from bytes: [UInt8], repo: String) throws(Malformed) -> SharedRevision {
        let tree: JSONValue
        do { tree = try JSONParser.parse(bytes) } catch { throw Malformed(description: "a log record that is not JSON (\(error))") }
        guard case .object(let o) = tree, let revision = o["rev"]?.uint64Value, revision > 0, let time = o["time"]?.int64Value,
            let changes = o["changes"]?.arrayValue
        else { throw Malformed(description: "a log record without rev, time or changes") }
        let writer = try o["by"].map { by throws(Malformed) in try Self.writer(from: by, in: "a log record") }
        var decoded: [Change<CanonicalJSON>] = []
        decoded.reserveCapacity(changes.count)
        for change in changes {
            guard case .object(let c) = change, let key = c["key"]?.stringValue else {
                throw Malformed(description: "a log record with a change without its key")
            }
            decoded.append(Change(key: Key(key), old: c["old"].map(CanonicalJSON.init), new: c["new"].map(CanonicalJSON.init)))
        }
        var lease: LeaseEnd? = nil
        if let member = o["lease"]?.objectValue {
            guard let id = member["id"]?.uint64Value, let reason = member["end"]?.stringValue.flatMap(LeaseEnd.Reason.init(storedName:)) else {
                throw Malformed(description: "a log record with a malformed lease")
            }
            lease = LeaseEnd(lease: id, reason: reason)
        }
        // The record carries its lease's end too: the history a daemon loads at start-up is these
        // records alone, and a `since` replay of the end must say whose it was.
        let record = RevisionRecord(
            repo: repo, changeSet: ChangeSet(revision: revision, changes: decoded), time: time, writer: writer, leaseEnd: lease)
        return SharedRevision(record: record, writeID: o["w"]?.stringValue, lease: lease)
    }
}
