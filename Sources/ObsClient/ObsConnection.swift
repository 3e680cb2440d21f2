// ObsClient — one connection to obsd: every operation as an async call.
//
// Calls may be made concurrently from any task; they are pipelined on the one
// connection and each gets its own reply. The calls read as Swift, not as the wire:
// `set(_:to:in:)`, `ifRevision`, `apply(_:in:)`, `statistics()` (Deprecated.swift keeps
// the earlier spellings for one release).

import NIOCore
import NIOPosix
import ObsProtocol
import ObservableKit

/// A connection to obsd.
///
/// Close it with ``close()``. A connection that is dropped without closing closes itself
/// (its subscriptions end with `connectionClosed`); a subscription being iterated keeps its
/// connection alive. For a connection that comes back after the daemon restarts, use
/// ``ObsSession``.
///
/// ```swift
/// let connection = try await ObsConnection.connect()     // OBSD_SOCKET, then the default path
/// try await connection.set("theme", to: "dark", in: "ui")
/// let subscription = try await connection.subscribe(to: "ui", selecting: .keys(["theme"]), initial: true)
/// for try await event in subscription { print(event) }
/// ```
public final class ObsConnection: Sendable {
    /// The socket this connection is connected to.
    public let socketPath: String
    /// This connection's number in the process, increasing in the order of connecting.
    let serial = ConnectionSerial.next()
    private let channel: any Channel
    private let flow: FlowControl
    private let fate: ConnectionFate
    private let ids: RequestIDs
    /// Where writes that changed something are reported (a session's mirrors), if anywhere.
    private let localWrites: LocalWriteFanOut?

    private init(
        socketPath: String, channel: any Channel, flow: FlowControl, fate: ConnectionFate, ids: RequestIDs, localWrites: LocalWriteFanOut?
    ) {
        self.socketPath = socketPath
        self.channel = channel
        self.flow = flow
        self.fate = fate
        self.ids = ids
        self.localWrites = localWrites
    }

    deinit {
        // Nothing can use the connection any more: give it back. (Not once it is closed — its
        // event loop group may be shut down by now.)
        if channel.isActive { channel.close(promise: nil) }
    }

    /// Connects to the daemon.
    ///
    /// - Parameters:
    ///   - socketPath: the socket; `nil` resolves it as the contract says (`OBSD_SOCKET`,
    ///     then `$XDG_RUNTIME_DIR/obsd.sock`, then `/run/obsd/obsd.sock`).
    ///   - eventLoopGroup: the SwiftNIO event loops the connection runs on.
    public static func connect(
        socketPath: String? = nil,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton
    ) async throws(ObsClientError) -> ObsConnection {
        try await connect(socketPath: socketPath, eventLoopGroup: eventLoopGroup, localWrites: nil)
    }

