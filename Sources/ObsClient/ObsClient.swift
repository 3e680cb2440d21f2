// ObsClient — the client: one connection to obsd, every operation as an async call.
//
// Calls may be made concurrently from any task; they are pipelined on the one
// connection and each gets its own reply.

import NIOCore
import NIOPosix
import ObsProtocol
import ObservableKit

/// A connection to obsd.
///
/// Close it with `close()`. A client that is dropped without closing closes its connection
/// (its subscriptions end with `connectionClosed`); a subscription being iterated keeps its
/// client alive.
///
/// ```swift
/// let client = try await ObsClient.connect()            // flag > OBSD_SOCKET > default path
/// try await client.set("ui", "theme", "dark")
/// let sub = try await client.subscribe("ui", .keys(["theme"]), initial: true)
/// for try await event in sub { print(event) }
/// ```
public final class ObsClient: Sendable {
    /// The socket this client is connected to.
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
    /// - Parameter socketPath: the socket; `nil` resolves it as the contract says
    ///   (`OBSD_SOCKET`, then `$XDG_RUNTIME_DIR/obsd.sock`, then `/run/obsd/obsd.sock`).
    public static func connect(
        socketPath: String? = nil,
        eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton
    ) async throws(ObsClientError) -> ObsClient {
        try await connect(socketPath: socketPath, eventLoopGroup: eventLoopGroup, localWrites: nil)
    }

