// ObsProtocol — what the fast path of request decoding (RequestScanner.swift) found in a line:
// its members in place — names and plain strings as ranges of the line, the values
// canonicalized into a buffer the caller keeps — and the request they make, built only when
// asked for. A write — `set`, `delete`, `batch` — is also offered as it lies
// (`ScannedRequest.withWrite`: its operations as `RawWriteOp`s), so the daemon can apply it
// without building a `Request`.

import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

extension Request {
    /// The request `line` holds, when the fast path can read it; nil otherwise.
    public static func scan(_ line: UnsafeRawBufferPointer, maxDepth: Int = JSONParser.defaultMaxDepth) -> Request? {
        var values: [UInt8] = []
        var request: Request?
        _ = scan(line, maxDepth: maxDepth, values: &values) { scanned in
            request = scanned.request()
            return true
        }
        return request
    }

    /// Reads `line` with the fast path and calls `body` with what it found, then returns what
    /// `body` returned; nil — without calling `body` — when the line needs the general decoder.
    /// `values` is scratch space the caller keeps between calls (the value of a `set` is
    /// canonicalized into it); what `body` is given points into it and into `line`, and is
    /// valid only until `body` returns.
    public static func scan(
        _ line: UnsafeRawBufferPointer, maxDepth: Int, values: inout [UInt8], _ body: (borrowing ScannedRequest) -> Bool
    ) -> Bool? {
        guard let base = line.baseAddress, line.count > 0 else { return nil }
        var parser = Parser(base: base.assumingMemoryBound(to: UInt8.self), end: line.count, maxDepth: maxDepth)
        // Scanned in place: the fields (about 230 bytes) were copied twice on their way to
        // `body`, 1.6 % of the daemon's time at 64 writes in flight.
        var scanned = ScannedRequest()
        // Values are appended after those of earlier lines (what `body` is given are ranges of
        // the buffer), and the buffer is emptied only once it holds 4 KiB: not a call per line.
        if values.count >= 1 << 12 { values.removeAll(keepingCapacity: values.capacity <= 1 << 16) }
        // A batch's operations (no array is made for any other request).
        var ops: [ScannedOp] = []
        guard (try? parser.scanRequest(into: &scanned.fields, values: &values, ops: &ops)) == true else { return nil }
        return values.withUnsafeBytes { raw in
            scanned.values = raw
            if ops.isEmpty { return body(scanned) }
            return ops.withUnsafeBufferPointer { buffer in
                scanned.ops = buffer
                return body(scanned)
            }
        }
    }
}

/// One operation of a batch as the scanner found it: its key a range of the line, its value a
/// range of the caller's buffer.
struct ScannedOp {
    var key = UnsafeBufferPointer<UInt8>(start: nil, count: 0)
    var value: Range<Int>?
    var isPlain = false
    var ifRev: UInt64?
    var force = false
    var lease: UInt64?
    var isSet = false

    /// The operation read in place, its value in `values`.
    @inline(__always)
    func raw(_ values: UnsafeRawBufferPointer) -> RawWriteOp {
        RawWriteOp(
            key: UnsafeRawBufferPointer(key), value: isSet ? value.map { UnsafeRawBufferPointer(rebasing: values[$0]) } : nil, isPlain: isPlain,
            ifRevision: ifRev, force: force, lease: lease)
    }

    /// The operation as the protocol's value, and the lease it names.
    func writeOp(_ values: UnsafeRawBufferPointer) -> (WriteOp<CanonicalJSON>, lease: UInt64?) {
        let key = Key(String(decoding: key, as: UTF8.self))
        guard isSet, let value else { return (.delete(key, ifRevision: ifRev), nil) }
        return (.set(key, CanonicalJSON(canonical: Array(values[value]), isPlain: isPlain), ifRevision: ifRev, force: force), lease)
    }
}

/// A line read by the fast path: valid only inside the `body` of `Request.scan`.
public struct ScannedRequest: ~Copyable {
    var fields = ScannedFields()
    var values = UnsafeRawBufferPointer(start: nil, count: 0)
    /// A batch's operations, in place while the body of `Request.scan` runs.
    var ops: UnsafeBufferPointer<ScannedOp>?

