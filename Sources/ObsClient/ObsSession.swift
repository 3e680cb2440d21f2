// ObsClient — a connection that comes back: `ObsSession` keeps one `ObsConnection`
// connected, reconnecting with exponential backoff after the daemon restarts or the
// connection drops, and publishes its connection state. `watch` (Watch.swift) and the
// Observation mirrors (RemoteRepository, RemoteValue) are built on it.

import NIOCore
import NIOPosix
import ObsProtocol
import ObservableKit

/// The state of an `ObsSession`'s connection.
public enum ConnectionState: Sendable, Equatable, CustomStringConvertible {
    /// A connection attempt is under way.
    case connecting
    /// Connected; calls go straight to the daemon.
    case connected
    /// Not connected (`reason` says why); the next attempt starts after `retryIn`.
    case waiting(retryIn: Duration, reason: String)
    /// The session was closed; it will not connect again.
    case closed

    public var description: String {
        switch self {
        case .connecting: return "connecting"
        case .connected: return "connected"
        case .waiting(let delay, let reason):
            let ms = delay.components.seconds * 1000 + delay.components.attoseconds / 1_000_000_000_000_000
            return "disconnected (\(reason)); retrying in \(ms) ms"
        case .closed: return "closed"
        }
    }
}

/// How long to wait between connection attempts: `initial`, doubling up to `maximum`,
/// each delay shortened by up to `jitter` (a fraction) so that many clients of a restarted
/// daemon do not reconnect in lockstep.
public struct Backoff: Sendable, Equatable {
    public var initial: Duration
    public var maximum: Duration
    public var jitter: Double

    public init(initial: Duration = .milliseconds(50), maximum: Duration = .seconds(5), jitter: Double = 0.2) {
        self.initial = initial
        self.maximum = maximum
        self.jitter = min(max(jitter, 0), 1)
    }

    /// The delay before attempt `attempt + 1` of a series of failures (0 for the first retry).
    /// A session's series ends when a connection is usable: the daemon answered on it.
    public func delay(after attempt: Int) -> Duration {
        var delay = initial
        for _ in 0..<min(attempt, 32) where delay < maximum { delay = min(delay * 2, maximum) }
        return jitter > 0 ? delay * (1 - Double.random(in: 0...jitter)) : delay
    }
}

/// A connection to obsd that reconnects by itself.
///
/// Calls wait for a connection (and can be cancelled); a call in flight when the
/// connection drops fails with `connectionClosed` — it is not retried, since it may have
/// been applied. Watches (``watch(_:selecting:initial:since:epoch:options:)``) resume
/// without a gap or a duplicate.
///
/// ```swift
/// let session = ObsSession()                       // OBSD_SOCKET, then the default path
/// for try await event in session.watch("ui", selecting: .keys(["theme"])) { print(event) }
/// ```
public final class ObsSession: Sendable {
    /// The socket the session connects to.
    public let socketPath: String
    let core: SessionCore

    /// Starts connecting at once.
    ///
    /// - Parameters:
    ///   - socketPath: the socket; `nil` resolves it as the contract says (`OBSD_SOCKET`,
    ///     then `$XDG_RUNTIME_DIR/obsd.sock`, then `/run/obsd/obsd.sock`).
    ///   - backoff: how long to wait between connection attempts.
    ///   - eventLoopGroup: the SwiftNIO event loops its connections run on.
    public convenience init(
        socketPath: String? = nil, backoff: Backoff = Backoff(),
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton
    ) {
        self.init(socketPath: socketPath, backoff: backoff, eventLoopGroup: eventLoopGroup, limits: .standard)
    }

    /// Starts connecting at once; each connection bounds its unconsumed events by `limits`.
    init(socketPath: String?, backoff: Backoff, eventLoopGroup: any EventLoopGroup, limits: FlowControl.Limits) {
        let path = SocketPath.resolve(explicit: socketPath, environment: ProcessEnvironment.current)
        self.socketPath = path
        self.core = SessionCore(path: path, backoff: backoff, group: eventLoopGroup, limits: limits)
    }

