// obsbench — `Engine`: the load generator's event loop. One thread, epoll (level-triggered)
// over non-blocking Unix sockets, one shared read buffer; a connection keeps only the
// bytes of a frame that a read cut in two. Two kinds of connection:
// - a subscriber: subscribed to one key; every value it receives must be its last plus
//   one (values of a key are 1, 2, 3, …), so a lost, repeated or reordered event fails the
//   run; each event's latency (the write's send time → the read that brought it) is
//   recorded;
// - a requester (publisher or writer): keeps `window` writes in flight over its keys, round
//   robin, all requests of one refill in one `send`; every reply must be a success (and a
//   Redis PUBLISH must reach the expected number of subscribers); each reply's latency is
//   recorded.
// Per event: a scan of its frame, a comparison, a histogram increment. No allocation, no
// reference counting, no locks. The scenarios (PubSub, Writes, Idle) drive it.

import CEpoll

#if canImport(Glibc)
import Glibc
#endif

struct Engine: ~Copyable {
    /// One connection's state, in the engine's contiguous table.
    struct Peer {
        enum Role {
            case subscriber, requester
        }

        let fd: Int32
        let role: Role
        /// Subscriber: its key's number. Requester: its first key in the request table.
        let key: Int
        /// Bytes of a frame not yet complete.
        var carry: Bytes
        /// Subscriber.
        var subscribed = false
        var last = 0
        // Requester.
        let keyCount: Int
        let window: Int
        /// Set for the publisher: what each Redis PUBLISH must answer (the subscribers of
        /// each key). nil for a writer (obsd `set`, Redis `SET`).
        let receivers: Int?
        var sent = 0
        var answered = 0
        var out: Bytes
        var written = 0
        var waitingWritable = false
        /// Send time of each write in flight, by `sent % window`.
        let sendTimes: UnsafeMutablePointer<UInt64>
    }

    let dialect: Dialect
    private let poll: Int32
    private let peers: UnsafeMutablePointer<Peer>
    private let peerCapacity: Int
    private(set) var peerCount = 0
    private let readBuffer: UnsafeMutablePointer<UInt8>
    private let readCapacity = 1 << 20
    private let events: UnsafeMutablePointer<epoll_event>
    private let eventCapacity = 1024
    private let requests: RequestTable

    /// Requesters send while this is true.
    var writing = false
    /// Subscribers whose subscription is confirmed; events received in all.
    private(set) var subscribedCount = 0
    private(set) var received = 0
    private(set) var lastDelivery: UInt64 = 0
    /// When bytes last arrived.
    private(set) var lastProgress: UInt64 = 0
    /// Send time of every publisher write, by sequence number: what event latencies are
    /// measured from. Grows by doubling.
    private var writeTimes: UnsafeMutablePointer<UInt64>
    private var writeTimesCapacity = 1 << 16
    private var writeTimesCount = 0
    /// Keys the publisher cycles through (write s goes to key s % keys with value s / keys + 1).
    private let publishedKeys: Int
    var eventLatency = Histogram()
    var replyLatency = Histogram()
    /// The first thing that went wrong; the run stops.
    private(set) var failure: String?

    /// An engine for at most `connections` connections, writing with `requests`;
    /// `publishedKeys` is how many keys the one publisher (if any) cycles through.
    init(dialect: Dialect, connections: Int, requests: consuming RequestTable, publishedKeys: Int = 1) throws(BenchError) {
        self.dialect = dialect
        self.requests = requests
        self.publishedKeys = publishedKeys
        poll = epoll_create1(Int32(EPOLL_CLOEXEC))
        guard poll >= 0 else { throw BenchError("epoll_create1: \(errnoText())") }
        peerCapacity = max(connections, 1)
        peers = .allocate(capacity: peerCapacity)
        readBuffer = .allocate(capacity: readCapacity)
        events = .allocate(capacity: eventCapacity)
        writeTimes = .allocate(capacity: writeTimesCapacity)
    }

