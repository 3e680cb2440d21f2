// ObsClient — leases: keys that live as long as their owner. `Lease` is a granted lease as a
// value an app keeps: while it lives, a lease with a TTL is kept alive (a `keepalive` every
// third of its TTL, on whatever connection its session has); `revoke()` ends it at once;
// dropping it stops the keep-alive, so the lease expires within its TTL. The operations
// themselves (`grant`, `keepalive`, `revoke`) are on `ObsConnection` and `ObsSession`.

import ObsProtocol
import ObservableKit

/// A lease granted by the daemon: the keys written with it are deleted when it ends.
///
/// ```swift
/// let lease = try await session.grant(ttl: .seconds(10))   // kept alive while `lease` lives
/// try await session.set("worker/42", to: "busy", in: "jobs", lease: lease.id)
/// // ... the process dies: within 10 s, worker/42 is deleted, and watchers see why (expired)
/// try await lease.revoke()                                   // or end it now
/// ```
///
/// A lease with a TTL ends when it is not kept alive for that long — the process died, or its
/// session could not reach the daemon — or when revoked. A lease without one
/// (``ObsConnection/grant(ttl:)`` with `nil`) ends with the connection that granted it. For a
/// key that should exist exactly while the process holds it, across reconnections, use a
/// ``Hold``.
public final class Lease: Sendable {
    /// A lease's number, as the daemon gave it (never reused while its data persists).
    public struct ID: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
        public let rawValue: UInt64

        /// The lease numbered `rawValue`.
        public init(rawValue: UInt64) {
            self.rawValue = rawValue
        }

        public var description: String { String(rawValue) }
    }

    /// The lease's number: pass it as `lease:` to `set`.
    public let id: ID
    /// The TTL it was granted with; nil for a lease bound to the connection that granted it.
    public let ttl: Duration?
    private let keeper: LeaseKeeper

    init(id: ID, ttl: Duration?, connection: @escaping @Sendable () async throws(ObsClientError) -> ObsConnection, boundTo bound: ObsConnection?) {
        self.id = id
        self.ttl = ttl
        self.keeper = LeaseKeeper(id: id, connection: connection)
        if let ttl { keeper.keepAlive(every: ttl / 3) }
        if let bound { bound.whenClosed { [keeper] in keeper.ended() } }
    }

    deinit { keeper.stop() }

    /// Whether the lease is known to have ended: revoked, found expired by a keep-alive, or —
    /// bound to a connection — that connection closed.
    public var hasEnded: Bool { keeper.hasEnded }

    /// Returns once the lease is known to have ended (see ``hasEnded``).
    public func waitUntilEnded() async { await keeper.waitUntilEnded() }

    /// Starts the lease's TTL again in full now (the automatic keep-alive does this every third
    /// of the TTL). Fails with `notFound` once the lease has ended.
    public func keepAlive() async throws(ObsClientError) {
        try await keeper.keepAliveOnce()
    }

    /// Ends the lease now: every key still attached to it is deleted, in one revision per
    /// repository. Returns those revisions by repository (empty if it held no key).
    @discardableResult
    public func revoke() async throws(ObsClientError) -> [String: UInt64] {
        keeper.stop()
        let revisions = try await keeper.connection().revoke(id)
        keeper.ended()
        return revisions
    }
}

/// The lease's keep-alive task and what is known of its end. Separate from `Lease` so that
/// the task does not keep the lease alive: dropping the lease stops it.
final class LeaseKeeper: Sendable {
    private struct State {
        var task: Task<Void, Never>?
        var ended = false
        var waiters: [CheckedContinuation<Void, Never>] = []
    }

    let id: Lease.ID
    let connection: @Sendable () async throws(ObsClientError) -> ObsConnection
    private let state = Locked(State())

    init(id: Lease.ID, connection: @escaping @Sendable () async throws(ObsClientError) -> ObsConnection) {
        self.id = id
        self.connection = connection
    }

    var hasEnded: Bool { state.withLock { $0.ended } }

    /// Sends `keepalive` every `interval` until stopped or the lease is found ended. A call that
    /// fails for the connection is tried again at the next interval (a session reconnects
    /// meanwhile); `notFound` or `forbidden` mean the lease is gone.
    func keepAlive(every interval: Duration) {
        let task = Task { [self] in
            while !Task.isCancelled {
                do { try await Task.sleep(for: interval) } catch { return }
                do throws(ObsClientError) {
                    try await keepAliveOnce()
                } catch where error.code == .notFound || error.code == .forbidden || error.code == .sessionClosed {
                    return
                } catch {
                    continue
                }
            }
        }
        state.withLock { $0.task = task }
    }

    func keepAliveOnce() async throws(ObsClientError) {
        do throws(ObsClientError) {
            try await connection().keepAlive(id)
        } catch where error.code == .notFound || error.code == .forbidden {
            ended()
            throw error
        }
    }

