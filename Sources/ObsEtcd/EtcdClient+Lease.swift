// ObsEtcd: etcd's leases — grant, keep-alive, revoke and time-to-live, over the same gateway
// (`POST /v3/lease/grant`, `/v3/lease/keepalive`, `/v3/lease/revoke`, `/v3/lease/timetolive`)
// with the same failover and deadlines as every other call. Keys are attached to a lease by a
// put (`EtcdOp.put(…, lease:)`); etcd deletes them, in one revision, when the lease ends.
//
// What etcd 3.4.23 does (checked against a member on this machine): a TTL below the member's
// minimum (1.5 election timeouts rounded up: 2 s with the default 1 s) is granted as that
// minimum; the lessor looks for expired leases every 500 ms, so a lease ends between its TTL
// and about half a second later (plus the raft round that deletes its keys); a leader change
// gives every lease its whole TTL again. The keep-alive RPC is a stream; sent with a complete
// body, the gateway answers one `{"result": …}` line and ends it — without a TTL when the
// lease is gone.

/// A lease etcd granted.
public struct EtcdLease: Sendable, Hashable {
    /// etcd's id for it (cluster-wide; attach keys with `EtcdOp.put(…, lease: id)`).
    public var id: Int64
    /// The TTL granted, in seconds (at least etcd's minimum).
    public var ttl: Int64

    public init(id: Int64, ttl: Int64) {
        self.id = id
        self.ttl = ttl
    }
}

extension EtcdClient {
    /// Grants a lease of `ttl` seconds. A grant whose answer is lost may still be made (it
    /// expires by itself).
    public func leaseGrant(ttl: Int64, timeout: Duration? = nil) async throws -> EtcdLease {
        let body = try WireCoding.encode(WireLeaseGrantRequest(TTL: WireInt(ttl), ID: WireInt(0)))
        let answer: WireLeaseGrantResponse = try await call("/v3/lease/grant", body, isWrite: true, requireLeader: true, timeout: timeout)
        if let error = answer.error, !error.isEmpty { throw EtcdError.server(code: -1, message: error) }
        guard let id = answer.ID?.value, id != 0 else { throw EtcdError.invalidResponse("a lease grant without its ID") }
        return EtcdLease(id: id, ttl: answer.TTL.int64)
    }

    /// Starts lease `id`'s TTL again in full. Returns its TTL, or nil when the lease no longer
    /// exists (it expired or was revoked). Safe to repeat: it is retried on another member.
    public func leaseKeepAlive(_ id: Int64, timeout: Duration? = nil) async throws -> Int64? {
        let body = try WireCoding.encode(WireLeaseID(ID: WireInt(id)))
        let line: WireLeaseKeepAliveLine = try await call(
            "/v3/lease/keepalive", body, isWrite: false, requireLeader: true, timeout: timeout)
        if let error = line.error {
            throw EtcdError.fromGateway(status: error.http_code ?? 500, code: error.grpc_code, message: error.message)
        }
        guard let result = line.result else { throw EtcdError.invalidResponse("a keep-alive answer without its result") }
        let ttl = result.TTL.int64
        return ttl > 0 ? ttl : nil
    }

    /// Revokes lease `id`: etcd deletes every key attached to it, in one revision. Returns
    /// false when the lease did not exist (any more). Safe to repeat.
    @discardableResult
    public func leaseRevoke(_ id: Int64, timeout: Duration? = nil) async throws -> Bool {
        let body = try WireCoding.encode(WireLeaseID(ID: WireInt(id)))
        do {
            let _: WireLeaseRevokeResponse = try await call("/v3/lease/revoke", body, isWrite: false, requireLeader: true, timeout: timeout)
            return true
        } catch EtcdError.server(let code, let message) where code == 5 || message == Self.leaseNotFoundMessage {
            return false
        }
    }

    /// The seconds lease `id` has left and the TTL it was granted; nil when it does not exist.
    public func leaseTimeToLive(_ id: Int64, timeout: Duration? = nil) async throws -> (remaining: Int64, granted: Int64)? {
        let body = try WireCoding.encode(WireLeaseID(ID: WireInt(id)))
        let answer: WireLeaseTimeToLiveResponse = try await call(
            "/v3/lease/timetolive", body, isWrite: false, requireLeader: true, timeout: timeout)
        let remaining = answer.TTL.int64
        return remaining < 0 ? nil : (remaining, answer.grantedTTL.int64)
    }

    /// etcd's message for a lease that does not exist (a revoke of it, or a put attaching a
    /// key to it; gRPC code 5).
    public static let leaseNotFoundMessage = "etcdserver: requested lease not found"
}

extension EtcdError {
    /// Whether etcd refused the request because a lease it names does not exist.
    public var isLeaseNotFound: Bool {
        if case .server(let code, let message) = self { return code == 5 || message == EtcdClient.leaseNotFoundMessage }
        return false
    }
}

// MARK: - Wire

// Field names are etcd's (jsonpb keeps `ID` and `TTL` as they are in the .proto).

struct WireLeaseGrantRequest: Encodable {
    var TTL: WireInt
    var ID: WireInt
}

struct WireLeaseID: Encodable {
    var ID: WireInt
}

struct WireLeaseGrantResponse: Decodable {
    var header: WireHeader?
    var ID: WireInt?
    var TTL: WireInt?
    var error: String?
}

struct WireLeaseKeepAliveResponse: Decodable {
    var header: WireHeader?
    var ID: WireInt?
    var TTL: WireInt?
}

/// The one line a keep-alive stream answers.
struct WireLeaseKeepAliveLine: Decodable {
    var result: WireLeaseKeepAliveResponse?
    var error: WireStreamError?
}

struct WireLeaseRevokeResponse: Decodable {
    var header: WireHeader?
}

struct WireLeaseTimeToLiveResponse: Decodable {
    var header: WireHeader?
    var ID: WireInt?
    var TTL: WireInt?
    var grantedTTL: WireInt?
}
