// ObsClient — the channel handler of a client connection.
//
// Matches replies to requests (the daemon replies in request order), routes events to
// their subscription's stream, and ends streams exactly as the contract says: after the
// `unsubscribe` reply, after a `once` subscription's change, on `overflow` (with the
// revision to resume from), or when the connection closes. A `sync` reply may leave a mark
// in its subscription's stream, where it arrived: after every event it covers. Bounds what the application
// leaves unconsumed (FlowControl.swift): it stops reading the socket while no reply is
// awaited, and while one is, cuts the subscription holding the most events off with
// `overflowed`. After `overflow` the daemon is closing the connection: the client closes it
// at once, so a session reconnects instead of using a dead connection.

import NIOCore
import ObsProtocol
import ObservableKit
import Synchronization

/// A request on its way to the daemon, with what to do with its reply.
struct OutboundRequest: Sendable {
    enum Purpose: Sendable {
        case plain
        /// On success, route the new subscription's events to this stream; `since` and
        /// `initial` as asked (what it resumes after, if cut off before its first event).
        case subscribe(SubscriptionStream, since: UInt64?, initial: Bool)
        /// On success, end this subscription's stream.
        case unsubscribe(UInt64)
        /// A `sync` of this subscription: on success, with a mark, put the mark in its stream
        /// where the reply arrived (after every event the reply covers).
        case sync(UInt64, mark: UInt64?)
        /// On success, report the write's effect (before the reply is handed on, so before
        /// any later message of the connection is routed).
        case write(@Sendable (JSONObject) -> Void)
    }

    let bytes: ByteBuffer
    let reply: EventLoopPromise<JSONObject>
    let purpose: Purpose

    init(
        _ command: Command, id: Int64, leases: [Key: UInt64] = [:], allocator: ByteBufferAllocator, reply: EventLoopPromise<JSONObject>,
        purpose: Purpose
    ) {
        var encoded: [UInt8] = []
        command.encodeRequest(into: &encoded, id: .int(id), leases: leases)
        self.bytes = allocator.buffer(bytes: encoded)
        self.reply = reply
        self.purpose = purpose
    }
}

/// The ids of one connection's requests, shared by the client and its handler (which sends
/// `unsubscribe` for a subscription it cuts off). Replies are matched by order; an id is
/// for the daemon's logs and whoever reads the traffic.
final class RequestIDs: Sendable {
    private let last = Atomic<Int64>(0)

    func next() -> Int64 { last.add(1, ordering: .relaxed).newValue }
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

final class ClientHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = OutboundRequest
    typealias OutboundOut = ByteBuffer

    /// A live subscription: its stream, and the revision through which it has been handed
    /// every event (nil before its snapshot).
    private struct Route {
        let stream: SubscriptionStream
        var delivered: UInt64?
    }

    private let path: String
    private let flow: FlowControl
    private let fate: ConnectionFate
    private let ids: RequestIDs
    private var framer = LineFramer(maxLine: 1 << 30)
    private var pending = CircularBuffer<OutboundRequest>()
    private var streams: [UInt64: Route] = [:]
    /// A read was held back for unconsumed events; a new request issues it.
    private var readHeld = false