    deinit {
        for i in 0..<peerCount {
            close(peers[i].fd)
            peers[i].carry.release()
            peers[i].out.release()
            peers[i].sendTimes.deallocate()
        }
        peers.deinitialize(count: peerCount)
        peers.deallocate()
        readBuffer.deallocate()
        events.deallocate()
        writeTimes.deallocate()
        close(poll)
    }

    // MARK: Connections

    /// Connects a subscriber of key number `key` and sends its subscribe request.
    mutating func addSubscriber(socket path: String, key: Int, request: [UInt8]) throws(BenchError) {
        let fd = try RawSocket.connect(path)
        let peer = Peer(
            fd: fd, role: .subscriber, key: key, carry: Bytes(capacity: 256), keyCount: 0, window: 0, receivers: nil,
            out: Bytes(capacity: 16), sendTimes: .allocate(capacity: 1))
        do throws(BenchError) {
            try RawSocket.writeAll(fd, request)
            try add(peer)
        } catch {
            Self.discard(peer)
            throw error
        }
    }

    /// Connects a requester writing keys `firstKey ..< firstKey + keyCount` of the request
    /// table with `window` writes in flight; returns its number.
    mutating func addRequester(socket path: String, firstKey: Int, keyCount: Int, window: Int, receivers: Int?) throws(BenchError) -> Int {
        let fd = try RawSocket.connect(path)
        let peer = Peer(
            fd: fd, role: .requester, key: firstKey, carry: Bytes(capacity: 4096), keyCount: keyCount, window: window,
            receivers: receivers, out: Bytes(capacity: window * 96), sendTimes: .allocate(capacity: window))
        do throws(BenchError) {
            try add(peer)
        } catch {
            Self.discard(peer)
            throw error
        }
        return peerCount - 1
    }

    private static func discard(_ peer: Peer) {
        close(peer.fd)
        peer.carry.release()
        peer.out.release()
        peer.sendTimes.deallocate()
    }

    private mutating func add(_ peer: Peer) throws(BenchError) {
        guard peerCount < peerCapacity else { throw BenchError("more connections than the engine was made for") }
        try RawSocket.setNonBlocking(peer.fd)
        var event = epoll_event()
        event.events = EPOLLIN.rawValue
        event.data.u64 = UInt64(peerCount)
        guard epoll_ctl(poll, EPOLL_CTL_ADD, peer.fd, &event) == 0 else { throw BenchError("epoll_ctl: \(errnoText())") }
        (peers + peerCount).initialize(to: peer)
        peerCount += 1
    }

    func peer(_ i: Int) -> Peer { peers[i] }

    // MARK: The loop

    /// Waits up to `timeout` ms for the sockets, then serves every ready one: requesters
    /// first, so that writes keep flowing while subscribers are many.
    mutating func turn(timeout: Int32) {
        let n = epoll_wait(poll, events, Int32(eventCapacity), timeout)
        if n < 0 {
            if errno != EINTR { fail("epoll_wait: \(errnoText())") }
            return
        }
        for pass in 0..<2 {
            for e in 0..<Int(n) {
                let i = Int(truncatingIfNeeded: events[e].data.u64)
                guard (peers[i].role == .requester) == (pass == 0) else { continue }
                let ready = events[e].events
                if ready & EPOLLOUT.rawValue != 0 { flush(i) }
                if ready & (EPOLLIN.rawValue | EPOLLHUP.rawValue | EPOLLERR.rawValue) != 0 { receive(i) }
                if failure != nil { return }
            }
        }
    }

