// ObsClient — the client's errors: one extensible type, a `Code` saying what happened (one
// of the client's own conditions, or the daemon's error code when it refused a request) and
// a message a person understands, with the details that go with some codes. A new code is a
// new static member, never a breaking change (the shape of swift-service-lifecycle's
// `ServiceRunnerError`).

import ObsProtocol
import ObservableKit

/// Why a client call failed.
///
/// Match on ``code``:
///
/// ```swift
/// do {
///     try await connection.set("theme", to: "dark", in: "ui", ifRevision: 4)
/// } catch {
///     switch error.code {
///     case .conflict: break          // someone wrote the key since revision 4: read it again, retry
///     case .connectionClosed: break  // the call may or may not have been applied
///     default: throw error
///     }
/// }
/// ```
///
/// (Swift 6.3.1 crashes compiling `catch where error.code == …` when the error it does not
/// catch goes on as `any Error`; a whole `catch` that throws the rest again, as above, is fine.)
public struct ObsClientError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What kind of failure this is. Extensible: `switch` over it with a `default`.
    public struct Code: Sendable, Hashable, CustomStringConvertible {
        private enum Base: Sendable, Hashable {
            case cannotConnect, connectionClosed, overflowed, protocolViolation, undecodable, unencodable, sessionClosed, cancelled
            case server(ErrorCode)
        }

        private let base: Base
        private init(_ base: Base) { self.base = base }

        /// The daemon's socket could not be reached.
        public static let cannotConnect = Code(.cannotConnect)
        /// The connection closed before the reply or while a subscription was live.
        public static let connectionClosed = Code(.connectionClosed)
        /// The subscription was cut off for reading too slowly; see ``ObsClientError/resumeAfter``.
        public static let overflowed = Code(.overflowed)
        /// The daemon sent something the protocol does not allow.
        public static let protocolViolation = Code(.protocolViolation)
        /// A value could not be decoded as the type asked for.
        public static let undecodable = Code(.undecodable)
        /// A value could not be encoded as JSON.
        public static let unencodable = Code(.unencodable)
        /// The ``ObsSession`` was closed.
        public static let sessionClosed = Code(.sessionClosed)
        /// The task waiting for the call was cancelled.
        public static let cancelled = Code(.cancelled)

        /// The daemon refused the request with `code`.
        public static func server(_ code: ErrorCode) -> Code { Code(.server(code)) }
        /// The daemon refused: the key, subscription or lease does not exist.
        public static let notFound = server(.notFound)
        /// The daemon refused: a compare-and-set condition (`ifRevision`) failed.
        public static let conflict = server(.conflict)
        /// The daemon refused: the peer may not do this.
        public static let forbidden = server(.forbidden)
        /// The daemon refused: a field is missing or invalid.
        public static let badRequest = server(.badRequest)
        /// The daemon refused: a line or value exceeds a limit.
        public static let tooLarge = server(.tooLarge)
        /// The daemon refused: `since` is outside its history, or in another epoch.
        public static let compacted = server(.compacted)
        /// The daemon refused: one of its limits was reached.
        public static let overloaded = server(.overloaded)
        /// The daemon failed.
        public static let internalError = server(.internal)

        /// The daemon's error code, when the daemon refused the request.
        public var serverCode: ErrorCode? {
            if case .server(let code) = base { return code }
            return nil
        }

        public var description: String {
            switch base {
            case .cannotConnect: return "cannotConnect"
            case .connectionClosed: return "connectionClosed"
            case .overflowed: return "overflowed"
            case .protocolViolation: return "protocolViolation"
            case .undecodable: return "undecodable"
            case .unencodable: return "unencodable"
            case .sessionClosed: return "sessionClosed"
            case .cancelled: return "cancelled"
            case .server(let code): return code.rawValue
            }
        }
    }

    /// What kind of failure this is.
    public let code: Code
    /// What went wrong, for a person (for a refusal, the daemon's message).
    public let message: String
    /// The socket, for `cannotConnect` and `connectionClosed`.
    public let socketPath: String?
    /// For `overflowed`: every selected change through this revision was delivered;
    /// subscribe again with `since` it to continue without a gap.
    public let resumeAfter: UInt64?
    /// For `undecodable`: the key whose value it was (nil for a value that is not a key's).
    public let key: Key?
    /// For `undecodable` and `unencodable`: the Swift type asked for.
    public let typeName: String?

    private init(
        _ code: Code, _ message: String, socketPath: String? = nil, resumeAfter: UInt64? = nil, key: Key? = nil, typeName: String? = nil
    ) {
        self.code = code
        self.message = message
        self.socketPath = socketPath
        self.resumeAfter = resumeAfter
        self.key = key
        self.typeName = typeName
    }

    /// The daemon's refusal as it sent it, when the daemon refused the request.
    public var serverError: ProtocolError? { code.serverCode.map { ProtocolError($0, message) } }

    public var description: String {
        switch code {
        case .cannotConnect: return "cannot connect to obsd at \(socketPath ?? "?"): \(message)"
        case .connectionClosed: return "the connection to obsd at \(socketPath ?? "?") was closed"
        case .protocolViolation: return "protocol violation: \(message)"
        default:
            if let serverCode = code.serverCode { return "\(message) (\(serverCode.rawValue))" }
            return message
        }
    }

    // MARK: Making errors

    /// The daemon's socket at `path` could not be reached, for `reason`.
    public static func cannotConnect(path: String, reason: String) -> ObsClientError {
        ObsClientError(.cannotConnect, reason, socketPath: path)
    }

    /// The daemon refused the request.
    public static func server(_ error: ProtocolError) -> ObsClientError {
        ObsClientError(.server(error.code), error.message)
    }

    /// The connection to `path` closed.
    public static func connectionClosed(path: String) -> ObsClientError {
        ObsClientError(.connectionClosed, "the connection was closed", socketPath: path)
    }

    /// The client read too slowly: resubscribe with `since: resumeAfter`.
    public static func overflowed(resumeAfter: UInt64) -> ObsClientError {
        ObsClientError(
            .overflowed,
            "the subscription was cut off because its events were read too slowly (complete through revision \(resumeAfter))",
            resumeAfter: resumeAfter)
    }

    /// The daemon broke the protocol.
    public static func protocolViolation(_ text: String) -> ObsClientError {
        ObsClientError(.protocolViolation, text)
    }

    /// A value (of `key`, if it is a key's) is not a valid `type`.
    public static func undecodable(key: Key?, type: String, reason: String) -> ObsClientError {
        ObsClientError(.undecodable, "\(key.map { "the value of key \($0.debugDescription)" } ?? "a value") is not a valid \(type): \(reason)", key: key, typeName: type)
    }

    /// A `type` could not be encoded as JSON.
    public static func unencodable(type: String, reason: String) -> ObsClientError {
        ObsClientError(.unencodable, "a \(type) could not be encoded as JSON: \(reason)", typeName: type)
    }

    /// The session was closed.
    public static let sessionClosed = ObsClientError(.sessionClosed, "the session was closed")

    /// The waiting task was cancelled.
    public static let cancelled = ObsClientError(.cancelled, "the call was cancelled")
}
