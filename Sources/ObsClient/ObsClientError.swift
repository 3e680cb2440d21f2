// ObsClient — the async/await client of obsd (depends on the protocol, never on the daemon).
//
// This file owns the client's errors: every failure is one of a few cases, each with a
// message a person understands.

import ObsProtocol
import ObservableKit

/// Why a client call failed.
public enum ObsClientError: Error, Sendable, CustomStringConvertible {
    /// The daemon's socket could not be reached.
    case cannotConnect(path: String, reason: String)
    /// The daemon refused the request (`not_found`, `conflict`, `forbidden`, …).
    case server(ProtocolError)
    /// The connection closed before the reply or while a subscription was live.
    case connectionClosed(path: String)
    /// The client read too slowly: the daemon closed the connection — or, while calls waited
    /// for replies, the client ended this subscription to bound its memory (the connection
    /// goes on; see FlowControl). Resubscribe with `since: resumeAfter` to continue without
    /// a gap.
    case overflowed(resumeAfter: UInt64)
    /// The daemon sent something the protocol does not allow.
    case protocolViolation(String)
    /// A value could not be decoded as the type asked for (`key` is nil for a value that
    /// is not a key's, such as a reply field).
    case undecodable(key: Key?, type: String, reason: String)
    /// A value could not be encoded as JSON (a non-finite number, a failing `encode(to:)`).
    case unencodable(type: String, reason: String)
    /// The `ObsSession` was closed.
    case sessionClosed
    /// The task waiting for the call was cancelled.
    case cancelled

    /// The protocol error code, for `.server` errors.
    public var code: ErrorCode? {
        if case .server(let e) = self { return e.code }
        return nil
    }

    public var description: String {
        switch self {
        case .cannotConnect(let path, let reason):
            return "cannot connect to obsd at \(path): \(reason)"
        case .server(let error):
            return "\(error.message) (\(error.code.rawValue))"
        case .connectionClosed(let path):
            return "the connection to obsd at \(path) was closed"
        case .overflowed(let rev):
            return "the subscription was cut off because its events were read too slowly (complete through revision \(rev))"
        case .protocolViolation(let text):
            return "protocol violation: \(text)"
        case .undecodable(let key, let type, let reason):
            return "\(key.map { "the value of key \($0.debugDescription)" } ?? "a value") is not a valid \(type): \(reason)"
        case .unencodable(let type, let reason):
            return "a \(type) could not be encoded as JSON: \(reason)"
        case .sessionClosed:
            return "the session was closed"
        case .cancelled:
            return "the call was cancelled"
        }
    }
}
