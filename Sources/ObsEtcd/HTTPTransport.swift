// ObsEtcd: the HTTP/1.1 side of the client — endpoints, one request/response exchange on a
// keep-alive connection (a channel handler that owns the exchange's deadline), and the
// connections kept idle per endpoint for reuse.
//
// One exchange at a time per connection (no pipelining): concurrent calls take concurrent
// connections, and at most `maxIdleConnectionsPerEndpoint` of them are kept afterwards.

import NIOCore
import NIOHTTP1
import NIOPosix
import Synchronization

/// An etcd member's client URL: `http://HOST:PORT` (the scheme may be left out). TLS is not
/// supported: the endpoints are expected on loopback or a private network.
public struct EtcdEndpoint: Sendable, Hashable, CustomStringConvertible {
    /// A host name or IP address (IPv6 without brackets).
    public let host: String
    /// The member's client port.
    public let port: Int

    /// The endpoint at `host`:`port`.
    public init(host: String, port: Int) {
        self.host = host
        self.port = port
    }

    /// Parses `http://HOST:PORT`, `HOST:PORT` or `http://[IPV6]:PORT`.
    public init(url: String) throws {
        var rest = Substring(url)
        if rest.hasPrefix("https://") { throw EtcdError.invalidConfiguration("TLS endpoints are not supported: \(url)") }
        if rest.hasPrefix("http://") { rest = rest.dropFirst("http://".count) }
        while rest.hasSuffix("/") { rest = rest.dropLast() }
        guard let colon = rest.lastIndex(of: ":"), let port = Int(rest[rest.index(after: colon)...]), (1...65535).contains(port)
        else { throw EtcdError.invalidConfiguration("not an endpoint URL (http://HOST:PORT): \(url)") }
        var host = rest[..<colon]
        if host.hasPrefix("[") && host.hasSuffix("]") { host = host.dropFirst().dropLast() }
        guard !host.isEmpty else { throw EtcdError.invalidConfiguration("not an endpoint URL (http://HOST:PORT): \(url)") }
        self.host = String(host)
        self.port = port
    }

    /// The endpoint as a URL.
    public var description: String { host.contains(":") ? "http://[\(host)]:\(port)" : "http://\(host):\(port)" }
}

/// How one exchange failed below the level of etcd's answers.
enum TransportFailure: Error, Sendable {
    /// Nothing was sent: the connection could not be made, or was closed before the request.
    case notSent(String)
    /// The connection closed after the request was sent, before the whole answer.
    case lost(String)
    /// The deadline passed (the request was sent).
    case timedOut
    /// The answer was larger than allowed.
    case tooLarge
}

/// A request to etcd's gateway: `POST path` with a JSON body.
struct GatewayRequest: Sendable {
    var path: String
    var body: [UInt8]
    /// Sends `Grpc-Metadata-Hasleader: true`, which the gateway forwards as gRPC metadata
    /// `hasleader: true`: a member that knows no leader refuses at once ("etcdserver: no
    /// leader", status 503) instead of waiting for its own request timeout.
    var requireLeader: Bool

    func head(endpoint: EtcdEndpoint, chunked: Bool) -> HTTPRequestHead {
        var headers = HTTPHeaders()
        headers.add(name: "Host", value: "\(endpoint.host):\(endpoint.port)")
        headers.add(name: "Content-Type", value: "application/json")
        if chunked {
            headers.add(name: "Transfer-Encoding", value: "chunked")
        } else {
            headers.add(name: "Content-Length", value: String(body.count))
        }
        if requireLeader { headers.add(name: "Grpc-Metadata-Hasleader", value: "true") }
        return HTTPRequestHead(version: .http1_1, method: .POST, uri: path, headers: headers)
    }
}

/// A complete gateway answer.
struct GatewayAnswer: Sendable {
    var status: Int
    var body: ByteBuffer
    var keepAlive: Bool
}

