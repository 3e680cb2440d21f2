// ObsEtcd: the one error type every call of the client throws, and how an answer of etcd's
// gateway (`{"error", "message", "code"}` with a gRPC status code) becomes one.

/// Why an etcd call failed. Every error the client throws is an `EtcdError`.
///
/// For writes (`txn`, `put`, `delete`, `compact`) the cases split by what is known of the
/// outcome: `unavailable` and `server` (except the timeouts etcd itself reports) mean the
/// request was **not** applied; `timeout`, `connectionLost` and `cancelled` of a write mean
/// the outcome is **unknown** — the write may be applied later (seen on this machine: a txn
/// that timed out under quorum loss was applied once the quorum came back). Ask
/// ``isOutcomeUnknown`` rather than matching cases.
public enum EtcdError: Error, Sendable, Hashable, CustomStringConvertible {
    /// No member could take the request: every endpoint refused the connection, or the member
    /// reachable knows no leader ("etcdserver: no leader", refused before being proposed). The
    /// request was not applied. The reason names the last endpoint's failure.
    case unavailable(String)
    /// The deadline passed before an answer. For a write that was sent, the outcome is unknown.
    case timeout(outcomeUnknown: Bool)
    /// The connection closed after the request was sent and before the answer (a member killed
    /// mid-request). For a write the outcome is unknown; reads are retried on the next endpoint
    /// and end here only when no endpoint is left.
    case connectionLost(outcomeUnknown: Bool)
    /// The revision asked for is compacted: for a watch, the first revision still kept is
    /// `compactRevision` (resume from a fresh read); for a range at an old revision etcd does
    /// not say which, and `compactRevision` is nil.
    case compacted(compactRevision: Int64?)
    /// etcd refused the request: its gRPC status code (3 invalid argument, 9 failed
    /// precondition, 11 out of range, 14 unavailable…) and message.
    case server(code: Int, message: String)
    /// The answer could not be read (not etcd's gateway, or a version that speaks otherwise).
    case invalidResponse(String)
    /// The calling task was cancelled while the request was under way.
    case cancelled(outcomeUnknown: Bool)
    /// The client was given something it cannot use (an endpoint URL that is not
    /// `http://HOST:PORT`, no endpoint, an endpoint index out of range).
    case invalidConfiguration(String)

    /// Whether a write that failed with this error may still have been applied (now or later).
    /// etcd's own timeouts ("request timed out", "…possibly due to previous leader failure",
    /// "…due to connection lost", "leader changed") count: the proposal may commit after etcd
    /// gave up waiting for it.
    public var isOutcomeUnknown: Bool {
        switch self {
        case .timeout(let unknown), .connectionLost(let unknown), .cancelled(let unknown): unknown
        case .server(_, let message): Self.serverTimeoutMessages.contains { message.hasPrefix($0) }
        case .unavailable, .compacted, .invalidResponse, .invalidConfiguration: false
        }
    }

    /// Whether the same request may succeed on another member or later: the cluster, not the
    /// request, was the problem.
    public var isTransient: Bool {
        switch self {
        case .unavailable, .timeout, .connectionLost: true
        case .server(let code, let message): code == 14 || Self.serverTimeoutMessages.contains { message.hasPrefix($0) }
        case .compacted, .invalidResponse, .cancelled, .invalidConfiguration: false
        }
    }

    public var description: String {
        switch self {
        case .unavailable(let reason): "etcd unavailable: \(reason)"
        case .timeout(let unknown): "etcd request timed out" + (unknown ? " (outcome unknown)" : "")
        case .connectionLost(let unknown): "connection to etcd lost" + (unknown ? " (outcome unknown)" : "")
        case .compacted(let revision): "revision compacted" + (revision.map { " (compact revision \($0))" } ?? "")
        case .server(let code, let message): "etcd: \(message) (code \(code))"
        case .invalidResponse(let what): "unexpected answer from etcd: \(what)"
        case .cancelled(let unknown): "etcd request cancelled" + (unknown ? " (outcome unknown)" : "")
        case .invalidConfiguration(let what): "etcd client: \(what)"
        }
    }

    /// etcd's messages for a proposal it stopped waiting for (etcdserver/errors.go), and the
    /// gateway's own deadline (measured: a txn without `hasleader` on a member that lost its
    /// quorum answered "context deadline exceeded", code 2, after 7 s; with it, "etcdserver:
    /// request timed out", code 14, after 7 s, while the member still believed it led).
    static let serverTimeoutMessages = [
        "etcdserver: request timed out",
        "etcdserver: leader changed",
        "context deadline exceeded",
    ]

    /// etcd's message when the member refuses a request that requires a leader.
    static let noLeaderMessage = "etcdserver: no leader"

    /// The message of a range at a compacted revision.
    static let compactedMessage = "etcdserver: mvcc: required revision has been compacted"

    /// The error a gateway answer with a non-200 status stands for.
    static func fromGateway(status: Int, code: Int?, message: String?) -> EtcdError {
        let message = message ?? "HTTP status \(status)"
        if message == noLeaderMessage { return .unavailable(message) }
        if message == compactedMessage { return .compacted(compactRevision: nil) }
        return .server(code: code ?? -1, message: message)
    }
}
