// ObsServer — how a session replies: encoding, holding a reply back until the state it
// reports is durable (in an outbox slot, so order is kept), subscribing, and `stats`.
//
// A reply that reports state at a revision not yet durable holds its place in the outbox
// and is sent when storage confirms that revision — or replaced by an error if storage
// fails and the revision is undone. So nothing a client is told can be lost.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    /// Appends a success reply — at once if the state it reports (`sequence`) is durable in
    /// `repository` (or no repository is involved), else in a slot filled when it is.
    func reply(
        _ id: JSONValue, after sequence: StateSequence = 0, in repository: Repository? = nil, _ members: (inout ByteBuffer) -> Void
    ) {
        scratch.clear()
        ReplyEncoder.begin(&scratch, id: id)
        members(&scratch)
        ReplyEncoder.end(&scratch)
        send(takeEncoded(), id: id, after: sequence, in: repository)
    }

    /// Appends an error reply, held back like `reply` when it reports non-durable state.
    func fail(id: JSONValue, _ error: ProtocolError, after sequence: StateSequence = 0, in repository: Repository? = nil) {
        hub.stats.errors.add(1, ordering: .relaxed)
        scratch.clear()
        ReplyEncoder.error(&scratch, id: id, error)
        send(takeEncoded(), id: id, after: sequence, in: repository)
    }

    /// The reply just encoded in `scratch`. A small one is `scratch` itself (the outbox
    /// copies it into its tail); a large one is handed over whole and `scratch` starts
    /// afresh, so a queued reply never shares the scratch buffer's storage — otherwise the
    /// next `clear()` would reallocate its peak capacity, once per reply.
    private func takeEncoded() -> ByteBuffer {
        guard scratch.readableBytes >= 4096 else { return scratch }
        defer { scratch = ByteBufferAllocator().buffer(capacity: 1024) }
        return scratch
    }

    private func send(_ bytes: ByteBuffer, id: JSONValue, after sequence: StateSequence, in repository: Repository?) {
        guard let repository, !repository.isDurable(sequence) else {
            outbox.append(bytes)
            return
        }
        let slot = outbox.reserveSlot()
        let outbox = self.outbox
        let status = repository.whenDurable(sequence) { result in
            switch result {
            case .success: outbox.fill(slot, with: bytes)
            case .failure(let error): outbox.fill(slot, with: Self.storageFailure(id: id, error, repo: repository.name))
            }
        }
        switch status {
        case .durable: outbox.fill(slot, with: bytes)
        case .pending: break
        case .failed(let error): outbox.fill(slot, with: Self.storageFailure(id: id, error, repo: repository.name))
        }
    }

    /// The reply to a request whose outcome storage could not keep.
    static func storageFailure(id: JSONValue, _ error: StorageError, repo: String) -> ByteBuffer {
        var buffer = ByteBuffer()
        let message = "storage failure in repository \(repo): the change this reply depends on could not be stored and was undone (\(error.description)); retry once the cause is fixed"
        ReplyEncoder.error(&buffer, id: id, ProtocolError(.internal, message))
        return buffer
    }

    func subscribe(_ id: JSONValue, _ request: SubscribeRequest) {
        let number = nextSub
        nextSub += 1
        let now = WallClock.unixSeconds()
        do {
            try hub.using(request.repo) { (repository) throws(ProtocolError) in
                let subscription = Subscription(id: number, repository: repository, outbox: outbox, once: request.once)
                let (slot, bytes, events, sequence) = try repository.subscribe(subscription, request, replyID: id, now: now)
                let (outbox, hub) = (self.outbox, self.hub)
                let fail = { @Sendable (error: StorageError) in
                    if let ended = outbox.unregister(subscription.id) { hub.subscriptionEnded(ended) }
                    outbox.fill(slot, with: Self.storageFailure(id: id, error, repo: repository.name))
                }
                let status = repository.whenDurable(sequence) { result in
                    switch result {
                    case .success: outbox.fill(slot, with: bytes, events: events)
                    case .failure(let error): fail(error)
                    }
                }
                switch status {
                case .durable: outbox.fill(slot, with: bytes, events: events)
                case .pending: break
                case .failed(let error): fail(error)
                }
            }
        } catch {
            fail(id: id, error)
        }
    }

    /// Counters. A privileged peer (root, the daemon's uid) sees the daemon's; others see
    /// their own connections and subscriptions and the repositories they may read.
    func stats(_ id: JSONValue) {
        let s = hub.stats
        let uptime = settings.startTime.duration(to: .now)
        func count(_ c: borrowing Atomic<Int>) -> UInt64 { UInt64(max(0, c.load(ordering: .relaxed))) }
        let privileged = peer.isPrivileged
        let readable = privileged ? hub.repositoryCount : hub.listed().filter { permission($0.name) >= .read }.count
        reply(id) { b in
            b.writeMember(",\"connections\":", privileged ? count(s.connections) : UInt64(hub.connections(of: peer.uid)))
            b.writeMember(",\"subscriptions\":", privileged ? count(s.subscriptions) : UInt64(outbox.liveCount))
            b.writeMember(",\"repos\":", UInt64(readable))
            b.writeMember(",\"peer\":{\"uid\":", UInt64(peer.uid))
            b.writeMember(",\"gid\":", UInt64(peer.gid))
            b.writeMember(",\"pid\":", UInt64(max(0, peer.pid)))
            b.writeMember(",\"privileged\":", privileged)
            b.writeByte(UInt8(ascii: "}"))
            b.writeMember(",\"server\":", "obsd/\(ObsServer.version)")
            guard privileged else { return }
            b.writeMember(",\"connectionsTotal\":", count(s.connectionsTotal))
            b.writeMember(",\"connectionsRefused\":", count(s.connectionsRefused))
            b.writeMember(",\"requests\":", count(s.requests))
            b.writeMember(",\"writes\":", count(s.writes))
            b.writeMember(",\"eventsOut\":", count(s.eventsOut))
            b.writeMember(",\"bytesOut\":", count(s.bytesOut))
            b.writeMember(",\"overflows\":", count(s.overflows))
            b.writeMember(",\"errors\":", count(s.errors))
            b.writeMember(",\"denied\":", count(s.denied))
            b.writeMember(",\"uptimeSeconds\":", UInt64(max(0, uptime.components.seconds)))
            b.writeMember(",\"storage\":", hub.storage.summary)
            if let c = hub.storage.counters {
                b.writeMember(",\"storageCommits\":", count(c.commits))
                b.writeMember(",\"storageFsyncs\":", count(c.fsyncs))
                b.writeMember(",\"storageRecords\":", count(c.records))
                b.writeMember(",\"storageFailures\":", count(c.failures))
            }
            b.writeRaw(",\"clients\":[")
            for (i, client) in hub.connectedPeers.sorted(by: { $0.since < $1.since }).enumerated() {
                if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                b.writeMember("{\"uid\":", UInt64(client.peer.uid))
                b.writeMember(",\"gid\":", UInt64(client.peer.gid))
                b.writeMember(",\"pid\":", UInt64(max(0, client.peer.pid)))
                b.writeMember(",\"subscriptions\":", UInt64(client.outbox.liveCount))
                b.writeMember(",\"connectedSeconds\":", UInt64(max(0, client.since.duration(to: .now).components.seconds)))
                b.writeByte(UInt8(ascii: "}"))
            }
            b.writeByte(UInt8(ascii: "]"))
        }
    }
}

import Synchronization