/// One exchange handed to the connection's handler.
struct UnaryExchange: Sendable {
    var head: HTTPRequestHead
    var body: ByteBuffer
    var deadline: NIODeadline
    var promise: EventLoopPromise<GatewayAnswer>
}

/// Sends one request, collects its answer, and fails the exchange at its deadline (closing the
/// connection, whose late answer could not be told apart from the next one's).
final class UnaryHTTPHandler: ChannelDuplexHandler {
    typealias InboundIn = HTTPClientResponsePart
    typealias OutboundIn = UnaryExchange
    typealias OutboundOut = HTTPClientRequestPart

    private struct Current {
        var promise: EventLoopPromise<GatewayAnswer>
        var status: Int?
        var keepAlive = true
        var body: ByteBuffer?
        var timeout: Scheduled<Void>?
    }

    private let maxAnswerBytes: Int
    private var current: Current?

    init(maxAnswerBytes: Int) { self.maxAnswerBytes = maxAnswerBytes }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let exchange = unwrapOutboundIn(data)
        guard current == nil else {
            exchange.promise.fail(TransportFailure.notSent("connection busy"))
            promise?.fail(TransportFailure.notSent("connection busy"))
            return
        }
        let loopBoundContext = NIOLoopBound(context, eventLoop: context.eventLoop)
        let timeout = context.eventLoop.assumeIsolated().scheduleTask(deadline: exchange.deadline) { [weak self] () -> Void in
            self?.finish(.failure(TransportFailure.timedOut), close: loopBoundContext.value)
        }
        current = Current(promise: exchange.promise, timeout: timeout)
        context.write(wrapOutboundOut(.head(exchange.head)), promise: nil)
        context.write(wrapOutboundOut(.body(.byteBuffer(exchange.body))), promise: nil)
        context.writeAndFlush(wrapOutboundOut(.end(nil)), promise: promise)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard current != nil else { return }  // an answer after a timeout: the channel is closing
        switch unwrapInboundIn(data) {
        case .head(let head):
            current?.status = Int(head.status.code)
            current?.keepAlive = head.isKeepAlive
        case .body(var part):
            if current?.body == nil {
                current?.body = part
            } else {
                current?.body?.writeBuffer(&part)
            }
            if (current?.body?.readableBytes ?? 0) > maxAnswerBytes {
                finish(.failure(TransportFailure.tooLarge), close: context)
            }
        case .end:
            guard let c = current, let status = c.status else {
                finish(.failure(TransportFailure.lost("an answer without a head")), close: context)
                return
            }
            finish(.success(GatewayAnswer(status: status, body: c.body ?? ByteBuffer(), keepAlive: c.keepAlive)), close: c.keepAlive ? nil : context)
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        finish(.failure(TransportFailure.lost("connection closed")), close: nil)
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        finish(.failure(TransportFailure.lost("\(error)")), close: context)
    }

    private func finish(_ result: Result<GatewayAnswer, any Error>, close context: ChannelHandlerContext?) {
        guard let c = current else { return }
        current = nil
        c.timeout?.cancel()
        c.promise.completeWith(result)
        if let context { context.close(promise: nil) }
    }
}

/// The connections of one client: kept idle per endpoint, opened on demand.
final class ConnectionPool: Sendable {
    let endpoints: [EtcdEndpoint]
    private let group: any EventLoopGroup
    private let maxIdle: Int
    private let maxAnswerBytes: Int
    private let idle: Mutex<(closed: Bool, channels: [[any Channel]])>

    init(endpoints: [EtcdEndpoint], group: any EventLoopGroup, maxIdle: Int, maxAnswerBytes: Int) {
        self.endpoints = endpoints
        self.group = group
        self.maxIdle = maxIdle
        self.maxAnswerBytes = maxAnswerBytes
        self.idle = Mutex((false, Array(repeating: [], count: endpoints.count)))
    }

    deinit {
        for channels in idle.withLock({ $0.channels }) { for channel in channels { channel.close(promise: nil) } }
    }