    deinit { core.close() }

    /// A session on the default socket (`OBSD_SOCKET`, then the contract's default path),
    /// created on first use — for apps that talk to one daemon.
    public static let shared = ObsSession()

    /// The connection's state now.
    public var connectionState: ConnectionState { core.state }

    /// The connection's state, now and at every change, until the session closes.
    public func connectionStates() -> AsyncStream<ConnectionState> { core.states() }

    /// The current connection, waiting for one if there is none.
    public func connection() async throws(ObsClientError) -> ObsConnection { try await core.client() }

    /// Closes the connection and stops reconnecting. Watches end with `sessionClosed`.
    public func close() async {
        let client = core.client
        core.close()
        await client?.waitUntilClosed()
    }

    // MARK: Operations on the current connection

    /// The value of `key` in `repository` and its revision, or nil if it does not exist.
    public func get(_ key: Key, in repository: String) async throws(ObsClientError) -> Entry<JSONValue>? {
        try await connection().get(key, in: repository)
    }

    /// Sets `key` in `repository` to `value` (see `ObsConnection.set(_:to:in:ifRevision:force:lease:)`).
    /// A `lease` of the session's is one with a TTL (``grant(ttl:)``): it outlives connections.
    @discardableResult
    public func set(
        _ key: Key, to value: JSONValue, in repository: String, ifRevision: UInt64? = nil, force: Bool = false,
        lease: Lease.ID? = nil
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await connection().set(key, to: value, in: repository, ifRevision: ifRevision, force: force, lease: lease)
    }

    /// Deletes `key` from `repository` (see ``ObsConnection/delete(_:in:ifRevision:)``).
    @discardableResult
    public func delete(_ key: Key, in repository: String, ifRevision: UInt64? = nil) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await connection().delete(key, in: repository, ifRevision: ifRevision)
    }

    /// Applies `operations` to `repository` atomically, as one revision.
    @discardableResult
    public func apply(_ operations: [WriteOp<JSONValue>], in repository: String) async throws(ObsClientError) -> BatchReply {
        try await connection().apply(operations, in: repository)
    }
}

/// The session's state and its connection loop. Separate from `ObsSession` so that the
/// loop's task does not keep the session alive: dropping the session closes it.
final class SessionCore: Sendable {
    private struct State {
        var phase = ConnectionState.connecting
        var client: ObsConnection?
        var waiters: [Int: CheckedContinuation<ObsConnection, any Error>] = [:]
        var observers: [Int: AsyncStream<ConnectionState>.Continuation] = [:]
        var nextToken = 0
        var task: Task<Void, Never>?
    }

    let path: String
    /// The writes made on the session's connections, for its mirrors.
    let localWrites = LocalWriteFanOut()
    private let backoff: Backoff
    private let group: any EventLoopGroup
    private let limits: FlowControl.Limits
    private let locked = Locked(State())

    init(path: String, backoff: Backoff, group: any EventLoopGroup, limits: FlowControl.Limits) {
        self.path = path
        self.backoff = backoff
        self.group = group
        self.limits = limits
        let task = Task { [self] in await self.maintain() }
        locked.withLock { $0.task = task }
    }

    var state: ConnectionState { locked.withLock { $0.phase } }
    var client: ObsConnection? { locked.withLock { $0.client } }

    func states() -> AsyncStream<ConnectionState> {
        let (stream, continuation) = AsyncStream.makeStream(of: ConnectionState.self)
        let token: Int? = locked.withLock { s in
            continuation.yield(s.phase)
            guard s.phase != .closed else { return nil }
            s.nextToken += 1
            s.observers[s.nextToken] = continuation
            return s.nextToken
        }
        guard let token else {
            continuation.finish()
            return stream
        }
        continuation.onTermination = { [weak self] _ in
            _ = self?.locked.withLock { $0.observers.removeValue(forKey: token) }
        }
        return stream
    }

