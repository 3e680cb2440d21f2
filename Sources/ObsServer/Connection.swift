// ObsServer — one client connection on its event loop: the socket, its input (one state),
// its outbox, and its session.
//
// Reading: each read goes through the loop's shared buffer; the bytes are framed into lines
// and handed to the session one at a time, and only the bytes of a line cut in two stay
// here. Handling stops — even part-way through what one read brought — while the outbox is
// congested (a client that does not read its replies is not read either) or the session
// waits (for the shared store, or for a loop's delivery backlog); the rest is held and the
// socket is not read until it resumes.
//
// Writing: the shard flushes the outbox once per tick; what the socket does not take waits
// for it to be writable. A read holding a long run of pipelined requests also sends their
// replies in runs (`sendEarly`, EarlySend.swift), so that the client sends more while the
// rest are handled.
//
// A client that shuts down its sending side (`printf … | socat -`, `nc -N`) has sent its
// last request: everything it sent is handled (a last line without its `\n` too), its
// subscriptions end, and once every reply is written — replies waiting for durability
// included — the connection closes: the client reads every reply, then end of file.

import CLinux
import Logging
import ObsProtocol

#if canImport(Glibc)
import Glibc
#endif

final class Connection: IOHandler {
    let id = ConnectionID.next()
    let fd: Int32
    let shard: LoopShard
    var loop: IOLoop { shard.loop }
    let outbox: Outbox
    private(set) var session: Session?
    private let hub: Hub
    let registry: LoopConnections
    private let logger: Logger
    /// Where writes decided later are answered (the shared store's): this connection's loop.
    private(set) lazy var answers: AnswerRoute = {
        let ref = ConnectionRef(self)
        return AnswerRoute(loop: loop) { token, result, previous in ref.session?.answered(token, result, previous: previous) }
    }()

    /// What happens to the client's input.
    private enum Input {
        /// Requests are read and handled.
        case reading
        /// Handling waits (the outbox is congested, or the session waits); `held` holds what
        /// was read and not handled. `endOfInput`: the client has since shut down its side.
        case held(endOfInput: Bool)
        /// The client shut down its sending side and everything it sent is handled: the
        /// connection closes once every reply is written.
        case ended
        /// Nothing more is read: the connection overflowed, the daemon is stopping, or the
        /// connection was refused (what the client sends is read and discarded).
        case stopped
        case refused
    }

    private var input = Input.reading
    private var held: [UInt8] = []
    private var framer: LineFramer
    private var slot = -1
    private var watching: UInt32 = 0
    private var wantsWritable = false
    private(set) var isClosed = false
    /// Set by the shard while the connection is on its list of connections to write.
    var isDirty = false
    private var closeTimer: TimerID?
    /// Shutdown: called once everything queued is written (or the connection closed).
    private var onDrained: (() -> Void)?

    init(fd: Int32, shard: LoopShard, hub: Hub, registry: LoopConnections, limits: Limits, logger: Logger) {
        self.fd = fd
        self.shard = shard
        self.hub = hub
        self.registry = registry
        self.logger = logger
        self.framer = LineFramer(maxLine: limits.maxLine)
        self.outbox = Outbox(
            limits: OutboxLimits(
                maxBytes: limits.queueBytes, maxEvents: limits.queueEvents,
                grace: UInt64(limits.overflowGrace.components.seconds) * 1_000_000_000 + UInt64(limits.overflowGrace.components.attoseconds / 1_000_000_000)),
            stats: hub.stats, connection: id, latestRevision: { [unowned shard] in shard.latestRevision(of: $0) })
    }

    /// Starts serving: registers the socket, reads the peer's credentials (`peerOf`:
    /// SO_PEERCRED; replaced only by in-process tests) and asks the hub to admit it.
    func start(limits: Limits, peerOf: ((Int32) -> Peer?)? = nil) {
        loop.assertInLoop()
        do {
            slot = try loop.register(fd, self, events: 0)
        } catch {
            logger.error("cannot serve a connection: \(error)")
            Glibc.close(fd)
            return
        }
        registry.add(self)
        guard let peer = peerOf.map({ $0(fd) }) ?? Sockets.peer(of: fd, daemonUID: hub.daemonUID) else {
            logger.error("cannot read the peer's credentials (SO_PEERCRED); closing the connection")
            return refuse("the daemon could not identify this process")
        }
        let session = Session(connection: self, hub: hub, peer: peer, limits: limits, logger: logger)
        let ref = ConnectionRef(self)
        let entry = ConnectedPeer(peer: peer, since: .now, subscriptions: outbox.tally) {
            ref.loop.execute { ref.session?.revalidate() }
        }
        if let reason = hub.peers.admit(id, entry) {
            hub.stats.connectionsRefused.add(1, ordering: .relaxed)
            logger.notice("connection refused: \(reason)", metadata: peer.metadata)
            return refuse(reason)
        }
        self.session = session
        logger.debug("connected", metadata: peer.metadata)
        updateInterest()
    }

