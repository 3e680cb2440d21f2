// ObsServer — the channel handler of one client connection.
//
// On connect: reads the peer's credentials (SO_PEERCRED) and asks the hub to admit the
// connection (connection limits); a refused client gets one `overloaded` message and a
// lingering close. Then frames bytes into lines, hands them to the connection's `Session`, and
// flushes the outbox at the end of each read. Stops handling requests — even part-way
// through what one read brought — while the outbox is congested (a client that does not
// read its replies is not read either) and resumes when it drains.
//
// A client that shuts down its sending side (`printf … | socat -`, `nc -N`) has sent its
// last request: everything it sent is handled (a last line without its `\n` too), its
// subscriptions end (it asks for nothing more), and once every reply is written — replies
// that wait for durability included — the daemon closes: the client reads every reply, in
// order, then end of file.
//
// In etcd mode a request can wait for the cluster (`Session.awaitingCluster`), and a write
// can wait for a loop's delivery backlog to go down (`Session.awaitingDelivery`); the
// handler then holds the connection's further input the way it does while congested.

import Logging
import NIOCore
import ObsProtocol

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

final class ConnectionHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let hub: Hub
    private let limits: Limits
    private let settings: SessionSettings
    private let logger: Logger
    /// Reads the peer's credentials: `Peer.of` (SO_PEERCRED); replaced only by in-process tests.
    private let peerOf: @Sendable (any Channel) -> Peer?
    private var framer: LineFramer
    private var outbox: Outbox?
    private var session: Session?
    private var context: ChannelHandlerContext?
    /// A read was requested while congested; issue it once the outbox drains.
    private var readPending = false
    /// Input read but not yet handled because the outbox became congested part-way: at most
    /// one read cycle's bytes, handled once the outbox drains.
    private var held: ByteBuffer?
    /// The client shut down its sending side (end of file with the connection still open).
    private var inputClosed = false
    /// Everything the client sent has been handled since; the connection closes once idle.
    private var inputFinished = false
    /// Shutting down: no more requests are handled.
    private var quiescing = false
    /// Shutting down: completed once everything queued is written.
    private var drained: EventLoopPromise<Void>?

    init(
        hub: Hub, limits: Limits, startTime: ContinuousClock.Instant, logger: Logger,
        peerOf: @escaping @Sendable (any Channel) -> Peer? = Peer.of
    ) {
        self.hub = hub
        self.peerOf = peerOf
        self.limits = limits
        self.settings = SessionSettings(maxLine: limits.maxLine, maxDepth: limits.maxDepth, startTime: startTime)
        self.logger = logger
        self.framer = LineFramer(maxLine: limits.maxLine)
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        let outbox = Outbox(
            shard: hub.shard(for: context.eventLoop),
            limits: OutboxLimits(maxBytes: limits.queueBytes, maxEvents: limits.queueEvents, grace: TimeAmount(limits.overflowGrace)),
            stats: hub.stats, allocator: context.channel.allocator)
        outbox.context = context
        outbox.onProgress = { [weak self] in
            guard let self else { return }
            self.resumeReading()
            self.finishInput()
            self.checkDrained()
        }
        self.outbox = outbox
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        endSession()
        outbox?.context = nil
        outbox?.onProgress = nil
        drained?.succeed(())
        drained = nil
        self.context = nil
    }

    func channelActive(context: ChannelHandlerContext) {
        defer { context.fireChannelActive() }
        guard let outbox, let peer = peerOf(context.channel) else {
            logger.error("cannot read the peer's credentials (SO_PEERCRED); closing the connection")
            return refuse(context, "the daemon could not identify this process")
        }
        let session = Session(hub: hub, outbox: outbox, peer: peer, settings: settings, logger: logger)
        let loop = context.eventLoop
        let bound = NIOLoopBound(session, eventLoop: loop)
        let entry = ConnectedPeer(peer: peer, since: .now, subscriptions: outbox.tally) {
            loop.execute { bound.value.revalidate() }
        }
        if let reason = hub.admit(ObjectIdentifier(self), entry) {
            hub.stats.connectionsRefused.add(1, ordering: .relaxed)
            logger.notice("connection refused: \(reason)", metadata: peer.metadata)
            return refuse(context, reason)
        }
        self.session = session
        logger.debug("connected", metadata: peer.metadata)
    }

    func channelInactive(context: ChannelHandlerContext) {
        endSession()
        context.fireChannelInactive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard session != nil else { return }
        var buffer = unwrapInboundIn(data)
        if held != nil {
            held!.writeBuffer(&buffer)
        } else {
            handle(buffer)
        }
    }

    /// Hands `input` to the session a line at a time, and stops — holding the rest — as soon
    /// as the outbox is congested: one read can carry thousands of pipelined requests, and
    /// a client that sends them without reading must not make the daemon queue every reply.
    private func handle(_ input: ByteBuffer) {
        guard let session, !quiescing else { return }
        var buffer = input
        while buffer.readableBytes > 0 {
            // After an overflow the connection only drains and closes: nothing more is read.
            guard session.outbox.isOpen else {
                held = nil
                return
            }
            if session.outbox.isCongested || session.holdsInput {
                held = buffer
                return
            }
            let consumed = buffer.withUnsafeReadableBytes { bytes -> Int in
                let end = memchr(bytes.baseAddress!, 0x0A, bytes.count).map { UnsafeRawPointer($0) - bytes.baseAddress! + 1 } ?? bytes.count
                framer.feed(UnsafeRawBufferPointer(rebasing: bytes[..<end])) { frame in
                    // After an overflow the connection only drains and closes.
                    guard session.outbox.isOpen else { return }
                    session.handle(frame)
                }
                return end
            }
            buffer.moveReaderIndex(forwardBy: consumed)
        }
        held = nil
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        switch event {
        case let event as ChannelEvent where event == .inputClosed:
            inputClosed = true
            finishInput()
        case ShutdownEvent.quiesce:
            quiescing = true
            held = nil
        case ShutdownEvent.drain(let promise, _):
            drained = promise
            checkDrained()
            return
        default:
            break
        }
        context.fireUserInboundEventTriggered(event)
    }

    /// At shutdown: completes the drain once everything queued is written.
    private func checkDrained() {
        guard let promise = drained else { return }
        guard let outbox = session?.outbox else {
            drained = nil
            return promise.succeed(())
        }
        outbox.whenWritten { [weak self] in
            guard let self, self.drained?.futureResult === promise.futureResult, outbox.isEmpty else { return }
            self.drained = nil
            promise.succeed(())
        }
    }

    /// After the client's end of file: handles what is left of its input, ends its
    /// subscriptions, and closes once the outbox is idle. Runs again after each write until
    /// then; waits while held input is pending (it is handled as the outbox drains).
    private func finishInput() {
        guard inputClosed, held == nil, !quiescing, let context else { return }
        guard let session else {
            context.close(promise: nil)  // a refused connection: its message is out
            return
        }
        if session.holdsInput { return }  // what it waits for resumes this
        if !inputFinished {
            inputFinished = true
            framer.finish { frame in
                if session.outbox.isOpen { session.handle(frame) }
            }
            session.endSubscriptions()
        }
        session.outbox.whenWritten { [weak self] in
            guard let self, let session = self.session, session.outbox.isEmpty else { return }
            context.close(promise: nil)
        }
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        // The socket took what the channel held: hand it more.
        if context.channel.isWritable { outbox?.flush() }
        context.fireChannelWritabilityChanged()
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        // Not a flush right here: a write can fail and close the channel, and NIO goes on
        // to half-close this very channel's input after this callback when the read ended
        // in end of file. The flush runs later in this loop tick, once per tick.
        if let outbox = session?.outbox { outbox.shard.markDirty(outbox) }
        context.fireChannelReadComplete()
    }

    func read(context: ChannelHandlerContext) {
        // After an overflow nothing more is read (the connection closes once drained).
        if inputClosed || quiescing || session?.outbox.isOpen == false { return }
        if held != nil || session?.outbox.isCongested == true || session?.holdsInput == true {
            readPending = true
        } else {
            context.read()
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        logger.debug("connection error", metadata: ["error": "\(error)"])
        context.close(promise: nil)
    }

    /// One error message, then a lingering close: the write side is shut down at once (the
    /// client reads the message, then end of file), and whatever the client sends in the
    /// meantime is read and discarded until it closes, or for a second at most. Closing
    /// with the client's request unread would make the kernel reset the connection, and
    /// the client could lose the message that says why.
    private func refuse(_ context: ChannelHandlerContext, _ reason: String) {
        var buffer = context.channel.allocator.buffer(capacity: 128)
        ReplyEncoder.error(&buffer, id: .null, ProtocolError(.overloaded, reason))
        let channel = context.channel
        context.writeAndFlush(NIOAny(buffer)).whenComplete { _ in
            channel.close(mode: .output).whenFailure { _ in channel.close(promise: nil) }
            channel.eventLoop.scheduleTask(in: .seconds(1)) { channel.close(promise: nil) }
        }
    }

    private func resumeReading() {
        guard let context else { return }
        if let input = held {
            handle(input)
            session?.outbox.flush()
            if held != nil { return }  // congested again: the next drain resumes
        }
        guard readPending, !inputClosed else { return }
        readPending = false
        context.read()
    }

    private func endSession() {
        guard let session else { return }
        session.close()
        hub.leave(ObjectIdentifier(self))
        self.session = nil
    }
}

@available(*, unavailable)
extension ConnectionHandler: Sendable {}