    private mutating func receive(_ i: Int) {
        let peer = peers + i
        let carried = peer.pointee.carry.count
        guard carried < readCapacity / 2 else {
            return fail("connection \(i): a frame longer than \(readCapacity / 2) bytes")
        }
        if carried > 0 { readBuffer.update(from: peer.pointee.carry.base, count: carried) }
        let n = read(peer.pointee.fd, readBuffer + carried, readCapacity - carried)
        if n <= 0 {
            if n < 0 && (errno == EAGAIN || errno == EINTR) { return }
            let what = peer.pointee.role == .subscriber ? "subscriber of key \(peer.pointee.key)" : "requester \(i)"
            return fail("the server closed the connection of \(what)" + (n < 0 ? ": \(errnoText())" : ""))
        }
        peer.pointee.carry.count = 0
        let now = monotonicNanoseconds()
        lastProgress = now
        let end = UnsafePointer(readBuffer + carried + n)
        var p = UnsafePointer(readBuffer)
        if peer.pointee.role == .subscriber {
            while true {
                let scanned = Wire.scan(dialect, p, end)
                if scanned.frame == .incomplete { break }
                deliver(scanned.frame, to: peer, at: now, text: p, scanned.next)
                p = scanned.next
                if failure != nil { return }
            }
        } else {
            while true {
                let scanned = Wire.scan(dialect, p, end)
                if scanned.frame == .incomplete { break }
                answer(scanned.frame, to: peer, at: now, text: p, scanned.next)
                p = scanned.next
                if failure != nil { return }
            }
        }
        if p < end { peer.pointee.carry.append(p, count: end - p) }
        if peer.pointee.role == .requester { fill(i) }
    }

    @inline(__always)
    private mutating func deliver(
        _ frame: Frame, to peer: UnsafeMutablePointer<Peer>, at now: UInt64, text: UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>
    ) {
        switch frame {
        case .value(let value):
            guard peer.pointee.subscribed, value == peer.pointee.last &+ 1 else {
                return fail("subscriber of key \(peer.pointee.key): value \(value) after \(peer.pointee.last)")
            }
            peer.pointee.last = value
            received &+= 1
            lastDelivery = now
            let sequence = (value &- 1) &* publishedKeys &+ peer.pointee.key
            guard sequence < writeTimesCount else {
                return fail("subscriber of key \(peer.pointee.key): value \(value), which was never written")
            }
            eventLatency.record(now &- min(now, writeTimes[sequence]))
        case .ok where !peer.pointee.subscribed:
            peer.pointee.subscribed = true
            subscribedCount &+= 1
        case .blank:
            break
        case .overflow:
            fail("subscriber of key \(peer.pointee.key) overflowed: \(String(decoding: UnsafeBufferPointer(start: text, count: end - text), as: UTF8.self))")
        default:
            fail("subscriber of key \(peer.pointee.key) got: \(String(decoding: UnsafeBufferPointer(start: text, count: min(end - text, 300)), as: UTF8.self))")
        }
    }

    @inline(__always)
    private mutating func answer(
        _ frame: Frame, to peer: UnsafeMutablePointer<Peer>, at now: UInt64, text: UnsafePointer<UInt8>, _ end: UnsafePointer<UInt8>
    ) {
        let good: Bool
        switch frame {
        case .blank: return
        case .ok: good = peer.pointee.receivers == nil || dialect == .obsd
        case .integer(let n): good = n == peer.pointee.receivers
        default: good = false
        }
        guard good, peer.pointee.answered < peer.pointee.sent else {
            let reply = String(decoding: UnsafeBufferPointer(start: text, count: min(end - text, 300)), as: UTF8.self)
            let expected = peer.pointee.receivers.map { dialect == .redis ? "PUBLISH reaching \($0) subscribers" : "success" } ?? "success"
            return fail("write \(peer.pointee.answered + 1) answered \(reply.debugDescription), not \(expected)")
        }
        let sent = peer.pointee.sendTimes[peer.pointee.answered % peer.pointee.window]
        replyLatency.record(now &- sent)
        peer.pointee.answered &+= 1
    }

    /// Queues writes until `window` are in flight, then sends them (one `send` if the
    /// socket takes them all).
    mutating func fill(_ i: Int) {
        guard writing else { return }
        let peer = peers + i
        guard peer.pointee.sent &- peer.pointee.answered < peer.pointee.window else { return }
        let now = monotonicNanoseconds()
        let times = peer.pointee.sendTimes
        let first = peer.pointee.key, keys = peer.pointee.keyCount, window = peer.pointee.window
        var sent = peer.pointee.sent
        let answered = peer.pointee.answered
        let publishing = peer.pointee.receivers != nil
        while sent &- answered < window {
            requests.appendWrite(key: first &+ sent % keys, value: sent / keys &+ 1, into: &peer.pointee.out)
            times[sent % window] = now
            if publishing { recordWriteTime(sent, now) }
            sent &+= 1
        }
        peer.pointee.sent = sent
        flush(i)
    }