    // MARK: Readiness

    func ready(_ events: UInt32) {
        if events & EPOLLOUT.rawValue != 0, wantsWritable { shard.markDirty(self) }
        if events & (EPOLLIN.rawValue | EPOLLRDHUP.rawValue | EPOLLHUP.rawValue | EPOLLERR.rawValue) != 0 { readAvailable() }
        if events & (EPOLLHUP.rawValue | EPOLLERR.rawValue) != 0, !isClosed {
            // Both directions are gone (or the socket failed): nothing more can be written.
            close()
        }
    }

    private func readAvailable() {
        let buffer = loop.readBuffer
        for _ in 0..<16 {
            guard !isClosed else { return }
            switch input {
            case .reading, .refused: break
            case .held, .ended, .stopped: return
            }
            let n = Glibc.read(fd, buffer.baseAddress, buffer.count)
            if n > 0 {
                if case .refused = input { continue }
                handle(UnsafeRawBufferPointer(rebasing: buffer[..<n]))
                shard.markDirty(self)
                if n < buffer.count { return }  // drained: no read that would only say so
                continue
            }
            if n == 0 {
                if case .refused = input { return close() }
                return endOfInput()
            }
            if errno == EINTR { continue }
            if errno == EAGAIN || errno == EWOULDBLOCK { return }
            return close()
        }
    }

    /// Hands `bytes` to the session a line at a time, and stops — holding the rest — as soon
    /// as the outbox is congested or the session waits: one read can carry thousands of
    /// pipelined requests, and a client that sends them without reading must not make the
    /// daemon queue every reply.
    private func handle(_ bytes: UnsafeRawBufferPointer) {
        guard let session else { return }
        var rest = bytes
        var handled = 0
        var handledSinceSend = 0
        while !rest.isEmpty {
            // After an overflow the connection only drains and closes: nothing more is read.
            guard outbox.isOpen else {
                held = []
                input = .stopped
                return updateInterest()
            }
            if outbox.isCongested || session.holdsInput {
                held.append(contentsOf: rest)
                input = .held(endOfInput: false)
                return updateInterest()
            }
            let end = memchr(rest.baseAddress!, 0x0A, rest.count).map { UnsafeRawPointer($0) - rest.baseAddress! + 1 } ?? rest.count
            framer.feed(UnsafeRawBufferPointer(rebasing: rest[..<end])) { frame in
                guard outbox.isOpen else { return }
                session.handle(frame)
            }
            rest = UnsafeRawBufferPointer(rebasing: rest[end...])
            handled += 1
            handledSinceSend += 1
            let consumed = bytes.count - rest.count
            if EarlySend.due(sinceSend: handledSinceSend, handled: handled, consumed: consumed, of: bytes.count, tickWrites: shard.recentTickWrites) {
                handledSinceSend = 0
                sendEarly()
            }
        }
    }

    /// Sends what is ready in the middle of a read (the shard's tick sends the rest, and
    /// does what follows a send: closing a drained connection, resuming held input). Replies
    /// held for durability are made durable first where that is cheap (`sync = relaxed`:
    /// the shard's `commitEarly`; the connection never calls storage).
    private func sendEarly() {
        guard shard.recentTickEvents < EarlySend.heavyTick else { return }
        if outbox.holdsSlots { shard.commitEarly() }
        guard outbox.hasReady else { return }
        switch outbox.flush(to: fd) {
        case .drained(let n):
            shard.counters.count(bytes: n)
        case .partial(let n):
            shard.counters.count(bytes: n)
            if !wantsWritable {
                wantsWritable = true
                updateInterest()
            }
        case .failed:
            close()
        }
    }

    /// Handles held input once the outbox has room and the session no longer waits.
    func resume() {
        guard case .held(let endOfInput) = input, let session, !isClosed else { return }
        if outbox.queuedBytes >= outbox.limits.maxBytes / 2 || session.holdsInput { return }
        input = .reading
        var bytes: [UInt8] = []
        swap(&bytes, &held)
        bytes.withUnsafeBytes { handle($0) }
        shard.markDirty(self)
        guard case .reading = input else {
            if endOfInput, case .held = input { input = .held(endOfInput: true) }
            return
        }
        if endOfInput { return self.endOfInput() }
        updateInterest()
    }

    /// The client shut down its sending side: once what it sent is handled (a last line
    /// without its `\n` too), its subscriptions end and the connection closes when idle.
    private func endOfInput() {
        switch input {
        case .held:
            input = .held(endOfInput: true)
            return updateInterest()
        case .reading:
            break
        case .ended, .stopped, .refused:
            return
        }
        guard let session else { return close() }
        if session.holdsInput {  // what it waits for resumes this
            input = .held(endOfInput: true)
            return updateInterest()
        }
        input = .ended
        updateInterest()
        framer.finish { frame in if outbox.isOpen { session.handle(frame) } }
        session.endSubscriptions()
        shard.markDirty(self)
    }

