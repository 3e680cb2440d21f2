// ObsProtocol — requests: their typed form, and decoding from a line with the precise
// error code for every way a request can be wrong.
//
// Order of checks: not JSON or not an object → `bad_json` (id null); an `id` that is not
// a number or string → `bad_request`; missing or non-string `op` → `bad_request`; an op
// the daemon does not know → `unknown_op`; a missing, ill-typed or invalid field →
// `bad_request` naming the field. Unknown fields are ignored; `null` in an optional field
// means "absent".

import ObservableKit

/// A decoded request: its echoed `id` and what it asks.
public struct Request: Sendable, Equatable {
    /// The request's `id`, echoed verbatim in the reply; `.null` when it had none.
    public var id: JSONValue
    public var command: Command

    public init(id: JSONValue = .null, command: Command) {
        self.id = id
        self.command = command
    }
}

/// What a request asks the daemon to do.
public enum Command: Sendable, Equatable {
    case hello(protocol: Int64?, client: String?)
    case ping
    case get(repo: String, key: Key)
    /// `lease`: the key is attached to that lease (nil: to none).
    case set(repo: String, key: Key, value: CanonicalJSON, ifRev: UInt64?, force: Bool, lease: UInt64? = nil)
    case delete(repo: String, key: Key, ifRev: UInt64?)
    /// `leases`: the lease each op names, by position (empty: none names one).
    case batch(repo: String, ops: [WriteOp<CanonicalJSON>], leases: [UInt64?] = [])
    case list(repo: String, prefix: String?, values: Bool)
    case repos
    case subscribe(SubscribeRequest)
    case unsubscribe(sub: UInt64)
    case stats
    /// A lease: with `ttl` seconds, or (nil) bound to the connection.
    case grant(ttl: Int64?)
    case keepalive(lease: UInt64)
    case revoke(lease: UInt64)

    /// The operation's name on the wire.
    public var op: String {
        switch self {
        case .hello: return "hello"
        case .ping: return "ping"
        case .get: return "get"
        case .set: return "set"
        case .delete: return "delete"
        case .batch: return "batch"
        case .list: return "list"
        case .repos: return "repos"
        case .subscribe: return "subscribe"
        case .unsubscribe: return "unsubscribe"
        case .stats: return "stats"
        case .grant: return "grant"
        case .keepalive: return "keepalive"
        case .revoke: return "revoke"
        }
    }

    /// The repository the command addresses, if any.
    public var repo: String? {
        switch self {
        case .get(let repo, _), .set(let repo, _, _, _, _, _), .delete(let repo, _, _), .batch(let repo, _, _),
            .list(let repo, _, _):
            return repo
        case .subscribe(let s): return s.repo
        case .hello, .ping, .repos, .unsubscribe, .stats, .grant, .keepalive, .revoke: return nil
        }
    }
}

/// A `subscribe` request.
public struct SubscribeRequest: Sendable, Equatable {
    public var repo: String
    public var selection: Selection
    /// Send a `snapshot` of the selected keys first.
    public var initial: Bool
    /// Replay selected changes above this revision, then `synced`.
    public var since: UInt64?
    /// With `since`: the epoch the client saw revision `since` in; another epoch is `compacted`.
    public var epoch: String?
    /// End after the first `change` event.
    public var once: Bool
    /// Trade intermediate values for state while the connection lags: one coalesced `change`
    /// (with `from`) per catch-up instead of every revision; never the cause of an overflow.
    public var coalesce: Bool
    /// Every `change` event carries `by`: the credentials of the connection that wrote it.
    public var writers: Bool
    /// `false`: no event for revisions written by this connection.
    public var echo: Bool
    /// `progress` events: the revision up to which everything selected was delivered, kept
    /// up to date while the selected keys are quiet.
    public var progress: Bool

    public init(
        repo: String, selection: Selection = .all, initial: Bool = false, since: UInt64? = nil, epoch: String? = nil,
        once: Bool = false, coalesce: Bool = false, writers: Bool = false, echo: Bool = true, progress: Bool = false
    ) {
        self.repo = repo
        self.selection = selection
        self.initial = initial
        self.since = since
        self.epoch = epoch
        self.once = once
        self.coalesce = coalesce
        self.writers = writers
        self.echo = echo
        self.progress = progress
    }
}