    /// Closes every idle connection; connections in use close when their exchange ends.
    func close() async {
        let channels = idle.withLock { state in
            state.closed = true
            defer { state.channels = Array(repeating: [], count: endpoints.count) }
            return state.channels.flatMap { $0 }
        }
        for channel in channels { try? await channel.close() }
    }

    /// One exchange with endpoint `index`: an idle connection if there is a live one, else a
    /// new one. Throws `TransportFailure` (or `CancellationError`-free: cancellation closes the
    /// connection and reports `.lost`).
    func exchange(_ request: GatewayRequest, endpoint index: Int, deadline: NIODeadline, connectTimeout: TimeAmount) async throws
        -> GatewayAnswer
    {
        let channel = try await checkout(index, deadline: deadline, connectTimeout: connectTimeout)
        let endpoint = endpoints[index]
        let promise = channel.eventLoop.makePromise(of: GatewayAnswer.self)
        var body = channel.allocator.buffer(capacity: request.body.count)
        body.writeBytes(request.body)
        let exchange = UnaryExchange(
            head: request.head(endpoint: endpoint, chunked: false), body: body, deadline: deadline, promise: promise)
        channel.writeAndFlush(exchange).whenFailure { error in
            // Closed before the request reached the socket: nothing was sent.
            promise.fail(TransportFailure.notSent("\(error)"))
        }
        let answer = try await withTaskCancellationHandler {
            try await promise.futureResult.get()
        } onCancel: {
            channel.close(promise: nil)
        }
        if answer.keepAlive { checkin(channel, index) } else { channel.close(promise: nil) }
        return answer
    }

    private func checkout(_ index: Int, deadline: NIODeadline, connectTimeout: TimeAmount) async throws -> any Channel {
        while let channel = idle.withLock({ $0.channels[index].popLast() }) {
            if channel.isActive { return channel }
            channel.close(promise: nil)
        }
        let endpoint = endpoints[index]
        let remaining = deadline - .now()
        guard remaining > .zero else { throw TransportFailure.notSent("deadline passed before connecting") }
        let maxAnswerBytes = self.maxAnswerBytes
        do {
            return try await ClientBootstrap(group: group)
                .connectTimeout(min(connectTimeout, remaining))
                .channelOption(.socketOption(.tcp_nodelay), value: 1)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHTTPClientHandlers()
                        try channel.pipeline.syncOperations.addHandler(UnaryHTTPHandler(maxAnswerBytes: maxAnswerBytes))
                    }
                }
                .connect(host: endpoint.host, port: endpoint.port).get()
        } catch {
            throw TransportFailure.notSent("cannot connect to \(endpoint): \(error)")
        }
    }

    private func checkin(_ channel: any Channel, _ index: Int) {
        let keep = idle.withLock { state in
            guard !state.closed, state.channels[index].count < maxIdle else { return false }
            state.channels[index].append(channel)
            return true
        }
        if !keep { channel.close(promise: nil) }
    }

    /// A new connection to endpoint `index` for a stream, with `handler` after the HTTP codec.
    func connectStream(
        _ index: Int, connectTimeout: TimeAmount,
        handler: @escaping @Sendable (any Channel) throws -> Void
    ) async throws -> any Channel {
        let endpoint = endpoints[index]
        do {
            return try await ClientBootstrap(group: group)
                .connectTimeout(connectTimeout)
                .channelOption(.socketOption(.tcp_nodelay), value: 1)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHTTPClientHandlers()
                        try handler(channel)
                    }
                }
                .connect(host: endpoint.host, port: endpoint.port).get()
        } catch {
            throw TransportFailure.notSent("cannot connect to \(endpoint): \(error)")
        }
    }
}

extension Duration {
    /// The same span as NIO's `TimeAmount`.
    var timeAmount: TimeAmount {
        let (seconds, attoseconds) = components
        return .nanoseconds(seconds * 1_000_000_000 + attoseconds / 1_000_000_000)
    }
}
