// ObsServer — the channel handler of one client connection.
//
// Frames bytes into lines, hands them to the connection's `Session`, and flushes the
// outbox at the end of each read. Stops reading requests while the outbox is congested
// (a client that does not read its replies is not read either) and resumes when it drains.

import Logging
import NIOCore
import ObsProtocol

final class ConnectionHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let hub: Hub
    private let limits: OutboxLimits
    private let settings: SessionSettings
    private let logger: Logger
    private var framer: LineFramer
    private var session: Session?
    private var context: ChannelHandlerContext?
    /// A read was requested while congested; issue it once the outbox drains.
    private var readPending = false

    init(hub: Hub, limits: OutboxLimits, settings: SessionSettings, logger: Logger) {
        self.hub = hub
        self.limits = limits
        self.settings = settings
        self.logger = logger
        self.framer = LineFramer(maxLine: settings.maxLine)
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        let outbox = Outbox(channel: context.channel, limits: limits, stats: hub.stats) { [weak self] in
            self?.resumeReading()
        }
        session = Session(hub: hub, outbox: outbox, settings: settings, logger: logger)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        endSession()
        self.context = nil
    }

    func channelActive(context: ChannelHandlerContext) {
        hub.stats.connections.add(1, ordering: .relaxed)
        hub.stats.connectionsTotal.add(1, ordering: .relaxed)
        context.fireChannelActive()
    }

    func channelInactive(context: ChannelHandlerContext) {
        hub.stats.connections.subtract(1, ordering: .relaxed)
        endSession()
        context.fireChannelInactive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard let session else { return }
        let buffer = unwrapInboundIn(data)
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                // After an overflow the connection only drains and closes.
                guard session.outbox.isOpen else { return }
                session.handle(frame)
            }
        }
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        session?.outbox.flush()
        context.fireChannelReadComplete()
    }

    func read(context: ChannelHandlerContext) {
        if let outbox = session?.outbox, outbox.isCongested {
            readPending = true
        } else {
            context.read()
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        logger.debug("connection error", metadata: ["error": "\(error)"])
        context.close(promise: nil)
    }

    private func resumeReading() {
        guard readPending, let context else { return }
        readPending = false
        context.read()
    }

    private func endSession() {
        session?.close()
        session = nil
    }
}

@available(*, unavailable)
extension ConnectionHandler: Sendable {}