    @inline(__always)
    private mutating func recordWriteTime(_ sequence: Int, _ time: UInt64) {
        if sequence >= writeTimesCapacity {
            let bigger = UnsafeMutablePointer<UInt64>.allocate(capacity: writeTimesCapacity * 2)
            bigger.update(from: writeTimes, count: writeTimesCapacity)
            writeTimes.deallocate()
            writeTimes = bigger
            writeTimesCapacity *= 2
        }
        writeTimes[sequence] = time
        writeTimesCount = sequence &+ 1
    }

    private mutating func flush(_ i: Int) {
        let peer = peers + i
        while peer.pointee.written < peer.pointee.out.count {
            let n = send(peer.pointee.fd, peer.pointee.out.base + peer.pointee.written, peer.pointee.out.count - peer.pointee.written, Int32(MSG_NOSIGNAL))
            if n > 0 {
                peer.pointee.written += n
            } else if n < 0 && errno == EINTR {
                continue
            } else if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) {
                if !peer.pointee.waitingWritable { watch(i, writable: true) }
                return
            } else {
                return fail("write to the server: \(errnoText())")
            }
        }
        peer.pointee.out.count = 0
        peer.pointee.written = 0
        if peer.pointee.waitingWritable { watch(i, writable: false) }
    }

    private mutating func watch(_ i: Int, writable: Bool) {
        var event = epoll_event()
        event.events = EPOLLIN.rawValue | (writable ? EPOLLOUT.rawValue : 0)
        event.data.u64 = UInt64(i)
        if epoll_ctl(poll, EPOLL_CTL_MOD, peers[i].fd, &event) != 0 { return fail("epoll_ctl: \(errnoText())") }
        peers[i].waitingWritable = writable
    }

    mutating func fail(_ message: String) {
        if failure == nil { failure = message }
    }

    /// Requesters' writes sent and answered, in all.
    var requestTotals: (sent: Int, answered: Int) {
        var sent = 0, answered = 0
        for i in 0..<peerCount where peers[i].role == .requester {
            sent += peers[i].sent
            answered += peers[i].answered
        }
        return (sent, answered)
    }
}

extension Engine {
    /// Serves the sockets until `target` subscriptions are confirmed.
    mutating func waitForSubscriptions(_ target: Int, seconds: Double = 30) throws(BenchError) {
        let deadline = monotonicNanoseconds() + UInt64(seconds * 1e9)
        while subscribedCount < target {
            turn(timeout: 10)
            if let failure { throw BenchError(failure) }
            if monotonicNanoseconds() > deadline {
                throw BenchError("only \(subscribedCount) of \(target) subscriptions confirmed after \(fmt(seconds)) s")
            }
        }
    }

    /// Serves the sockets for `seconds`.
    mutating func serve(seconds: Double) {
        let deadline = monotonicNanoseconds() + UInt64(seconds * 1e9)
        while failure == nil && monotonicNanoseconds() < deadline { turn(timeout: 2) }
    }

    /// Stops writing and serves the sockets until every write is answered and `events`
    /// returns true, or nothing arrives for `grace` seconds; returns the time it stopped writing.
    mutating func drain(grace: Double, until events: (borrowing Engine) -> Bool) -> UInt64 {
        writing = false
        let stopped = monotonicNanoseconds()
        while failure == nil {
            let totals = requestTotals
            if totals.answered == totals.sent && events(self) { break }
            turn(timeout: 2)
            let quiet = monotonicNanoseconds() - max(lastProgress, stopped)
            if Double(quiet) / 1e9 > grace {
                fail("nothing received for \(fmt(grace)) s: \(totals.sent - totals.answered) writes unanswered, \(received) events")
            }
        }
        return stopped
    }
}