/// A request that could not be decoded: the error to reply with, and the id to echo.
public struct RequestFailure: Error, Sendable, Equatable {
    public let id: JSONValue
    public let error: ProtocolError

    public init(id: JSONValue, _ code: ErrorCode, _ message: String) {
        self.id = id
        self.error = ProtocolError(code, message)
    }
}

extension Request {
    /// Decodes one line (without its newline). The values a request only stores and
    /// forwards are validated and kept canonical, never built as trees.
    public static func decode(line: UnsafeRawBufferPointer, maxDepth: Int = JSONParser.defaultMaxDepth) throws(RequestFailure) -> Request {
        if let request = scan(line, maxDepth: maxDepth) { return request }
        return try decodeInGeneral(line: line, maxDepth: maxDepth)
    }

    /// The general decoder: every request, every error with its message. `decode(line:)`
    /// reads the common requests faster (`scan`) and comes here for the rest.
    public static func decodeInGeneral(line: UnsafeRawBufferPointer, maxDepth: Int = JSONParser.defaultMaxDepth) throws(RequestFailure) -> Request {
        guard let base = line.baseAddress, line.count > 0 else {
            throw RequestFailure(id: .null, .badJSON, "invalid JSON: \(JSONParseError(reason: "empty input", offset: 0))")
        }
        var parser = Parser(base: base.assumingMemoryBound(to: UInt8.self), end: line.count, maxDepth: maxDepth)
        let document: RequestDocument
        do {
            document = try parser.parseRequestDocument()
        } catch {
            throw RequestFailure(id: .null, .badJSON, "invalid JSON: \(error)")
        }
        return try decode(document)
    }

    /// Decodes a parsed request object.
    public static func decode(_ value: JSONValue) throws(RequestFailure) -> Request {
        guard case .object(let object) = value else { return try decode(RequestDocument(notObject: value)) }
        let ops = object["ops"]?.arrayValue ?? []
        return try decode(
            RequestDocument(
                object: object, value: object["value"].map(CanonicalJSON.init),
                opValues: ops.map { $0.objectValue?["value"].map(CanonicalJSON.init) }))
    }

    private static func decode(_ document: RequestDocument) throws(RequestFailure) -> Request {
        if let value = document.notObject {
            throw RequestFailure(id: .null, .badJSON, "a request must be a JSON object, not \(value.typeName == "array" ? "an" : "a") \(value.typeName)")
        }
        let object = document.object
        let id = object["id"] ?? .null
        switch id {
        case .null, .int, .double, .string: break
        default: throw RequestFailure(id: id, .badRequest, "field \"id\" must be a number or a string, not \(id.typeName)")
        }
        let fields = Fields(object: object, id: id, document: document)
        guard let opValue = object["op"], !opValue.isNull else {
            throw RequestFailure(id: id, .badRequest, "missing field \"op\"")
        }
        guard case .string(let op) = opValue else {
            throw RequestFailure(id: id, .badRequest, "field \"op\" must be a string, not \(opValue.typeName)")
        }
        let command: Command
        switch op {
        case "hello":
            command = .hello(protocol: try fields.optionalInt("protocol"), client: try fields.optionalString("client"))
        case "ping":
            command = .ping
        case "get":
            command = .get(repo: try fields.repo(), key: try fields.key())
        case "set":
            command = .set(
                repo: try fields.repo(), key: try fields.key(), value: try fields.value(),
                ifRev: try fields.optionalRevision("ifRev"), force: try fields.optionalBool("force") ?? false, lease: try fields.lease())
        case "delete":
            command = .delete(repo: try fields.repo(), key: try fields.key(), ifRev: try fields.optionalRevision("ifRev"))
        case "batch":
            let (ops, leases) = try fields.batchOps()
            command = .batch(repo: try fields.repo(), ops: ops, leases: leases)
        case "list":
            command = .list(
                repo: try fields.repo(), prefix: try fields.optionalString("prefix"),
                values: try fields.optionalBool("values") ?? false)
        case "repos":
            command = .repos
        case "subscribe":
            command = .subscribe(try fields.subscribe())
        case "unsubscribe":
            guard let sub = try fields.optionalRevision("sub") else { throw fields.fail("missing field \"sub\"") }
            command = .unsubscribe(sub: sub)
        case "stats":
            command = .stats
        case "grant":
            let ttl = try fields.optionalInt("ttl")
            if let ttl, !(1...31_536_000).contains(ttl) {
                throw fields.fail("field \"ttl\" must be from 1 to 31536000 seconds, not \(ttl)")
            }
            command = .grant(ttl: ttl)
        case "keepalive":
            guard let lease = try fields.lease() else { throw fields.fail("missing field \"lease\"") }
            command = .keepalive(lease: lease)
        case "revoke":
            guard let lease = try fields.lease() else { throw fields.fail("missing field \"lease\"") }
            command = .revoke(lease: lease)
        default:
            throw RequestFailure(id: id, .unknownOp, "unknown op \(JSONValue.string(op).jsonText)")
        }
        return Request(id: id, command: command)
    }
}