    // MARK: Writing

    /// Sends what the outbox has ready; the bytes sent. Called by the shard once per tick.
    func flush() -> Int {
        guard !isClosed else { return 0 }
        let sent: Int
        switch outbox.flush(to: fd) {
        case .drained(let n):
            sent = n
            if wantsWritable {
                wantsWritable = false
                updateInterest()
            }
        case .partial(let n):
            sent = n
            if !wantsWritable {
                wantsWritable = true
                updateInterest()
            }
        case .failed:
            close()
            return 0
        }
        // A `sync` of a lagging coalescing subscription follows its coalesced event, which a
        // flush queues.
        if session?.pendingSync != nil { session?.answerSync() }
        afterFlush()
        return sent
    }

    private func afterFlush() {
        if outbox.isEmpty {
            if outbox.isOverflowed || (isEnded && !(session?.holdsInput ?? false)) { return close() }
            if let onDrained {
                self.onDrained = nil
                onDrained()
            }
        }
        if case .held = input, outbox.queuedBytes < outbox.limits.maxBytes / 2 { resume() }
    }

    private var isEnded: Bool {
        if case .ended = input { return true }
        return false
    }

    /// The session's wait is over (the shared store answered, or the backlog went down).
    func sessionResumed() {
        if case .held = input { resume() }
        shard.markDirty(self)
    }

    // MARK: Endings

    /// The loop's shard ended `subscription`, and its repository is a placeholder: the hub
    /// may drop it now.
    func subscriptionEnded(_ subscription: Subscription) {
        hub.repositories.subscriptionEnded(subscription.repository)
    }

    /// The connection overflowed: nothing more is read; it closes once the `overflow` event
    /// is written, or after the grace period. Its connection-bound leases end now — the
    /// connection is cut off, whatever the client takes to read its last message.
    func overflowed() {
        input = .stopped
        held = []
        updateInterest()
        hub.leases.connectionClosed(id, time: loop.wallSeconds, in: hub)
        let ref = ConnectionRef(self)
        closeTimer = loop.schedule(in: outbox.limits.grace) { ref.connection?.close() }
    }

    /// One error message, then a lingering close: the write side is shut down at once (the
    /// client reads the message, then end of file), and whatever the client sends meanwhile
    /// is read and discarded until it closes, or for a second at most — closing with its
    /// request unread would make the kernel reset the connection, losing the message.
    private func refuse(_ reason: String) {
        input = .refused
        var message: [UInt8] = []
        ReplyEncoder.error(&message, id: .null, ProtocolError(.overloaded, reason))
        message.withUnsafeBytes { _ = obs_send(fd, $0.baseAddress, UInt($0.count)) }
        shutdown(fd, Int32(SHUT_WR))
        updateInterest()
        let ref = ConnectionRef(self)
        closeTimer = loop.schedule(in: 1_000_000_000) { ref.connection?.close() }
    }

    /// Shutdown: takes no more requests.
    func quiesce() {
        guard !isClosed else { return }
        if case .refused = input { return }
        input = .stopped
        held = []
        updateInterest()
    }

    /// Shutdown: calls `body` once everything queued is written, or the connection closed.
    func whenDrained(_ body: @escaping () -> Void) {
        if isClosed || outbox.isEmpty { return body() }
        onDrained = body
        shard.markDirty(self)
    }

    /// Closes the socket and ends the session. Idempotent.
    func close() {
        guard !isClosed else { return }
        isClosed = true
        if let closeTimer { loop.cancel(closeTimer) }
        if slot >= 0 { loop.deregister(fd, slot: slot) }
        Glibc.close(fd)
        if let session {
            session.close()
            hub.peers.leave(id)
            hub.leases.connectionClosed(id, time: loop.wallSeconds, in: hub)
            logger.debug("disconnected", metadata: session.peer.metadata)
        }
        session = nil
        registry.remove(self)
        if let onDrained {
            self.onDrained = nil
            onDrained()
        }
    }

    private func updateInterest() {
        guard !isClosed, slot >= 0 else { return }
        var events: UInt32 = 0
        switch input {
        case .reading, .refused: events |= EPOLLIN.rawValue | EPOLLRDHUP.rawValue
        case .held, .ended, .stopped: break
        }
        if wantsWritable { events |= EPOLLOUT.rawValue }
        guard events != watching else { return }
        watching = events
        loop.modify(fd, slot: slot, events: events)
    }
}

@available(*, unavailable)
extension Connection: Sendable {}
