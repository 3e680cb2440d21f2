// ObsServer — how a session replies: encoding straight into the outbox, holding a reply
// back until the state it reports is durable (in an outbox slot, so order is kept),
// subscribing, and `stats`.
//
// A reply that reports state at a revision not yet durable holds its place in the outbox
// and is sent when storage confirms that revision — or replaced by an error if storage
// fails and the revision is undone. So nothing a client is told can be lost.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

extension Session {
    /// Appends a success reply — encoded into the outbox at once if the state it reports
    /// (`sequence`) is durable in `repository` (or no repository is involved), else held in
    /// a slot until it is.
    func reply(
        _ id: JSONValue, after sequence: StateSequence = 0, in repository: Repository? = nil, _ members: (inout ByteBuffer) -> Void
    ) {
        if let repository, !repository.isDurable(sequence) {
            var buffer = ByteBufferAllocator().buffer(capacity: 128)
            Self.encode(&buffer, id: id, members)
            return hold(buffer, id: id, until: sequence, in: repository)
        }
        outbox.appendReply { Self.encode(&$0, id: id, members) }
        shard.markDirty(outbox)
    }

    /// Appends an error reply, held back like `reply` when it reports non-durable state.
    func fail(id: JSONValue, _ error: ProtocolError, after sequence: StateSequence = 0, in repository: Repository? = nil) {
        hub.stats.errors.add(1, ordering: .relaxed)
        if let repository, !repository.isDurable(sequence) {
            var buffer = ByteBufferAllocator().buffer(capacity: 128)
            ReplyEncoder.error(&buffer, id: id, error)
            return hold(buffer, id: id, until: sequence, in: repository)
        }
        outbox.appendReply { ReplyEncoder.error(&$0, id: id, error) }
        shard.markDirty(outbox)
    }

    private static func encode(_ buffer: inout ByteBuffer, id: JSONValue, _ members: (inout ByteBuffer) -> Void) {
        ReplyEncoder.begin(&buffer, id: id)
        members(&buffer)
        ReplyEncoder.end(&buffer)
    }

    /// Queues `bytes` in a slot, sent once `sequence` of `repository` is durable (or replaced
    /// by an error if it is undone; a subscription that began there ends).
    private func hold(
        _ bytes: ByteBuffer, events: Int = 0, id: JSONValue, until sequence: StateSequence, in repository: Repository,
        subscription: Subscription? = nil
    ) {
        let slot = outbox.reserveSlot()
        switch repository.awaitDurable(sequence, on: shard) {
        case .durable:
            outbox.fill(slot, with: bytes, events: events)
        case .pending:
            shard.wait(
                LoopShard.Waiter(
                    sequence: sequence, outbox: outbox, slot: slot, bytes: bytes, events: events, id: id, subscription: subscription),
                on: repository)
        case .failed(let error):
            if let subscription, outbox.unregister(subscription.id) != nil { shard.unroute(subscription) }
            outbox.fill(slot, with: Self.storageFailure(id: id, error, repo: repository.name))
        }
        shard.markDirty(outbox)
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
        let started: (Repository, Subscription, SubscriptionStart)
        do {
            started = try hub.using(request.repo) { (repository) throws(ProtocolError) in
                let subscription = Subscription(id: number, repository: repository, outbox: outbox, request: request)
                return (repository, subscription, try repository.subscribe(subscription, request, now: now))
            }
        } catch {
            return fail(id: id, error)
        }
        let (repository, subscription, start) = started
        let replayBytes = start.replay.reduce(0) { $0 + $1.record.byteSize }
        if let refusal = Self.tooLargeToSend(start.snapshot ?? [], values: true, what: "this subscription's snapshot")
            ?? (replayBytes > Self.maxMessageBytes
                ? ProtocolError(.tooLarge, "the replay since \(request.since ?? 0) would take \(replayBytes >> 20) MiB, more than the \(Self.maxMessageBytes >> 20) MiB one message holds: resume from a later revision, or subscribe with initial: true")
                : nil)
        {
            if start.registered, outbox.unregister(subscription.id) != nil { shard.unroute(subscription) }
            return fail(id: id, refusal)
        }
        // Encoded outside the repository's lock: the reply, then the snapshot or the replay.
        var buffer = ByteBufferAllocator().buffer(capacity: 256)
        ReplyEncoder.begin(&buffer, id: id)
        buffer.writeMember(",\"sub\":", number)
        buffer.writeMember(",\"rev\":", start.revision)
        buffer.writeMember(",\"epoch\":", repository.epoch)
        ReplyEncoder.end(&buffer)
        var events = 0
        if var snapshot = start.snapshot {
            snapshot.sort { $0.key < $1.key }
            writeSnapshot(&buffer, sub: number, repo: repository.name, rev: start.revision, snapshot)
            events += 1
        }
        for record in start.replay {
            record.writeEvent(&buffer, sub: number, writers: request.writers, selected: Self.selected(request.selection, of: record))
            events += 1
            if request.once { break }  // its one change: it ends here, and no `synced` follows
        }
        if request.since != nil, !(request.once && !start.replay.isEmpty) {
            EventEncoder.writeSynced(&buffer, sub: number, repo: repository.name, rev: start.revision)
            events += 1
        }
        if repository.isDurable(start.sequence) {
            outbox.append(buffer, events: events)
            shard.markDirty(outbox)
        } else {
            hold(buffer, events: events, id: id, until: start.sequence, in: repository, subscription: start.registered ? subscription : nil)
        }
    }