/// Typed access to a request's fields, producing `bad_request` failures that name the field.
private struct Fields {
    let object: JSONObject
    let id: JSONValue
    /// Where the canonical values are (a `null` placeholder stands for them in `object`).
    let document: RequestDocument
    /// Prepended to messages, e.g. `ops[2]: `.
    var context = ""
    /// Inside `ops`: the element's position.
    var element: Int? = nil

    func fail(_ message: String) -> RequestFailure {
        RequestFailure(id: id, .badRequest, context + message)
    }

    func value(_ name: String) -> JSONValue? {
        guard let v = object[name], !v.isNull else { return nil }
        return v
    }

    func required(_ name: String) throws(RequestFailure) -> JSONValue {
        guard let v = object[name] else { throw fail("missing field \"\(name)\"") }
        return v
    }

    /// The `value` member, canonical.
    func value() throws(RequestFailure) -> CanonicalJSON {
        let captured = element.map { document.opValues.indices.contains($0) ? document.opValues[$0] : nil } ?? document.value
        guard object["value"] != nil, let captured else { throw fail("missing field \"value\"") }
        return captured
    }

    func optionalString(_ name: String) throws(RequestFailure) -> String? {
        guard let v = value(name) else { return nil }
        guard case .string(let s) = v else { throw fail("field \"\(name)\" must be a string, not \(v.typeName)") }
        return s
    }

    func optionalBool(_ name: String) throws(RequestFailure) -> Bool? {
        guard let v = value(name) else { return nil }
        guard case .bool(let b) = v else { throw fail("field \"\(name)\" must be a boolean, not \(v.typeName)") }
        return b
    }

    func optionalInt(_ name: String) throws(RequestFailure) -> Int64? {
        guard let v = value(name) else { return nil }
        guard let i = v.int64Value else { throw fail("field \"\(name)\" must be an integer, not \(v.jsonText.prefix(40))") }
        return i
    }

    /// A revision or subscription number: a non-negative integer below 2^64.
    func optionalRevision(_ name: String) throws(RequestFailure) -> UInt64? {
        guard let v = value(name) else { return nil }
        guard let u = v.uint64Value else {
            throw fail("field \"\(name)\" must be a non-negative integer, not \(v.jsonText.prefix(40))")
        }
        return u
    }

    func repo() throws(RequestFailure) -> String {
        guard let v = value("repo") else { throw fail("missing field \"repo\"") }
        guard case .string(let name) = v else { throw fail("field \"repo\" must be a string, not \(v.typeName)") }
        guard ProtocolRules.isValidRepoName(name) else {
            throw fail(
                "invalid repository name \(JSONValue.string(String(name.prefix(140))).jsonText): use 1–\(ProtocolRules.maxRepoNameLength) characters of A-Z a-z 0-9 . _ -")
        }
        return name
    }

    func key(_ name: String = "key") throws(RequestFailure) -> Key {
        guard let v = value(name) else { throw fail("missing field \"\(name)\"") }
        return try Self.key(v, field: name, fail: fail)
    }

