// ObsEtcd: a watch's stream on the event loop (EtcdWatch.swift has the sequence and its
// iterator, which opens and reopens streams): the channel handler that sends the watch request
// with an open body, frames and decodes the newline-delimited answers, probes a silent
// stream and fails a dead one; and the producer delegate that starts and stops reading the
// socket as the consumer keeps up.

import NIOCore
import NIOHTTP1
import Synchronization

/// Starts and stops reading a watch's socket as its consumer keeps up or falls behind, and
/// closes the stream when the consumer goes away.
final class WatchDelegate: NIOAsyncSequenceProducerDelegate {
    private let handler = Mutex<(NIOLoopBound<WatchStreamHandler>, any EventLoop)?>(nil)

    func attach(_ handler: NIOLoopBound<WatchStreamHandler>, on loop: any EventLoop) {
        self.handler.withLock { $0 = (handler, loop) }
    }

    func produceMore() {
        guard let (handler, loop) = handler.withLock({ $0 }) else { return }
        loop.execute { handler.value.resumeReading() }
    }

    func didTerminate() {
        guard let (handler, loop) = handler.withLock({ $0 }) else { return }
        loop.execute { handler.value.terminate() }
    }
}

/// Sends a watch request with an open (chunked) body, reads the newline-delimited JSON answer,
/// and probes the stream when it is silent.
final class WatchStreamHandler: ChannelDuplexHandler {
    typealias InboundIn = HTTPClientResponsePart
    typealias OutboundIn = HTTPClientRequestPart
    typealias OutboundOut = HTTPClientRequestPart

    struct Probe: Sendable {
        var interval: TimeAmount
        var timeout: TimeAmount
    }

    private let request: GatewayRequest
    private let endpoint: EtcdEndpoint
    private let source: WatchMessages.Source
    private let probe: Probe
    private let progressRequest: [UInt8]

    private var context: ChannelHandlerContext?
    private var status: Int?
    private var informational = false
    private var body = ByteBuffer()
    private var created = false
    private var done = false
    /// The consumer is behind: reads are held back (and silence is not the member's fault).
    private var paused = false
    private var readPending = false
    private var lastHeard = NIODeadline.now()
    private var probeSent: NIODeadline?
    private var timer: RepeatedTask?

    /// The longest line accepted (a response with many events).
    private static let maxLineBytes = 256 << 20

