// ObsProtocol — requests: their typed form, and decoding from a line with the precise
// error code for every way a request can be wrong.
//
// Order of checks: not JSON or not an object → `bad_json` (id null); an `id` that is not
// a number or string → `bad_request`; missing or non-string `op` → `bad_request`; an op
// the daemon does not know → `unknown_op`; a missing, ill-typed or invalid field →
// `bad_request` naming the field. Unknown fields are ignored; `null` in an optional field
// means "absent". One request is refused with another code: a `sync` whose `sub` is an
// integer no subscription can have (below 0, above 2^64 − 1) is `not_found`, as the daemon
// answers it for any other integer that names no live subscription.

import ObservableKit

/// A decoded request: its echoed `id` and what it asks.
public struct Request: Sendable, Equatable {
    /// The request's `id`, echoed verbatim in the reply; `.null` when it had none.
    public var id: JSONValue
    public var command: Command
    /// The lease extension: for each key a `set` of this request writes with a `lease` (the
    /// `set` itself, or a `set` inside a `batch`), the lease that key is to be attached to. A
    /// key a `set` writes that is not here is attached to no lease; empty for other requests.
    public var leases: [Key: UInt64]

    public init(id: JSONValue = .null, command: Command, leases: [Key: UInt64] = [:]) {
        self.id = id
        self.command = command
        self.leases = leases
    }
}

/// What a request asks the daemon to do.
public enum Command: Sendable, Equatable {
    case hello(protocol: Int64?, client: String?)
    case ping
    case get(repo: String, key: Key)
    case set(repo: String, key: Key, value: CanonicalJSON, ifRev: UInt64?, force: Bool)
    case delete(repo: String, key: Key, ifRev: UInt64?)
    case batch(repo: String, ops: [WriteOp<CanonicalJSON>])
    case list(repo: String, prefix: String?, values: Bool)
    case repos
    case subscribe(SubscribeRequest)
    case unsubscribe(sub: UInt64)
    case stats
    /// `sync`: the revision subscription `sub` of this connection is complete through, replied
    /// after every event of it up to that revision.
    case sync(sub: UInt64)
    /// `grant`, `keepalive`, `revoke` (the contract's leases).
    case lease(LeaseCommand)

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
        case .sync: return "sync"
        case .lease(let command): return command.op
        }
    }

    /// The repository the command addresses, if any.
    public var repo: String? {
        switch self {
        case .get(let repo, _), .set(let repo, _, _, _, _), .delete(let repo, _, _), .batch(let repo, _),
            .list(let repo, _, _):
            return repo
        case .subscribe(let s): return s.repo
        case .hello, .ping, .repos, .unsubscribe, .stats, .sync, .lease: return nil
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
    /// `progress` events: while live, the revision through which everything it selects was
    /// delivered, at most once a second, when the repository moved on without it.
    public var progress: Bool
    /// With `since`: never `compacted` — past the history, or from another epoch, the
    /// subscription is brought up to the reply's revision by a `catchup` event or a `snapshot`
    /// instead (the reply's `catchup` says which). Not with `once`.
    public var catchup: Bool

    public init(
        repo: String, selection: Selection = .all, initial: Bool = false, since: UInt64? = nil, epoch: String? = nil,
        once: Bool = false, coalesce: Bool = false, writers: Bool = false, echo: Bool = true, progress: Bool = false,
        catchup: Bool = false
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
        self.catchup = catchup
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
        try decode(document(line, maxDepth: maxDepth))
    }

    /// Parses a request line, every member a tree but the values a request only stores.
    static func document(_ line: UnsafeRawBufferPointer, maxDepth: Int) throws(RequestFailure) -> RequestDocument {
        guard let base = line.baseAddress, line.count > 0 else {
            throw RequestFailure(id: .null, .badJSON, "invalid JSON: \(JSONParseError(reason: "empty input", offset: 0))")
        }
        var parser = Parser(base: base.assumingMemoryBound(to: UInt8.self), end: line.count, maxDepth: maxDepth)
        do {
            return try parser.parseRequestDocument()
        } catch {
            throw RequestFailure(id: .null, .badJSON, "invalid JSON: \(error)")
        }
    }

    /// Decodes a parsed request object.
    public static func decode(_ value: JSONValue) throws(RequestFailure) -> Request {
        guard case .object(let object) = value else { return try decode(RequestDocument(notObject: value)) }
        let ops = object["ops"]?.arrayValue ?? []
        let value: CanonicalJSON? = object["value"].map { CanonicalJSON($0) }
        let opValues: [CanonicalJSON?] = ops.map { op in op.objectValue?["value"].map { CanonicalJSON($0) } }
        return try decode(RequestDocument(object: object, value: value, opValues: opValues))
    }

    /// Decodes a request document.
    static func decode(_ document: RequestDocument) throws(RequestFailure) -> Request {
        if let value = document.notObject {
            throw RequestFailure(id: .null, .badJSON, "a request must be a JSON object, not \(value.typeName == "array" ? "an" : "a") \(value.typeName)")
        }
        let object = document.object
        let id = object["id"] ?? .null
        switch id {
        case .null, .int, .double, .string: break
        default: throw RequestFailure(id: id, .badRequest, "field \"id\" must be a number or a string, not \(id.typeName)")
        }
        let fields = RequestFields(object: object, id: id, document: document)
        guard let opValue = object["op"], !opValue.isNull else {
            throw RequestFailure(id: id, .badRequest, "missing field \"op\"")
        }
        guard case .string(let op) = opValue else {
            throw RequestFailure(id: id, .badRequest, "field \"op\" must be a string, not \(opValue.typeName)")
        }
        let command: Command
        var attached: [Key: UInt64] = [:]
        switch op {
        case "hello":
            command = .hello(protocol: try fields.optionalInt("protocol"), client: try fields.optionalString("client"))
        case "ping":
            command = .ping
        case "get":
            command = .get(repo: try fields.repo(), key: try fields.key())
        case "set":
            let (repo, key, value) = (try fields.repo(), try fields.key(), try fields.value())
            command = .set(
                repo: repo, key: key, value: value, ifRev: try fields.optionalRevision("ifRev"), force: try fields.optionalBool("force") ?? false)
            attached[key] = try fields.optionalLease("lease")
        case "delete":
            command = .delete(repo: try fields.repo(), key: try fields.key(), ifRev: try fields.optionalRevision("ifRev"))
        case "batch":
            let repo = try fields.repo()
            let (ops, opLeases) = try fields.batchOps()
            command = .batch(repo: repo, ops: ops)
            attached = opLeases
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
        case "sync":
            command = .sync(sub: try fields.syncSubscription())
        case "stats":
            command = .stats
        case "grant", "keepalive", "revoke":
            command = .lease(try fields.leaseCommand(op))
        default:
            throw RequestFailure(id: id, .unknownOp, "unknown op \(JSONValue.string(op).jsonText)")
        }
        return Request(id: id, command: command, leases: attached)
    }
}
