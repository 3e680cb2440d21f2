// ObsClient — the channel handler of a client connection.
//
// Matches replies to requests (the daemon replies in request order), routes events to
// their subscription's stream, and ends streams exactly as the contract says: after the
// `unsubscribe` reply, after a `once` subscription's change, on `overflow` (with the
// revision to resume from), or when the connection closes. Applies backpressure: when
// the application leaves too many events unconsumed, it stops reading the socket, so a
// slow consumer is handled by the daemon's overflow rule rather than unbounded memory —
// but never while a request waits for its reply: a consumer that awaits a call inside its
// event loop must get the reply (what the daemon queues before it is bounded by the
// daemon's queue limit). After `overflow` the daemon is closing the connection: the client
// closes it at once, so a session reconnects instead of using a dead connection.

import NIOCore
import ObsProtocol
import ObservableKit
import Synchronization

/// A request on its way to the daemon, with what to do with its reply.
struct OutboundRequest: Sendable {
    enum Purpose: Sendable {
        case plain
        /// On success, route the new subscription's events to this stream.
        case subscribe(SubscriptionStream)
        /// On success, end this subscription's stream.
        case unsubscribe(UInt64)
        /// On success, report the write's effect (before the reply is handed on, so before
        /// any later message of the connection is routed).
        case write(@Sendable (JSONObject) -> Void)
    }

    let bytes: ByteBuffer
    let reply: EventLoopPromise<JSONObject>
    let purpose: Purpose
}

/// One subscription's event stream, as the handler feeds it.
///
/// Keeps its own count of events yielded but not yet consumed, so that when the stream
/// ends with events left unread (the consumer stopped iterating), they stop counting
/// against the connection's backpressure.
final class SubscriptionStream: Sendable {
    let continuation: AsyncThrowingStream<SubscriptionEvent, any Error>.Continuation
    let once: Bool
    private let flow: FlowControl
    private let unconsumed = Atomic<Int>(0)
    /// Sends `unsubscribe` when the consumer cancels; set once the daemon assigned the number.
    private let onCancel = Locked<(@Sendable () -> Void)?>(nil)

    init(continuation: AsyncThrowingStream<SubscriptionEvent, any Error>.Continuation, once: Bool, flow: FlowControl) {
        self.continuation = continuation
        self.once = once
        self.flow = flow
        continuation.onTermination = { [weak self] termination in
            self?.terminated(termination)
        }
    }

    func yield(_ event: SubscriptionEvent) {
        unconsumed.add(1, ordering: .relaxed)
        flow.produced()
        if case .terminated = continuation.yield(event) { consumed() }
    }

    /// Called by the iterator for every event it hands out.
    func consumed() {
        var current = unconsumed.load(ordering: .relaxed)
        while current > 0 {
            let (exchanged, original) = unconsumed.compareExchange(
                expected: current, desired: current - 1, ordering: .relaxed)
            if exchanged {
                flow.consumed(1)
                return
            }
            current = original
        }
    }

    func setOnCancel(_ action: @escaping @Sendable () -> Void) {
        onCancel.withLock { $0 = action }
    }

    private func terminated(_ termination: AsyncThrowingStream<SubscriptionEvent, any Error>.Continuation.Termination) {
        let left = unconsumed.exchange(0, ordering: .relaxed)
        if left > 0 { flow.consumed(left) }
        if case .cancelled = termination, let action = onCancel.withLock({ $0 }) { action() }
    }
}

/// Why a connection ended, as the handler saw it: the one record the handler and the
/// client consult, so that a call made after the end — even one that never reached the
/// handler — fails with the real reason (a refused connection's `overloaded`), not just
/// "the connection closed".
final class ConnectionFate: Sendable {
    private let reason = Locked<ObsClientError?>(nil)

    /// Records why the connection ended; the first reason stays.
    func record(_ error: ObsClientError) { reason.withLock { if $0 == nil { $0 = error } } }

    /// The recorded reason, if the connection ended.
    var current: ObsClientError? { reason.withLock { $0 } }

    func error(path: String) -> ObsClientError { reason.withLock { $0 } ?? .connectionClosed(path: path) }
}

/// Counts events delivered to streams but not yet consumed, for backpressure.
final class FlowControl: Sendable {
    static let highWater = 8192
    static let lowWater = 1024

    private let buffered = Atomic<Int>(0)
    private let paused = Atomic<Bool>(false)
    private let channel: Locked<(any Channel)?> = Locked(nil)

    func attach(_ channel: any Channel) { self.channel.withLock { $0 = channel } }

    func produced() { buffered.add(1, ordering: .relaxed) }

    /// Called when `count` events were consumed (or dropped unread); resumes reading when drained.
    func consumed(_ count: Int) {
        let left = buffered.subtract(count, ordering: .relaxed).newValue
        if left <= Self.lowWater, paused.exchange(false, ordering: .acquiringAndReleasing) {
            channel.withLock { $0 }?.read()
        }
    }