    /// Connects; writes that change something are reported to `localWrites`; unconsumed
    /// events are bounded by `limits`.
    static func connect(
        socketPath: String?, eventLoopGroup: any EventLoopGroup, localWrites: LocalWriteFanOut?,
        limits: FlowControl.Limits = .standard
    ) async throws(ObsClientError) -> ObsClient {
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
            return ObsClient(socketPath: path, channel: channel, flow: flow, fate: fate, ids: ids, localWrites: localWrites)
        } catch {
            throw .cannotConnect(path: path, reason: Self.explain(error))
        }
    }

    /// Connects, runs `body`, and closes the connection, whatever `body` does.
    public static func withConnection<R: Sendable>(
        socketPath: String? = nil, isolation: isolated (any Actor)? = #isolation, _ body: (ObsClient) async throws -> R
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

    /// The events handed to live subscriptions and not consumed yet (see FlowControl).
    var bufferedEvents: Int { flow.bufferedCount }

    /// Why the connection ended (what a call made now fails with): the daemon's refusal, a
    /// protocol violation, or `connectionClosed`.
    var endReason: ObsClientError { fate.error(path: socketPath) }

    // MARK: Operations

    /// Greets the daemon; returns its protocol version, name and maximum line length.
    public func hello(client name: String? = nil) async throws(ObsClientError) -> ServerInfo {
        try await call(.hello(protocol: ObsProtocolVersion.current, client: name), as: HelloReply.self)
    }

    /// Checks the connection.
    public func ping() async throws(ObsClientError) {
        _ = try await call(.ping, as: EmptyReply.self)
    }

    /// The value and revision of a key, or `nil` if it does not exist.
    public func get(_ repo: String, _ key: Key) async throws(ObsClientError) -> Entry<JSONValue>? {
        do throws(ObsClientError) {
            let reply = try await call(.get(repo: repo, key: key), as: GetReply<JSONValue>.self)
            return Entry(value: reply.value, revision: reply.revision)
        } catch .server(let e) where e.code == .notFound {
            return nil
        }
    }

    /// Sets a key. An equal value is not a change unless `force`; `ifRev` makes it a
    /// compare-and-set (0: the key must not exist), failing with `conflict`.
    @discardableResult
    public func set(
        _ repo: String, _ key: Key, _ value: JSONValue, ifRev: UInt64? = nil, force: Bool = false
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        let command = Command.set(repo: repo, key: key, value: CanonicalJSON(value), ifRev: ifRev, force: force)
        return try await call(command, as: WriteReply<JSONValue>.self, purpose: reporting(repo, [.init(key: key, new: value)]))
    }

    /// Deletes a key; deleting an absent key is not an error (`changed: false`).
    @discardableResult
    public func delete(_ repo: String, _ key: Key, ifRev: UInt64? = nil) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await call(
            .delete(repo: repo, key: key, ifRev: ifRev), as: WriteReply<JSONValue>.self, purpose: reporting(repo, [.init(key: key, new: nil)]))
    }

    /// Applies writes atomically, as one revision.
    @discardableResult
    public func batch(_ repo: String, _ ops: [WriteOp<JSONValue>]) async throws(ObsClientError) -> BatchReply {
        let canonical = ops.map { op -> WriteOp<CanonicalJSON> in
            switch op {
            case .set(let key, let value, let ifRev, let force): return .set(key, CanonicalJSON(value), ifRevision: ifRev, force: force)
            case .delete(let key, let ifRev): return .delete(key, ifRevision: ifRev)
            }
        }
        let effects = ops.map { op -> LocalWrite.Effect in
            switch op {
            case .set(let key, let value, _, _): return .init(key: key, new: value)
            case .delete(let key, _): return .init(key: key, new: nil)
            }
        }
        return try await call(.batch(repo: repo, ops: canonical), as: BatchReply.self, purpose: reporting(repo, effects))
    }

    /// The keys of a repository (optionally with a prefix), in byte order, and optionally their values.
    public func list(_ repo: String, prefix: String? = nil, values: Bool = false) async throws(ObsClientError) -> Listing {
        try await call(.list(repo: repo, prefix: prefix, values: values), as: ListReply<JSONValue>.self)
    }

    /// The repositories that exist, sorted by name.
    public func repos() async throws(ObsClientError) -> [RepositoryInfo] {
        try await call(.repos, as: ReposReply.self).repositories
    }

    /// The daemon's counters.
    public func stats() async throws(ObsClientError) -> JSONObject {
        try await call(.stats)
    }

    /// Subscribes to the keys `selection` includes.
    ///
    /// - Parameters:
    ///   - initial: first deliver a `snapshot` of the selected keys.
    ///   - since: first replay every selected change above this revision, then `synced`.
    ///     Fails with `compacted` if the daemon's history no longer reaches back that far.
    ///   - epoch: with `since`, the epoch revision `since` belongs to (`Subscription.epoch`
    ///     of the subscription being resumed); another epoch fails with `compacted`.
    ///   - once: end after the first `change`.
    ///   - options: `coalesce` (state rather than every change while this client lags),
    ///     `writers` (events carry `by`), `echo: false` (no events for this connection's
    ///     own writes); see `SubscriptionOptions`.
    /// - Returns: the subscription, an async sequence of its events. Iterating it ends
    ///   after `cancel()`, after a `once` change, or throws when the connection ends.
    /// - Throws: `bad_request` without asking the daemon for `once` with `coalesce`.
    public func subscribe(
        _ repo: String, _ selection: Selection = .all, initial: Bool = false, since: UInt64? = nil, epoch: String? = nil,
        once: Bool = false, options: SubscriptionOptions = .default
    ) async throws(ObsClientError) -> Subscription {
        if once && options.coalesce {
            throw .server(
                ProtocolError(.badRequest, "\"coalesce\" and \"once\" cannot be used together: a once subscription has nothing to coalesce"))
        }
        let (events, continuation) = AsyncThrowingStream.makeStream(of: SubscriptionEvent.self, throwing: (any Error).self)
        let stream = SubscriptionStream(continuation: continuation, once: once, flow: flow)
        let request = SubscribeRequest(
            repo: repo, selection: selection, initial: initial, since: since, epoch: epoch, once: once, coalesce: options.coalesce,
            writers: options.writers, echo: options.echo)
        let reply = try await call(.subscribe(request), as: SubscribeReply.self, purpose: .subscribe(stream, since: since, initial: initial))
        let sub = reply.subscription
        stream.setOnCancel { [weak self] in self?.sendUnsubscribe(sub) }
        return Subscription(
            id: sub, repository: repo, revision: reply.revision, epoch: reply.epoch, options: options, events: events, stream: stream,
            client: self)
    }

    /// Ends a subscription. Its sequence finishes; no event follows.
    public func unsubscribe(_ sub: UInt64) async throws(ObsClientError) {
        _ = try await call(.unsubscribe(sub: sub), as: EmptyReply.self, purpose: .unsubscribe(sub))
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

    /// Sends `command`; its reply read as `R`.
    private func call<R: ReplyMessage>(
        _ command: Command, as type: R.Type, purpose: OutboundRequest.Purpose = .plain
    ) async throws(ObsClientError) -> R {
        let members = try await call(command, purpose: purpose)
        do {
            return try R(decoding: members)
        } catch {
            throw .protocolViolation(error.description)
        }
    }

    private func call(_ command: Command, purpose: OutboundRequest.Purpose = .plain) async throws(ObsClientError) -> JSONObject {
        let promise = channel.eventLoop.makePromise(of: JSONObject.self)
        send(command, promise: promise, purpose: purpose)
        do {
            return try await promise.futureResult.get()
        } catch let error as ObsClientError {
            throw error
        } catch {
            throw .connectionClosed(path: socketPath)
        }
    }

    private func send(_ command: Command, promise: EventLoopPromise<JSONObject>, purpose: OutboundRequest.Purpose) {
        let request = OutboundRequest(command, id: ids.next(), allocator: channel.allocator, reply: promise, purpose: purpose)
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

/// A live subscription: an async sequence of its events.
public struct Subscription: AsyncSequence, Sendable {
    public typealias Element = SubscriptionEvent

    /// The subscription number on its connection.
    public let id: UInt64
    public let repository: String
    /// The repository revision when the subscription began.
    public let revision: UInt64
    /// The history its revisions belong to: resume with `since` and this epoch.
    public let epoch: String
    /// The options it was made with.
    public let options: SubscriptionOptions
    /// The serial number of the connection it is on.
    var connection: UInt64 { client.serial }
    private let events: AsyncThrowingStream<SubscriptionEvent, any Error>
    private let stream: SubscriptionStream
    private let client: ObsClient

    init(
        id: UInt64, repository: String, revision: UInt64, epoch: String, options: SubscriptionOptions,
        events: AsyncThrowingStream<SubscriptionEvent, any Error>, stream: SubscriptionStream, client: ObsClient
    ) {
        self.id = id
        self.repository = repository
        self.revision = revision
        self.epoch = epoch
        self.options = options
        self.events = events
        self.stream = stream
        self.client = client
    }

    /// Unsubscribes. The sequence finishes after the events that preceded the reply.
    public func cancel() async throws(ObsClientError) {
        try await client.unsubscribe(id)
    }

    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(base: events.makeAsyncIterator(), stream: stream, client: client)
    }

    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncThrowingStream<SubscriptionEvent, any Error>.AsyncIterator
        let stream: SubscriptionStream
        /// Keeps the connection open while the subscription is iterated.
        let client: ObsClient

        public mutating func next() async throws -> SubscriptionEvent? {
            let event = try await base.next()
            if event != nil { stream.consumed() }
            return event
        }
    }
}