    /// Stops the keep-alive.
    func stop() {
        state.withLock { $0.task }?.cancel()
    }

    /// Records that the lease ended; wakes whoever waits for that.
    func ended() {
        let waiters = state.withLock { s in
            s.ended = true
            defer { s.waiters = [] }
            return s.waiters
        }
        stop()
        for waiter in waiters { waiter.resume() }
    }

    func waitUntilEnded() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let now = state.withLock { s in
                if s.ended { return true }
                s.waiters.append(continuation)
                return false
            }
            if now { continuation.resume() }
        }
    }
}

// MARK: - Granting

extension ObsConnection {
    /// Grants a lease.
    ///
    /// - Parameter ttl: with a TTL (1 second to a year; a fraction of a second counts as a
    ///   whole one), the lease ends that long after it was granted or last kept alive — the
    ///   returned ``Lease`` keeps it alive, on this connection, while it lives. Without one, the
    ///   lease ends when this connection closes, however it closes.
    /// - Throws: `badRequest` without asking the daemon for a TTL out of range; `overloaded`
    ///   when this user holds as many live leases as the daemon allows.
    public func grant(ttl: Duration? = nil) async throws(ObsClientError) -> Lease {
        let seconds = try ttl.map { ttl throws(ObsClientError) in try Lease.seconds(ttl) }
        let reply = try await call(.lease(.grant(ttl: seconds)), as: GrantReply.self)
        return Lease(
            id: Lease.ID(rawValue: reply.lease), ttl: seconds.map { .seconds($0) }, connection: { [self] () throws(ObsClientError) in self },
            boundTo: seconds == nil ? self : nil)
    }
}

extension ObsConnection {
    /// Starts the TTL of lease `id` again in full — a lease granted elsewhere (by another
    /// process of the same user, or a script); a ``Lease`` keeps itself alive.
    ///
    /// - Returns: the lease's TTL; nil for a lease bound to a connection.
    /// - Throws: `notFound` when the lease does not exist or has ended, `forbidden` when it is
    ///   another user's.
    @discardableResult
    public func keepAlive(_ id: Lease.ID) async throws(ObsClientError) -> Duration? {
        try await call(.lease(.keepalive(lease: id.rawValue)), as: KeepaliveReply.self).ttl.map { .seconds($0) }
    }

    /// Ends lease `id` now (one granted elsewhere; a ``Lease`` has ``Lease/revoke()``): every
    /// key attached to it is deleted, in one revision per repository.
    ///
    /// - Returns: those revisions by repository (empty if the lease held no key).
    /// - Throws: `notFound` when the lease does not exist or has ended, `forbidden` when it is
    ///   another user's.
    @discardableResult
    public func revoke(_ id: Lease.ID) async throws(ObsClientError) -> [String: UInt64] {
        try await call(.lease(.revoke(lease: id.rawValue)), as: RevokeReply.self).revisions
    }

    /// The lease `key` of `repository` is attached to; nil when it is attached to none or
    /// does not exist.
    public func lease(of key: Key, in repository: String) async throws(ObsClientError) -> Lease.ID? {
        do throws(ObsClientError) {
            return try await call(.get(repo: repository, key: key), as: GetReply<JSONValue>.self).lease.map(Lease.ID.init(rawValue:))
        } catch where error.code == .notFound {
            return nil
        }
    }
}

extension ObsSession {
    /// Grants a lease with a TTL (1 second to a year; a fraction of a second counts as a whole
    /// one): it ends that long after it was granted or last kept alive, or when revoked. The
    /// returned ``Lease`` keeps it alive while it lives, on whatever connection the session has
    /// — across reconnections, as long as the daemon is back within the TTL.
    ///
    /// A lease bound to a connection would end with any reconnection; for a key that exists
    /// while this process holds it, use ``hold(_:as:in:)``.
    public func grant(ttl: Duration) async throws(ObsClientError) -> Lease {
        let seconds = try Lease.seconds(ttl)
        let reply = try await connection().call(.lease(.grant(ttl: seconds)), as: GrantReply.self)
        let core = self.core
        return Lease(
            id: Lease.ID(rawValue: reply.lease), ttl: .seconds(seconds), connection: { () throws(ObsClientError) in try await core.client() },
            boundTo: nil)
    }
}

extension Lease {
    /// A TTL in whole seconds as the protocol takes it, rounded up; `badRequest` out of range.
    static func seconds(_ ttl: Duration) throws(ObsClientError) -> UInt32 {
        let (seconds, attoseconds) = ttl.components
        let whole = seconds + (attoseconds > 0 ? 1 : 0)
        guard whole >= 1, whole <= Int64(LeaseCommand.maxTTL) else {
            throw .server(ProtocolError(.badRequest, "a lease's TTL is from 1 second to \(LeaseCommand.maxTTL) seconds, not \(ttl)"))
        }
        return UInt32(whole)
    }
}