    init(path: String, flow: FlowControl, fate: ConnectionFate, ids: RequestIDs) {
        self.path = path
        self.flow = flow
        self.fate = fate
        self.ids = ids
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
                case .subscribe(let stream, let since, let initial):
                    let started: SubscribeReply
                    do {
                        started = try SubscribeReply(decoding: members)
                    } catch {
                        throw ObsClientError.protocolViolation(error.description)
                    }
                    streams[started.subscription] = Route(stream: stream, delivered: since ?? (initial ? nil : started.revision))
                case .unsubscribe(let sub):
                    streams.removeValue(forKey: sub)?.stream.continuation.finish()
                case .write(let report):
                    report(members)
                case .sync(let sub, let mark):
                    let synced: SyncReply
                    do {
                        synced = try SyncReply(decoding: members)
                    } catch {
                        throw ObsClientError.protocolViolation(error.description)
                    }
                    guard let route = streams[sub] else {
                        // Cut off here meanwhile (the daemon had not seen the unsubscribe yet).
                        request.reply.fail(ObsClientError.server(ProtocolError(.notFound, "subscription \(sub) ended before its sync reply")))
                        return
                    }
                    // Every event through the reply's revision was handed on: resume from there.
                    if let delivered = route.delivered, delivered < synced.revision { streams[sub]?.delivered = synced.revision }
                    if let mark { route.stream.yield(.syncMark(mark: mark, revision: synced.revision)) }
                }
                request.reply.succeed(members)
            case .failure(let error):
                if case .subscribe(let stream, _, _) = request.purpose { stream.continuation.finish(throwing: ObsClientError.server(error)) }
                request.reply.fail(ObsClientError.server(error))
            }
        case .event(let event):
            route(event, context: context)
            // The daemon sends overflow last and closes: do not use the connection meanwhile.
            if case .overflow = event { context.close(promise: nil) }
        }
    }

    private func route(_ event: ServerEvent, context: ChannelHandlerContext) {
        switch event {
        case .change(let change):
            guard let stream = deliver(.change(change), at: change.revision, to: change.subscription, context: context) else { return }
            if stream.once {
                streams[change.subscription] = nil
                stream.continuation.finish()
            }
        case .snapshot(let snapshot):
            deliver(.snapshot(revision: snapshot.revision, values: snapshot.values), at: snapshot.revision, to: snapshot.subscription, context: context)
        case .synced(let synced):
            deliver(.synced(revision: synced.revision), at: synced.revision, to: synced.subscription, context: context)
        case .catchUp(let catchUp):
            deliver(.catchUp(catchUp), at: catchUp.revision, to: catchUp.subscription, context: context)
        case .progress(let progress):
            // Everything it selects through this revision was handed on: resume from there.
            guard let route = streams[progress.subscription], let delivered = route.delivered, delivered < progress.revision else { return }
            streams[progress.subscription]?.delivered = progress.revision
            if route.stream.progress { route.stream.yield(.progress(progress.revision)) }
        case .overflow(let overflow):
            fate.record(.connectionClosed(path: path))
            for (sub, route) in streams {
                if let rev = overflow.revisions[sub] {
                    route.stream.continuation.finish(throwing: ObsClientError.overflowed(resumeAfter: rev))
                } else {
                    route.stream.continuation.finish(throwing: ObsClientError.connectionClosed(path: path))
                }
            }
            streams.removeAll()
        case .revoked(let revoked):
            streams.removeValue(forKey: revoked.subscription)?.stream.continuation.finish(throwing: ObsClientError.server(revoked.error))
        case .unknown:
            break
        }
    }

    /// Hands an event at `revision` to subscription `sub`'s stream; the stream, or nil if the
    /// subscription is not (or no longer) live. Over the connection's limit — reads went on
    /// for a reply — the subscription holding the most unconsumed events is cut off first,
    /// which may be this one.
    @discardableResult
    private func deliver(_ event: SubscriptionEvent, at revision: UInt64, to sub: UInt64, context: ChannelHandlerContext) -> SubscriptionStream? {
        guard streams[sub] != nil else { return nil }
        if flow.isOverLimit { cutOffFullest(context: context) }
        guard let stream = streams[sub]?.stream else { return nil }
        streams[sub]?.delivered = revision
        stream.yield(.event(event))
        return stream
    }

    /// Ends the subscription holding the most unconsumed events as an overflow would — after
    /// those events, with the revision of the last — and unsubscribes it; what still arrives
    /// for it is dropped. Its unconsumed events stop counting at once (the stream ended).
    private func cutOffFullest(context: ChannelHandlerContext) {
        var fullest: (sub: UInt64, resumeAfter: UInt64, unconsumed: Int)?
        for (sub, route) in streams {
            guard let delivered = route.delivered else { continue }
            let unconsumed = route.stream.unconsumedCount
            if unconsumed > fullest?.unconsumed ?? 0 { fullest = (sub, delivered, unconsumed) }
        }
        guard let fullest, let route = streams.removeValue(forKey: fullest.sub) else { return }
        route.stream.continuation.finish(throwing: ObsClientError.overflowed(resumeAfter: fullest.resumeAfter))
        let promise = context.eventLoop.makePromise(of: JSONObject.self)
        promise.futureResult.whenComplete { _ in }  // not_found if it ended meanwhile: nothing to do
        let request = OutboundRequest(
            .unsubscribe(sub: fullest.sub), id: ids.next(), allocator: context.channel.allocator, reply: promise,
            purpose: .unsubscribe(fullest.sub))
        pending.append(request)
        context.writeAndFlush(wrapOutboundOut(request.bytes), promise: nil)
    }

    private func shutDown(_ error: ObsClientError) {
        fate.record(error)
        while let request = pending.popFirst() {
            if case .subscribe(let stream, _, _) = request.purpose { stream.continuation.finish(throwing: error) }
            request.reply.fail(error)
        }
        for route in streams.values { route.stream.continuation.finish(throwing: error) }
        streams.removeAll()
    }
}

@available(*, unavailable)
extension ClientHandler: Sendable {}