    func client() async throws(ObsClientError) -> ObsConnection {
        let token = locked.withLock { s in
            s.nextToken += 1
            return s.nextToken
        }
        do {
            return try await withTaskCancellationHandler {
                try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<ObsConnection, any Error>) in
                    let immediate: Result<ObsConnection, ObsClientError>? = locked.withLock { s in
                        if s.phase == .closed { return .failure(.sessionClosed) }
                        if Task.isCancelled { return .failure(.cancelled) }
                        if let client = s.client, client.isConnected { return .success(client) }
                        s.waiters[token] = continuation
                        return nil
                    }
                    if let immediate { continuation.resume(with: immediate) }
                }
            } onCancel: {
                locked.withLock { $0.waiters.removeValue(forKey: token) }?.resume(throwing: ObsClientError.cancelled)
            }
        } catch let error as ObsClientError {
            throw error
        } catch {
            throw .cancelled
        }
    }

    func close() {
        let (task, client, waiters, observers) = locked.withLock { s in
            s.phase = .closed
            defer { s.waiters = [:]; s.observers = [:] }
            return (s.task, s.client, s.waiters.values, s.observers.values)
        }
        task?.cancel()
        client?.closeSoon()
        for waiter in waiters { waiter.resume(throwing: ObsClientError.sessionClosed) }
        for observer in observers {
            observer.yield(.closed)
            observer.finish()
        }
    }

    /// Connects, waits for the connection to end, backs off, and again, until closed.
    ///
    /// The backoff grows with every attempt that did not give a usable connection, and starts
    /// again only once the daemon answered on one: a daemon that accepts and closes at once,
    /// or refuses the connection (`overloaded` at its connection limit), is retried ever
    /// more slowly, not in a storm. The state published says why the last connection ended.
    private func maintain() async {
        var failures = 0
        while !Task.isCancelled {
            publish(.connecting)
            let reason: ObsClientError
            do throws(ObsClientError) {
                let client = try await admittedConnection()
                failures = 0
                guard connected(client) else {
                    await client.close()
                    return
                }
                await client.waitUntilClosed()
                locked.withLock { $0.client = nil }
                reason = client.endReason
            } catch {
                reason = error
            }
            let delay = backoff.delay(after: failures)
            failures += 1
            publish(.waiting(retryIn: delay, reason: reason.description))
            do { try await Task.sleep(for: delay) } catch { return }
        }
    }

    /// A new connection on which the daemon answered `hello`: one it accepted only to refuse
    /// it, or closed before answering, is a failed attempt (thrown with its reason), and is
    /// never handed to a call or a watch.
    private func admittedConnection() async throws(ObsClientError) -> ObsConnection {
        let client = try await ObsConnection.connect(socketPath: path, eventLoopGroup: group, localWrites: localWrites, limits: limits)
        let refusal: ObsClientError? = await withTaskCancellationHandler {
            do throws(ObsClientError) {
                _ = try await client.hello()
                return nil
            } catch {
                return error
            }
        } onCancel: {
            client.closeSoon()  // the session was closed while the daemon had not answered
        }
        if let refusal {
            await client.close()
            throw refusal
        }
        return client
    }

    /// Installs a new connection and hands it to the waiting calls; false once closed.
    private func connected(_ client: ObsConnection) -> Bool {
        let waiters: [CheckedContinuation<ObsConnection, any Error>]? = locked.withLock { s in
            guard s.phase != .closed else { return nil }
            s.client = client
            defer { s.waiters = [:] }
            return Array(s.waiters.values)
        }
        guard let waiters else { return false }
        publish(.connected)
        for waiter in waiters { waiter.resume(returning: client) }
        return true
    }

    private func publish(_ phase: ConnectionState) {
        locked.withLock { s in
            guard s.phase != .closed, s.phase != phase else { return }
            s.phase = phase
            for observer in s.observers.values { observer.yield(phase) }
        }
    }
}