    /// Connects; writes that change something are reported to `localWrites`; unconsumed
    /// events are bounded by `limits`.
    static func connect(
        socketPath: String?, eventLoopGroup: any EventLoopGroup, localWrites: LocalWriteFanOut?,
        limits: FlowControl.Limits = .standard
    ) async throws(ObsClientError) -> ObsConnection {
        let path = SocketPath.resolve(explicit: socketPath, environment: ProcessEnvironment.current)
        let flow = FlowControl(limits: limits)
        let fate = ConnectionFate()
        let ids = RequestIDs()
        do {
            let channel = try await ClientBootstrap(group: eventLoopGroup)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(ClientHandler(path: path, flow: flow, fate: fate, ids: ids))
                    }
                }
                .connect(unixDomainSocketPath: path).get()
            flow.attach(channel)
            return ObsConnection(socketPath: path, channel: channel, flow: flow, fate: fate, ids: ids, localWrites: localWrites)
        } catch {
            throw .cannotConnect(path: path, reason: Self.explain(error))
        }
    }

    /// Connects, runs `body`, and closes the connection, whatever `body` does.
    public static func withConnection<R: Sendable>(
        socketPath: String? = nil, isolation: isolated (any Actor)? = #isolation, _ body: (ObsConnection) async throws -> R
    ) async throws -> R {
        let client = try await connect(socketPath: socketPath)
        do {
            let result = try await body(client)
            await client.close()
            return result
        } catch {
            await client.close()
            throw error
        }
    }

    /// Closes the connection. Live subscriptions end with `connectionClosed`.
    public func close() async {
        try? await channel.close()
    }

    /// Starts closing without waiting (for `deinit`s and other synchronous contexts).
    func closeSoon() {
        channel.close(promise: nil)
    }

    /// Whether the connection is open and usable (not ending after an overflow or a refusal).
    public var isConnected: Bool { channel.isActive && fate.current == nil }

    /// Returns once the connection has closed, for whatever reason.
    public func waitUntilClosed() async {
        try? await channel.closeFuture.get()
    }

    /// Calls `action` once the connection has closed (at once if it has), on its event loop.
    func whenClosed(_ action: @escaping @Sendable () -> Void) {
        channel.closeFuture.whenComplete { _ in action() }
    }

    /// The events handed to live subscriptions and not consumed yet (see FlowControl).
    var bufferedEvents: Int { flow.bufferedCount }

    /// Why the connection ended (what a call made now fails with): the daemon's refusal, a
    /// protocol violation, or `connectionClosed`.
    var endReason: ObsClientError { fate.error(path: socketPath) }

    // MARK: Operations

    /// Greets the daemon; returns its protocol version, name and maximum line length.
    public func hello(client name: String? = nil) async throws(ObsClientError) -> HelloReply {
        try await call(.hello(protocol: ObsProtocolVersion.current, client: name), as: HelloReply.self)
    }

    /// Checks the connection.
    public func ping() async throws(ObsClientError) {
        _ = try await call(.ping, as: EmptyReply.self)
    }

    /// The value of `key` in `repository` and the revision that last changed it; nil if
    /// the key does not exist.
    public func get(_ key: Key, in repository: String) async throws(ObsClientError) -> Entry<JSONValue>? {
        do throws(ObsClientError) {
            let reply = try await call(.get(repo: repository, key: key), as: GetReply<JSONValue>.self)
            return Entry(value: reply.value, revision: reply.revision)
        } catch where error.code == .notFound {
            return nil
        }
    }

    /// Sets `key` in `repository` to `value`.
    ///
    /// A value equal to the current one changes nothing (`changed: false`, no event) unless
    /// `force`. With `ifRevision`, the write is a compare-and-set on the key's revision (0:
    /// the key must not exist), failing with `conflict`.
    ///
    /// With `lease`, the key is attached to that lease and deleted when it ends (see
    /// ``Lease``); without, it is attached to none — the last `set` of a key decides, even one
    /// that changes no value. A lease that has ended fails with `notFound`, another user's
    /// with `forbidden`, and nothing is written.
    @discardableResult
    public func set(
        _ key: Key, to value: JSONValue, in repository: String, ifRevision: UInt64? = nil, force: Bool = false,
        lease: Lease.ID? = nil
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        let command = Command.set(repo: repository, key: key, value: CanonicalJSON(value), ifRev: ifRevision, force: force)
        return try await call(
            command, leases: lease.map { [key: $0.rawValue] } ?? [:], as: WriteReply<JSONValue>.self,
            purpose: reporting(repository, [.init(key: key, new: value)]))
    }

    /// Deletes `key` from `repository`; deleting an absent key is not an error
    /// (`changed: false`). With `ifRevision`, only if the key's revision is still that.
    @discardableResult
    public func delete(_ key: Key, in repository: String, ifRevision: UInt64? = nil) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await call(
            .delete(repo: repository, key: key, ifRev: ifRevision), as: WriteReply<JSONValue>.self,
            purpose: reporting(repository, [.init(key: key, new: nil)]))
    }

    /// Applies `operations` to `repository` atomically, as one revision: all of them or,
    /// if an `ifRevision` fails (`conflict`), none.
    @discardableResult
    public func apply(_ operations: [WriteOp<JSONValue>], in repository: String) async throws(ObsClientError) -> BatchReply {
        let canonical = operations.map { op -> WriteOp<CanonicalJSON> in
            switch op {
            case .set(let key, let value, let ifRevision, let force): return .set(key, CanonicalJSON(value), ifRevision: ifRevision, force: force)
            case .delete(let key, let ifRevision): return .delete(key, ifRevision: ifRevision)
            }
        }
        let effects = operations.map { op -> LocalWrite.Effect in
            switch op {
            case .set(let key, let value, _, _): return .init(key: key, new: value)
            case .delete(let key, _): return .init(key: key, new: nil)
            }
        }
        return try await call(.batch(repo: repository, ops: canonical), as: BatchReply.self, purpose: reporting(repository, effects))
    }

    /// The keys of `repository` (those starting with `prefix`, if given) in byte order, with
    /// their values when `includingValues`.
    public func list(_ repository: String, prefix: String? = nil, includingValues: Bool = false) async throws(ObsClientError) -> ListReply<JSONValue> {
        try await call(.list(repo: repository, prefix: prefix, values: includingValues), as: ListReply<JSONValue>.self)
    }

    /// The repositories that exist (those this peer may read), sorted by name.
    public func repositories() async throws(ObsClientError) -> [RepositoryInfo] {
        try await call(.repos, as: ReposReply.self).repositories
    }

    /// The daemon's counters (the daemon's totals only for a privileged peer).
    public func statistics() async throws(ObsClientError) -> Stats {
        try await call(.stats, as: Stats.self)
    }

    /// Subscribes to the keys of `repository` that `selection` includes.
    ///
    /// - Parameters:
    ///   - repository: the repository.
    ///   - selection: the keys: some, a prefix, or all of them.
    ///   - initial: first deliver a `snapshot` of the selected keys.
    ///   - since: first replay every selected change above this revision, then `synced`.
    ///     Fails with `compacted` if the daemon's history no longer reaches back that far
    ///     (unless `catchUp`).
    ///   - epoch: with `since`, the epoch revision `since` belongs to (the ``Subscription/epoch``
    ///     of the subscription being resumed); another epoch fails with `compacted` (unless
    ///     `catchUp`).
    ///   - catchUp: with `since`: never fail with `compacted`. Past the daemon's history the
    ///     subscription starts with one ``SubscriptionEvent/catchUp(_:)`` (the keys that
    ///     changed, as they are now); from another history, or when the daemon no longer
    ///     knows the deletions since, with a ``SubscriptionEvent/snapshot(revision:values:)``
    ///     that replaces everything held; ``Subscription/catchUp`` says which. A daemon
    ///     without catch-up ignores it and may still fail with `compacted`.
    ///   - once: end after the first `change`.
    ///   - options: `coalesce` (state rather than every change while this client lags),
    ///     `writers` (events carry `by`), `echo: false` (no events for this connection's
    ///     own writes); see ``SubscriptionOptions``.
    /// - Returns: the subscription, an async sequence of its events. Iterating it ends
    ///   after ``Subscription/cancel()``, after a `once` change, or throws when the
    ///   connection ends.
    /// - Throws: `badRequest` without asking the daemon for `once` with `coalesce`, for
    ///   `catchUp` without `since`, and for `catchUp` with `once`.
    public func subscribe(
        to repository: String, selecting selection: Selection = .all, initial: Bool = false, since: UInt64? = nil,
        epoch: String? = nil, catchUp: Bool = false, once: Bool = false, options: SubscriptionOptions = .default
    ) async throws(ObsClientError) -> Subscription {
        try await subscribe(
            to: repository, selecting: selection, initial: initial, since: since, epoch: epoch, catchUp: catchUp, once: once,
            options: options, progress: false)
    }

    /// Subscribes; with `progress`, the subscription asks for `progress` events and its stream
    /// carries them as items (a `Watch` resumes from them).
    func subscribe(
        to repository: String, selecting selection: Selection, initial: Bool, since: UInt64?, epoch: String?, catchUp: Bool = false,
        once: Bool, options: SubscriptionOptions, progress: Bool
    ) async throws(ObsClientError) -> Subscription {
        if once && options.coalesce {
            throw .server(
                ProtocolError(.badRequest, "\"coalesce\" and \"once\" cannot be used together: a once subscription has nothing to coalesce"))
        }
        if catchUp && since == nil {
            throw .server(ProtocolError(.badRequest, "\"catchup\" goes with \"since\": it says how to resume after that revision"))
        }
        if catchUp && once {
            throw .server(
                ProtocolError(.badRequest, "\"catchup\" and \"once\" cannot be used together: a once subscription ends at its first change, and a catch-up is not one"))
        }
        let (events, continuation) = AsyncThrowingStream.makeStream(of: SubscriptionItem.self, throwing: (any Error).self)
        let stream = SubscriptionStream(continuation: continuation, once: once, progress: progress, flow: flow)
        let request = SubscribeRequest(
            repo: repository, selection: selection, initial: initial, since: since, epoch: epoch, once: once, coalesce: options.coalesce,
            writers: options.writers, echo: options.echo, progress: progress, catchup: catchUp)
        let reply = try await call(.subscribe(request), as: SubscribeReply.self, purpose: .subscribe(stream, since: since, initial: initial))
        let sub = reply.subscription
        stream.setOnCancel { [weak self] in self?.sendUnsubscribe(sub) }
        return Subscription(
            id: sub, repository: repository, revision: reply.revision, epoch: reply.epoch, catchUp: catchUp ? reply.catchup : nil,
            options: options, events: events, stream: stream, client: self)
    }

    /// Sends `sync` for subscription `sub` of this connection: the repository's revision R when
    /// the daemon read it, replied after every event of the subscription through R. With
    /// `mark`, the reply's place among the subscription's events is marked in its stream
    /// (`SubscriptionItem.syncMark`); a subscription whose stream ended on this side before the
    /// reply arrived fails with `notFound`, as one the daemon no longer has.
    func sync(_ sub: UInt64, mark: UInt64?) async throws(ObsClientError) -> UInt64 {
        try await call(.sync(sub: sub), as: SyncReply.self, purpose: .sync(sub, mark: mark)).revision
    }

    /// Ends subscription `id`. Its sequence finishes; no event follows.
    public func unsubscribe(_ id: UInt64) async throws(ObsClientError) {
        _ = try await call(.unsubscribe(sub: id), as: EmptyReply.self, purpose: .unsubscribe(id))
    }

    // MARK: Plumbing

    private func sendUnsubscribe(_ sub: UInt64) {
        let promise = channel.eventLoop.makePromise(of: JSONObject.self)
        promise.futureResult.whenComplete { _ in }
        send(.unsubscribe(sub: sub), promise: promise, purpose: .unsubscribe(sub))
    }

    /// The purpose of a write request: report its effects if it changes something.
    private func reporting(_ repo: String, _ effects: [LocalWrite.Effect]) -> OutboundRequest.Purpose {
        guard let localWrites else { return .plain }
        let serial = self.serial
        return .write { members in
            // `rev` and `changed`: what a write and a batch reply have in common.
            guard let reply = try? BatchReply(decoding: members), reply.changed else { return }
            localWrites.publish(LocalWrite(repository: repo, revision: reply.revision, effects: effects, connection: serial))
        }
    }

    /// Sends `command` (its writes attached to `leases`); its reply read as `R`.
    func call<R: ReplyMessage>(
        _ command: Command, leases: [Key: UInt64] = [:], as type: R.Type, purpose: OutboundRequest.Purpose = .plain
    ) async throws(ObsClientError) -> R {
        let members = try await call(command, leases: leases, purpose: purpose)
        do {
            return try R(decoding: members)
        } catch {
            throw .protocolViolation(error.description)
        }
    }

    /// Sends `command`; its reply's members.
    func call(_ command: Command, leases: [Key: UInt64] = [:], purpose: OutboundRequest.Purpose = .plain) async throws(ObsClientError) -> JSONObject {
        let promise = channel.eventLoop.makePromise(of: JSONObject.self)
        send(command, leases: leases, promise: promise, purpose: purpose)
        do {
            return try await promise.futureResult.get()
        } catch let error as ObsClientError {
            throw error
        } catch {
            throw .connectionClosed(path: socketPath)
        }
    }

    private func send(
        _ command: Command, leases: [Key: UInt64] = [:], promise: EventLoopPromise<JSONObject>, purpose: OutboundRequest.Purpose
    ) {
        let request = OutboundRequest(command, id: ids.next(), leases: leases, allocator: channel.allocator, reply: promise, purpose: purpose)
        let (path, fate) = (socketPath, fate)
        channel.writeAndFlush(request).whenFailure { _ in
            promise.fail(fate.error(path: path))  // e.g. refused before this request was sent
        }
    }

    private static func explain(_ error: any Error) -> String {
        if let io = error as? IOError {
            switch io.errnoCode {
            case ENOENT: return "no such file — is obsd running?"
            case ECONNREFUSED: return "connection refused — is obsd running?"
            case EACCES, EPERM: return "permission denied — check the socket's owner and mode"
            case ENOTSOCK: return "not a socket"
            default: return io.description
            }
        }
        return "\(error)"
    }
}