    /// The request's `id` (`.null` when it had none).
    public var id: JSONValue { fields.id }

    /// When the request is a write — a well-formed `set` or `delete` of one key, or `batch` —
    /// calls `body` with its repository's name, whether it is a single-key write (its reply
    /// carries the value it replaced; a batch's none) and its operations read in place, and
    /// returns what `body` returned; nil, without calling `body`, for any other request.
    public func withWrite(_ body: (_ repo: UnsafeRawBufferPointer, _ single: Bool, _ ops: UnsafeBufferPointer<RawWriteOp>) -> Bool) -> Bool? {
        guard let op = fields.op, let repo = fields.repo else { return nil }
        switch op {
        case .set, .delete:
            guard let key = fields.key else { return nil }
            let isSet = op == .set
            var value: UnsafeRawBufferPointer? = nil
            if isSet {
                guard let range = fields.value else { return nil }
                value = UnsafeRawBufferPointer(rebasing: values[range])
            }
            var raw = RawWriteOp(
                key: UnsafeRawBufferPointer(key), value: value, isPlain: fields.valueIsPlain, ifRevision: fields.ifRev, force: isSet && fields.force == true,
                lease: isSet ? fields.lease : nil)
            return withUnsafePointer(to: &raw) { body(UnsafeRawBufferPointer(repo), true, UnsafeBufferPointer(start: $0, count: 1)) }
        case .batch:
            guard fields.hasOps else { return nil }
            let ops = self.ops ?? UnsafeBufferPointer(start: nil, count: 0)
            return withUnsafeTemporaryAllocation(of: RawWriteOp.self, capacity: max(1, ops.count)) { buffer in
                for (i, op) in ops.enumerated() { buffer.initializeElement(at: i, to: op.raw(values)) }
                defer { buffer.baseAddress!.deinitialize(count: ops.count) }
                return body(UnsafeRawBufferPointer(repo), false, UnsafeBufferPointer(rebasing: buffer[..<ops.count]))
            }
        default:
            return nil
        }
    }

    /// Whether the request is a write and exactly the write `request` asks for (the fuzz harness
    /// and the tests hold the fast path to the general decoder with it); nil: not a write.
    public func writeReads(_ request: Request) -> Bool? {
        withWrite { repoBytes, single, raw in
            let (repo, ops): (String, [WriteOp<CanonicalJSON>])
            switch request.command {
            case .set(let r, let key, let value, let ifRev, let force) where single: (repo, ops) = (r, [.set(key, value, ifRevision: ifRev, force: force)])
            case .delete(let r, let key, let ifRev) where single: (repo, ops) = (r, [.delete(key, ifRevision: ifRev)])
            case .batch(let r, let batchOps) where !single: (repo, ops) = (r, batchOps)
            default: return false
            }
            guard repoBytes.elementsEqual(repo.utf8), ops.count == raw.count else { return false }
            return zip(raw, ops).allSatisfy { raw, op in
                guard raw.key.elementsEqual(op.key.string.utf8), raw.ifRevision == op.ifRevision else { return false }
                switch op {
                case .set(let key, let value, _, let force):
                    guard let bytes = raw.value else { return false }
                    return bytes.elementsEqual(value.bytes) && raw.isPlain == value.isPlain && raw.force == force && raw.lease == request.leases[key]
                case .delete:
                    return raw.value == nil && request.leases[op.key] == nil
                }
            }
        }
    }

    /// The request these members make, when it is well-formed; nil leaves the judgement (and
    /// the message) to the general decoder.
    public func request() -> Request? { fields.request(values: values, ops: ops) }
}

/// The operations the fast path reads.
enum Operation {
    case set, get, delete, batch, subscribe, unsubscribe, list, ping, hello, repos, stats, other

    init(_ bytes: UnsafeBufferPointer<UInt8>) {
        func `is`(_ name: StaticString) -> Bool {
            bytes.count == name.utf8CodeUnitCount && memcmp(bytes.baseAddress!, name.utf8Start, bytes.count) == 0
        }
        switch bytes.count {
        case 3: self = `is`("set") ? .set : `is`("get") ? .get : .other
        case 6: self = `is`("delete") ? .delete : .other
        case 9: self = `is`("subscribe") ? .subscribe : .other
        case 11: self = `is`("unsubscribe") ? .unsubscribe : .other
        case 4: self = `is`("list") ? .list : `is`("ping") ? .ping : .other
        case 5: self = `is`("hello") ? .hello : `is`("repos") ? .repos : `is`("stats") ? .stats : `is`("batch") ? .batch : .other
        default: self = .other
        }
    }
}