    /// Whether the handler should hold back its next read.
    func shouldPause() -> Bool {
        guard buffered.load(ordering: .relaxed) >= Self.highWater else { return false }
        paused.store(true, ordering: .releasing)
        // Re-check: the consumer may have drained in between and missed the flag.
        if buffered.load(ordering: .relaxed) <= Self.lowWater, paused.exchange(false, ordering: .acquiringAndReleasing) {
            return false
        }
        return true
    }
}

final class ClientHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = OutboundRequest
    typealias OutboundOut = ByteBuffer

    private let path: String
    private let flow: FlowControl
    private let fate: ConnectionFate
    private var framer = LineFramer(maxLine: 1 << 30)
    private var pending = CircularBuffer<OutboundRequest>()
    private var streams: [UInt64: SubscriptionStream] = [:]
    /// A read was held back for unconsumed events; a new request issues it.
    private var readHeld = false

    init(path: String, flow: FlowControl, fate: ConnectionFate) {
        self.path = path
        self.flow = flow
        self.fate = fate
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let request = unwrapOutboundIn(data)
        if let failure = fate.current {
            request.reply.fail(failure)
            promise?.fail(failure)
            return
        }
        pending.append(request)
        context.write(wrapOutboundOut(request.bytes), promise: promise)
        if readHeld {  // its reply must not wait behind unconsumed events
            readHeld = false
            context.read()
        }
    }

    func read(context: ChannelHandlerContext) {
        if pending.isEmpty, flow.shouldPause() {
            readHeld = true
        } else {
            context.read()
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        do {
            try buffer.withUnsafeReadableBytes { bytes in
                try framer.feed(bytes) { frame in
                    guard case .line(let line) = frame else {
                        throw ObsClientError.protocolViolation("a message longer than 1 GiB")
                    }
                    try handle(try ServerMessage.decode(line: line), context: context)
                }
            }
        } catch {
            let failure = (error as? ObsClientError) ?? .protocolViolation("\(error)")
            shutDown(failure)
            context.close(promise: nil)
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        shutDown(fate.error(path: path))
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        shutDown(.connectionClosed(path: path))
        context.close(promise: nil)
    }

    private func handle(_ message: ServerMessage, context: ChannelHandlerContext) throws {
        switch message {
        case .reply(let reply):
            if reply.id == .null, case .failure(let error) = reply.result, error.code == .overloaded || pending.isEmpty {
                // The daemon refusing the connection (`overloaded` at its connection limits) — never
                // a reply to a request of ours, which all carry an id — or another error it sent
                // before any request: the connection is over; every call fails with this reason.
                throw ObsClientError.server(error)
            }
            guard let request = pending.popFirst() else { throw ObsClientError.protocolViolation("a reply to no request") }
            switch reply.result {
            case .success(let members):
                switch request.purpose {
                case .plain: break
                case .subscribe(let stream):
                    guard let sub = members["sub"]?.uint64Value else {
                        throw ObsClientError.protocolViolation("subscribe reply without \"sub\"")
                    }
                    streams[sub] = stream
                case .unsubscribe(let sub):
                    streams.removeValue(forKey: sub)?.continuation.finish()
                case .write(let report):
                    report(members)
                }
                request.reply.succeed(members)
            case .failure(let error):
                if case .subscribe(let stream) = request.purpose { stream.continuation.finish(throwing: ObsClientError.server(error)) }
                request.reply.fail(ObsClientError.server(error))
            }
        case .event(let event):
            route(event)
            // The daemon sends overflow last and closes: do not use the connection meanwhile.
            if case .overflow = event { context.close(promise: nil) }
        }
    }

    private func route(_ event: Event) {
        switch event {
        case .change(let sub, _, let rev, let changes, let from, let by):
            guard let stream = streams[sub] else { return }
            stream.yield(.change(ChangeEvent(revision: rev, changes: changes, from: from, by: by)))
            if stream.once {
                streams[sub] = nil
                stream.continuation.finish()
            }
        case .snapshot(let sub, _, let rev, let values):
            streams[sub]?.yield(.snapshot(revision: rev, values: Dictionary(values, uniquingKeysWith: { $1 })))
        case .synced(let sub, _, let rev):
            streams[sub]?.yield(.synced(revision: rev))
        case .overflow(let revs):
            fate.record(.connectionClosed(path: path))
            for (sub, stream) in streams {
                if let rev = revs[sub] {
                    stream.continuation.finish(throwing: ObsClientError.overflowed(resumeAfter: rev))
                } else {
                    stream.continuation.finish(throwing: ObsClientError.connectionClosed(path: path))
                }
            }
            streams.removeAll()
        case .revoked(let sub, _, let error):
            streams.removeValue(forKey: sub)?.continuation.finish(throwing: ObsClientError.server(error))
        case .unknown:
            break
        }
    }

    private func shutDown(_ error: ObsClientError) {
        fate.record(error)
        while let request = pending.popFirst() {
            if case .subscribe(let stream) = request.purpose { stream.continuation.finish(throwing: error) }
            request.reply.fail(error)
        }
        for stream in streams.values { stream.continuation.finish(throwing: error) }
        streams.removeAll()
    }
}

@available(*, unavailable)
extension ClientHandler: Sendable {}