    init(request: GatewayRequest, endpoint: EtcdEndpoint, source: WatchMessages.Source, probe: Probe) {
        self.request = request
        self.endpoint = endpoint
        self.source = source
        self.probe = probe
        var line = Array(#"{"progress_request":{}}"#.utf8)
        line.append(UInt8(ascii: "\n"))
        self.progressRequest = line
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        if context.channel.isActive { start(context) }
    }

    func channelActive(context: ChannelHandlerContext) {
        start(context)
        context.fireChannelActive()
    }

    private func start(_ context: ChannelHandlerContext) {
        guard timer == nil, !done else { return }
        lastHeard = .now()
        var head = request.head(endpoint: endpoint, chunked: true)
        // Measured: without `Expect: 100-continue` etcd 3.4's gateway never answers a watch
        // whose request body stays open (chunked); with it, it answers "100 Continue" and then
        // streams (curl sends it for `-T -` uploads, which is why curl works).
        head.headers.add(name: "Expect", value: "100-continue")
        context.write(wrapOutboundOut(.head(head)), promise: nil)
        context.writeAndFlush(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(bytes: request.body)))), promise: nil)
        let tick = TimeAmount.nanoseconds(max(probe.interval.nanoseconds / 4, 50_000_000))
        // The repeated task holds the handler until it is cancelled (fail, terminate, removal).
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        timer = context.eventLoop.scheduleRepeatedTask(initialDelay: tick, delay: tick) { _ in bound.value.tick() }
    }

    func read(context: ChannelHandlerContext) {
        if paused {
            readPending = true
        } else {
            context.read()
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard !done else { return }
        switch unwrapInboundIn(data) {
        case .head(let head):
            status = Int(head.status.code)
            informational = (100..<200).contains(head.status.code)
        case .body(var part):
            body.writeBuffer(&part)
            if status == 200 {
                drainLines()
            } else if body.readableBytes > 1 << 20 {
                fail(.invalidResponse("an error answer larger than 1 MiB"))
            }
        case .end:
            if informational {  // "100 Continue": the real answer follows
                informational = false
                status = nil
                return
            }
            if status == 200 {
                fail(.connectionLost(outcomeUnknown: false))
            } else {
                let wire = try? WireCoding.decode(WireUnaryError.self, from: body.readableBytesView)
                fail(EtcdError.fromGateway(status: status ?? 0, code: wire?.code, message: wire?.message))
            }
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        fail(.connectionLost(outcomeUnknown: false))
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        fail(.connectionLost(outcomeUnknown: false))
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        timer?.cancel()
        timer = nil
        self.context = nil
    }

    /// The consumer caught up.
    func resumeReading() {
        guard paused else { return }
        paused = false
        lastHeard = .now()
        probeSent = nil
        if readPending, let context {
            readPending = false
            context.read()
        }
    }

    /// The consumer went away.
    func terminate() {
        guard !done else { return }
        done = true
        timer?.cancel()
        context?.close(promise: nil)
    }

    private func drainLines() {
        while !done, let newline = body.readableBytesView.firstIndex(of: UInt8(ascii: "\n")) {
            let length = newline - body.readerIndex
            guard let line = body.readSlice(length: length) else { break }
            body.moveReaderIndex(forwardBy: 1)
            if line.readableBytes > 0 { handle(line) }
        }
        if body.readableBytes > Self.maxLineBytes {
            fail(.invalidResponse("a watch response longer than \(Self.maxLineBytes) bytes"))
        } else if body.readerIndex > 64 << 10 {
            body.discardReadBytes()
        }
    }

    private func handle(_ line: ByteBuffer) {
        lastHeard = .now()
        probeSent = nil
        let decoded: WireWatchLine
        do {
            decoded = try WireCoding.decode(WireWatchLine.self, from: line.readableBytesView)
        } catch let error as EtcdError {
            fail(error)
            return
        } catch {
            fail(.invalidResponse("\(error)"))
            return
        }
        if let error = decoded.error {
            fail(EtcdError.fromGateway(status: error.http_code ?? 0, code: error.grpc_code, message: error.message))
            return
        }
        guard let result = decoded.result else { return }
        if result.canceled == true {
            if let compacted = result.compact_revision, compacted.value > 0 {
                fail(.compacted(compactRevision: compacted.value))
            } else {
                fail(.server(code: -1, message: "watch canceled: \(result.cancel_reason ?? "no reason given")"))
            }
            return
        }
        let revision = result.header?.revision.int64 ?? 0
        let message: WatchMessage
        if result.created == true {
            created = true
            message = .created(revision: revision)
        } else if let events = result.events, !events.isEmpty {
            message = .events(events.map(\.event))
        } else {
            message = .progress(revision: revision)
        }
        if case .stopProducing = source.yield(message) { paused = true }
    }

    private func tick() {
        guard !done, let context else { return }
        let now = NIODeadline.now()
        if paused {
            lastHeard = now
            return
        }
        if let sent = probeSent {
            if now - sent >= probe.timeout {
                fail(.timeout(outcomeUnknown: false))
            }
        } else if !created {
            if now - lastHeard >= probe.interval + probe.timeout { fail(.timeout(outcomeUnknown: false)) }
        } else if now - lastHeard >= probe.interval {
            probeSent = now
            context.writeAndFlush(
                wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(bytes: progressRequest)))), promise: nil)
        }
    }

    private func fail(_ error: EtcdError) {
        guard !done else { return }
        done = true
        timer?.cancel()
        source.finish(error)
        context?.close(promise: nil)
    }
}