    static func key(_ v: JSONValue, field: String, fail: (String) -> RequestFailure) throws(RequestFailure) -> Key {
        guard case .string(let s) = v else { throw fail("field \"\(field)\" must be a string, not \(v.typeName)") }
        if let problem = ProtocolRules.keyProblem(s) { throw fail(problem) }
        return Key(s)
    }

    /// A lease id: an integer from 1.
    func lease() throws(RequestFailure) -> UInt64? {
        guard let v = value("lease") else { return nil }
        guard let id = v.uint64Value, id >= 1 else { throw fail("field \"lease\" must be a lease id (an integer from 1), not \(v.jsonText.prefix(40))") }
        return id
    }

    /// The batch's operations, and the lease each names (empty when none does).
    func batchOps() throws(RequestFailure) -> ([WriteOp<CanonicalJSON>], [UInt64?]) {
        guard let v = value("ops") else { throw fail("missing field \"ops\"") }
        guard case .array(let elements) = v else { throw fail("field \"ops\" must be an array, not \(v.typeName)") }
        var ops: [WriteOp<CanonicalJSON>] = []
        var leases: [UInt64?] = []
        ops.reserveCapacity(elements.count)
        var seen = Set<Key>(minimumCapacity: elements.count)
        for (i, element) in elements.enumerated() {
            guard case .object(let o) = element else {
                throw fail("ops[\(i)] must be an object, not \(element.typeName)")
            }
            let f = Fields(object: o, id: id, document: document, context: "ops[\(i)]: ", element: i)
            guard let opValue = f.value("op") else { throw f.fail("missing field \"op\"") }
            guard case .string(let op) = opValue else { throw f.fail("field \"op\" must be a string, not \(opValue.typeName)") }
            let key = try f.key()
            guard seen.insert(key).inserted else {
                throw f.fail("key \(key.debugDescription) appears more than once in the batch")
            }
            switch op {
            case "set":
                ops.append(
                    .set(key, try f.value(), ifRevision: try f.optionalRevision("ifRev"), force: try f.optionalBool("force") ?? false))
                if let lease = try f.lease() {
                    if leases.isEmpty { leases = Array(repeating: nil, count: i) }
                    leases.append(lease)
                } else if !leases.isEmpty {
                    leases.append(nil)
                }
            case "delete":
                ops.append(.delete(key, ifRevision: try f.optionalRevision("ifRev")))
                if !leases.isEmpty { leases.append(nil) }
            default:
                throw f.fail("op must be \"set\" or \"delete\" inside a batch, not \(JSONValue.string(op).jsonText)")
            }
        }
        return (ops, leases)
    }

    func subscribe() throws(RequestFailure) -> SubscribeRequest {
        let repo = try repo()
        let keysValue = value("keys")
        let prefix = try optionalString("prefix")
        var selection = Selection.all
        if let keysValue {
            if prefix != nil { throw fail("use at most one of \"keys\" and \"prefix\"") }
            guard case .array(let elements) = keysValue else {
                throw fail("field \"keys\" must be an array of strings, not \(keysValue.typeName)")
            }
            var keys = Set<Key>(minimumCapacity: elements.count)
            for (i, e) in elements.enumerated() {
                keys.insert(try Self.key(e, field: "keys[\(i)]", fail: fail))
            }
            selection = .keys(keys)
        } else if let prefix {
            selection = prefix.isEmpty ? .all : .prefix(prefix)
        }
        let initial = try optionalBool("initial") ?? false
        let since = try optionalRevision("since")
        if initial && since != nil {
            throw fail("\"since\" and \"initial\" cannot be used together: resume with since, or start over with initial")
        }
        // `epoch` is read only with `since` (without it, it has no meaning and is ignored).
        let epoch = since == nil ? nil : try optionalString("epoch")
        let once = try optionalBool("once") ?? false
        let coalesce = try optionalBool("coalesce") ?? false
        if once && coalesce {
            throw fail("\"coalesce\" and \"once\" cannot be used together: a once subscription ends at its first change, there is nothing to coalesce")
        }
        return SubscribeRequest(
            repo: repo, selection: selection, initial: initial, since: since, epoch: epoch, once: once, coalesce: coalesce,
            writers: try optionalBool("writers") ?? false, echo: try optionalBool("echo") ?? true,
            progress: try optionalBool("progress") ?? false)
    }
}
