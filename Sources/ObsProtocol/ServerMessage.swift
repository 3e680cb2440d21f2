// ObsProtocol — a line from the daemon, decoded (client side): a reply — its id, and its
// members or its error — or one of the typed events. A reply's members are read as the
// typed reply the request expects (`Reply.decode(as:)`), since a reply does not say which
// request it answers: the client knows from the order.

/// A reply as a client receives it.
public struct Reply: Sendable {
    /// The echoed request id.
    public let id: JSONValue
    /// The reply's members (without `id` and `ok`) on success, or the error.
    public let result: Result<JSONObject, ProtocolError>

    public init(id: JSONValue, result: Result<JSONObject, ProtocolError>) {
        self.id = id
        self.result = result
    }

    /// The success reply's members read as `R`; the daemon's error, thrown as itself.
    public func decode<R: ReplyMessage>(as type: R.Type = R.self) throws -> R {
        try R(decoding: result.get())
    }
}

/// An event as a client receives it, values as `JSONValue`.
public enum ServerEvent: Sendable, Equatable {
    case change(ChangeEvent<JSONValue>)
    case snapshot(SnapshotEvent<JSONValue>)
    case synced(SyncedEvent)
    case progress(ProgressEvent)
    /// A subscription that resumed with `catchup` past the history: the keys that changed.
    case catchUp(CatchUpEvent<JSONValue>)
    /// The connection is being closed: for each subscription, the revision it is complete up to.
    case overflow(OverflowEvent)
    /// The subscription ended because the peer may no longer read its repository.
    case revoked(RevokedEvent)
    /// An event this client does not know (a newer daemon's); ignored.
    case unknown(name: String)

    /// The subscription the event belongs to, if it belongs to one.
    public var subscription: UInt64? {
        switch self {
        case .change(let e): return e.subscription
        case .snapshot(let e): return e.subscription
        case .synced(let e): return e.subscription
        case .progress(let e): return e.subscription
        case .catchUp(let e): return e.subscription
        case .revoked(let e): return e.subscription
        case .overflow, .unknown: return nil
        }
    }

    /// Reads the event named `name` from its members.
    public init(name: String, decoding members: JSONObject) throws(ProtocolViolation) {
        switch name {
        case ChangeEvent<JSONValue>.name: self = .change(try ChangeEvent(decoding: members))
        case SnapshotEvent<JSONValue>.name: self = .snapshot(try SnapshotEvent(decoding: members))
        case SyncedEvent.name: self = .synced(try SyncedEvent(decoding: members))
        case ProgressEvent.name: self = .progress(try ProgressEvent(decoding: members))
        case CatchUpEvent<JSONValue>.name: self = .catchUp(try CatchUpEvent(decoding: members))
        case OverflowEvent.name: self = .overflow(try OverflowEvent(decoding: members))
        case RevokedEvent.name: self = .revoked(try RevokedEvent(decoding: members))
        default: self = .unknown(name: name)
        }
    }
}

/// A message from the daemon.
public enum ServerMessage: Sendable {
    case reply(Reply)
    case event(ServerEvent)
}

extension ServerMessage {
    /// Decodes one line from the daemon.
    public static func decode(line: UnsafeRawBufferPointer) throws(ProtocolViolation) -> ServerMessage {
        let value: JSONValue
        do {
            value = try JSONParser.parse(line, maxDepth: 4096)
        } catch {
            throw ProtocolViolation("daemon sent invalid JSON: \(error)")
        }
        guard case .object(let o) = value else { throw ProtocolViolation("daemon sent a non-object message") }
        return try decode(o)
    }

    /// Decodes a parsed message from the daemon.
    public static func decode(_ message: JSONObject) throws(ProtocolViolation) -> ServerMessage {
        var o = message
        if let name = o["event"] {
            guard case .string(let name) = name else { throw ProtocolViolation("\"event\" is not a string") }
            return .event(try ServerEvent(name: name, decoding: o))
        }
        guard let ok = o["ok"]?.boolValue else { throw ProtocolViolation("message has neither \"event\" nor \"ok\"") }
        let id = o["id"] ?? .null
        if ok {
            o["id"] = nil
            o["ok"] = nil
            return .reply(Reply(id: id, result: .success(o)))
        }
        guard let error = o["error"]?.objectValue, let code = error["code"]?.stringValue else {
            throw ProtocolViolation("error reply without error.code")
        }
        return .reply(Reply(id: id, result: .failure(ProtocolError(decodingCode: code, message: error["message"]?.stringValue ?? ""))))
    }
}

extension ProtocolError {
    /// An error as a reply or event carried it; a code this version does not know is kept.
    public init(decodingCode code: String, message: String) {
        self.init(ErrorCode(rawValue: code), message)
    }
}