    /// Which of a replayed revision's changes a selection picks.
    private static func selected(_ selection: Selection, of record: Revision) -> SelectedChanges {
        if case .all = selection { return .all }
        let keys = record.keys
        let positions = keys.indices.filter { selection.matches(keys[$0]) }
        return positions.count == keys.count ? .all : .some(positions)
    }

    private func writeSnapshot(
        _ buffer: inout ByteBuffer, sub: UInt64, repo: String, rev: UInt64, _ entries: [(key: Key, value: CanonicalJSON)]
    ) {
        buffer.writeMember("{\"event\":\"snapshot\",\"sub\":", sub)
        buffer.writeMember(",\"repo\":", repo)
        buffer.writeMember(",\"rev\":", rev)
        buffer.writeRaw(",\"values\":{")
        for (i, entry) in entries.enumerated() {
            if i > 0 { buffer.writeByte(UInt8(ascii: ",")) }
            buffer.writeJSONString(entry.key)
            buffer.writeByte(UInt8(ascii: ":"))
            buffer.writeCanonical(entry.value)
        }
        buffer.writeRaw("}}\n")
    }

    /// Counters. A privileged peer (root, the daemon's uid) sees the daemon's; others see
    /// their own connections and subscriptions and the repositories they may read.
    func stats(_ id: JSONValue) {
        let s = hub.stats
        let uptime = settings.startTime.duration(to: .now)
        func count(_ c: borrowing Atomic<Int>) -> UInt64 { UInt64(max(0, c.load(ordering: .relaxed))) }
        func sum(_ value: (LoopCounters) -> Int) -> UInt64 { UInt64(max(0, hub.loopCounters.reduce(0) { $0 + value($1) })) }
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
            b.writeMember(",\"requests\":", sum { $0.requests.load(ordering: .relaxed) })
            b.writeMember(",\"writes\":", sum { $0.writes.load(ordering: .relaxed) })
            b.writeMember(",\"eventsOut\":", sum { $0.eventsOut.load(ordering: .relaxed) })
            b.writeMember(",\"bytesOut\":", sum { $0.bytesOut.load(ordering: .relaxed) })
            b.writeMember(",\"overflows\":", count(s.overflows))
            b.writeMember(",\"writersHeld\":", count(s.writersHeld))
            b.writeMember(",\"errors\":", count(s.errors))
            b.writeMember(",\"denied\":", count(s.denied))
            b.writeMember(",\"uptimeSeconds\":", UInt64(max(0, uptime.components.seconds)))
            b.writeMember(",\"pid\":", UInt64(max(0, getpid())))
            let reloads = hub.runtime.reloads
            b.writeMember(",\"reloads\":", UInt64(reloads.ended))
            b.writeMember(",\"reloadFailures\":", UInt64(reloads.failed))
            if let error = reloads.error { b.writeMember(",\"reloadError\":", error) }
            b.writeMember(",\"storage\":", hub.storage.summary)
            if let c = hub.storage.counters {
                b.writeMember(",\"storageCommits\":", count(c.commits))
                b.writeMember(",\"storageFsyncs\":", count(c.fsyncs))
                b.writeMember(",\"storageRecords\":", count(c.records))
                b.writeMember(",\"storageFailures\":", count(c.failures))
                b.writeMember(",\"storageCheckpoints\":", count(c.checkpoints))
                b.writeMember(",\"storageCheckpointFailures\":", count(c.checkpointFailures))
            }
            b.writeRaw(",\"clients\":[")
            for (i, client) in hub.connectedPeers.sorted(by: { $0.since < $1.since }).enumerated() {
                if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                b.writeMember("{\"uid\":", UInt64(client.peer.uid))
                b.writeMember(",\"gid\":", UInt64(client.peer.gid))
                b.writeMember(",\"pid\":", UInt64(max(0, client.peer.pid)))
                b.writeMember(",\"subscriptions\":", UInt64(client.subscriptions.value))
                b.writeMember(",\"connectedSeconds\":", UInt64(max(0, client.since.duration(to: .now).components.seconds)))
                b.writeByte(UInt8(ascii: "}"))
            }
            b.writeByte(UInt8(ascii: "]"))
        }
    }
}