/// The members the fast path knows, as it found them. `nil`: absent (or JSON `null`). The
/// repository name and key are ranges of the line (validated); the value, a range of the
/// caller's `values` buffer.
struct ScannedFields {
    var id: JSONValue = .null
    var op: Operation?
    var repo: UnsafeBufferPointer<UInt8>?
    var key: UnsafeBufferPointer<UInt8>?
    var value: Range<Int>?
    var valueIsPlain = false
    var ifRev: UInt64?
    var force: Bool?
    var lease: UInt64?
    var since: UInt64?
    var sub: UInt64?
    var epoch: String?
    var initial: Bool?
    var once: Bool?
    var coalesce: Bool?
    var writers: Bool?
    var echo: Bool?
    var progress: Bool?
    var catchup: Bool?
    var values: Bool?
    var prefix: String?
    var keys: Set<Key>?
    /// A batch's `ops` were read (into the scanner's array: `ScannedRequest.ops`).
    var hasOps = false
    var client: String?
    var proto: Int64?

    /// The request these members make (`values`: the buffer the value lies in), when it is
    /// well-formed; nil leaves the judgement (and the message) to the general decoder.
    func request(values buffer: UnsafeRawBufferPointer, ops scannedOps: UnsafeBufferPointer<ScannedOp>?) -> Request? {
        guard let op else { return nil }
        let repo = self.repo.map { String(decoding: $0, as: UTF8.self) }
        let key = self.key.map { Key(String(decoding: $0, as: UTF8.self)) }
        let command: Command
        var leases: [Key: UInt64] = [:]
        switch op {
        case .set:
            guard let repo, let key, let range = value else { return nil }
            let value = CanonicalJSON(canonical: Array(buffer[range]), isPlain: valueIsPlain)
            command = .set(repo: repo, key: key, value: value, ifRev: ifRev, force: force ?? false)
            if let lease { leases[key] = lease }
        case .get:
            guard let repo, let key else { return nil }
            command = .get(repo: repo, key: key)
        case .delete:
            guard let repo, let key else { return nil }
            command = .delete(repo: repo, key: key, ifRev: ifRev)
        case .batch:
            guard let repo, hasOps else { return nil }
            let ops = scannedOps ?? UnsafeBufferPointer(start: nil, count: 0)
            var batch: [WriteOp<CanonicalJSON>] = []
            batch.reserveCapacity(ops.count)
            for scanned in ops {
                let (op, lease) = scanned.writeOp(buffer)
                batch.append(op)
                if let lease { leases[op.key] = lease }
            }
            command = .batch(repo: repo, ops: batch)
        case .subscribe:
            let catchup = catchup ?? false
            guard let repo, keys == nil || prefix == nil, !(initial == true && since != nil), !(once == true && coalesce == true),
                !catchup || (since != nil && once != true)
            else { return nil }
            var selection = Selection.all
            if let keys { selection = .keys(keys) } else if let prefix, !prefix.isEmpty { selection = .prefix(prefix) }
            command = .subscribe(
                SubscribeRequest(
                    repo: repo, selection: selection, initial: initial ?? false, since: since, epoch: since == nil ? nil : epoch,
                    once: once ?? false, coalesce: coalesce ?? false, writers: writers ?? false, echo: echo ?? true,
                    progress: progress ?? false, catchup: catchup))
        case .unsubscribe:
            guard let sub else { return nil }
            command = .unsubscribe(sub: sub)
        case .list:
            guard let repo else { return nil }
            command = .list(repo: repo, prefix: prefix, values: values ?? false)
        case .ping: command = .ping
        case .hello: command = .hello(protocol: proto, client: client)
        case .repos: command = .repos
        case .stats: command = .stats
        case .other: return nil
        }
        return Request(id: id, command: command, leases: leases)
    }
}
