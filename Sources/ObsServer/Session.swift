// ObsServer — one connection's requests: execution against the hub and reply encoding.
//
// A `Session` lives on its connection's event loop and handles requests in order. Every
// request gets exactly one reply, appended to the connection's outbox in request order. A
// reply that reports state at a revision not yet durable holds its place in the outbox
// (a slot) and is sent when storage confirms that revision — or replaced by an error if
// storage fails and the revision is undone. So nothing a client is told can be lost.

import Logging
import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit

final class Session {
    let hub: Hub
    let outbox: Outbox
    let settings: SessionSettings
    let logger: Logger
    private var nextSub: UInt64 = 1
    /// Reused for encoding replies.
    private var scratch: ByteBuffer

    init(hub: Hub, outbox: Outbox, settings: SessionSettings, logger: Logger) {
        self.hub = hub
        self.outbox = outbox
        self.settings = settings
        self.logger = logger
        self.scratch = ByteBufferAllocator().buffer(capacity: 1024)
    }

    // MARK: Input

    /// Handles one frame from the connection.
    func handle(_ frame: LineFramer.Frame) {
        hub.stats.requests.add(1, ordering: .relaxed)
        switch frame {
        case .tooLarge:
            fail(id: .null, ProtocolError(.tooLarge, "line longer than \(settings.maxLine) bytes; the rest of it is discarded"))
        case .line(let bytes):
            do {
                let request = try Request.decode(line: bytes, maxDepth: settings.maxDepth)
                execute(request)
            } catch {
                fail(id: error.id, error.error)
            }
        }
    }

    /// Ends every subscription; called when the connection closes.
    func close() {
        for subscription in outbox.close() { hub.subscriptionEnded(subscription) }
    }

    // MARK: Commands

    private func execute(_ request: Request) {
        let id = request.id
        switch request.command {
        case .hello:
            reply(id) { b in
                b.writeMember(",\"protocol\":", UInt64(ObsProtocolVersion.current))
                b.writeMember(",\"server\":", "obsd/\(ObsServer.version)")
                b.writeMember(",\"maxLine\":", UInt64(settings.maxLine))
            }
        case .ping:
            reply(id) { _ in }
        case .get(let repo, let key):
            guard let repository = hub.existing(repo) else {
                return fail(id: id, ProtocolError(.notFound, "key \(key.debugDescription) does not exist in repository \(repo)"))
            }
            let (entry, sequence) = repository.get(key)
            guard let entry else {
                return fail(
                    id: id, ProtocolError(.notFound, "key \(key.debugDescription) does not exist in repository \(repo)"),
                    after: sequence, in: repository)
            }
            reply(id, after: sequence, in: repository) { b in
                b.writeRaw(",\"value\":")
                b.writeStored(entry.value)
                b.writeMember(",\"rev\":", entry.revision)
            }
        case .set(let repo, let key, let value, let ifRev, let force):
            write(id, repo: repo, [.set(key, StoredValue(value), ifRevision: ifRev, force: force)], single: true)
        case .delete(let repo, let key, let ifRev):
            write(id, repo: repo, [.delete(key, ifRevision: ifRev)], single: true)
        case .batch(let repo, let ops):
            write(id, repo: repo, ops.map(Self.stored), single: false)
        case .list(let repo, let prefix, let values):
            let repository = hub.existing(repo)
            let (revision, entries, sequence) = repository?.list(prefix: prefix) ?? (0, [], 0)
            reply(id, after: sequence, in: repository) { b in
                b.writeMember(",\"rev\":", revision)
                b.writeRaw(",\"keys\":[")
                for (i, e) in entries.enumerated() {
                    if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                    b.writeJSONString(e.key)
                }
                b.writeByte(UInt8(ascii: "]"))
                if values {
                    b.writeRaw(",\"values\":{")
                    for (i, e) in entries.enumerated() {
                        if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                        b.writeJSONString(e.key)
                        b.writeByte(UInt8(ascii: ":"))
                        b.writeStored(e.value)
                    }
                    b.writeByte(UInt8(ascii: "}"))
                }
            }
        case .repos:
            let repos = hub.listed().map { ($0.name, $0.summary) }
            reply(id) { b in
                b.writeRaw(",\"repos\":[")
                for (i, (name, summary)) in repos.enumerated() {
                    if i > 0 { b.writeByte(UInt8(ascii: ",")) }
                    b.writeMember("{\"name\":", name)
                    b.writeMember(",\"rev\":", summary.revision)
                    b.writeMember(",\"keys\":", UInt64(summary.keys))
                    b.writeByte(UInt8(ascii: "}"))
                }
                b.writeByte(UInt8(ascii: "]"))
            }
        case .subscribe(let request):
            subscribe(id, request)
        case .unsubscribe(let sub):
            guard let subscription = outbox.unregister(sub) else {
                return fail(id: id, ProtocolError(.notFound, "no subscription \(sub) on this connection"))
            }
            hub.subscriptionEnded(subscription)
            reply(id) { _ in }
        case .stats:
            let s = hub.stats
            let uptime = settings.startTime.duration(to: .now)
            reply(id) { b in
                b.writeMember(",\"connections\":", UInt64(s.connections.load(ordering: .relaxed)))
                b.writeMember(",\"subscriptions\":", UInt64(max(0, s.subscriptions.load(ordering: .relaxed))))
                b.writeMember(",\"repos\":", UInt64(hub.repositoryCount))
                b.writeMember(",\"connectionsTotal\":", UInt64(s.connectionsTotal.load(ordering: .relaxed)))
                b.writeMember(",\"requests\":", UInt64(s.requests.load(ordering: .relaxed)))
                b.writeMember(",\"writes\":", UInt64(s.writes.load(ordering: .relaxed)))
                b.writeMember(",\"eventsOut\":", UInt64(s.eventsOut.load(ordering: .relaxed)))
                b.writeMember(",\"bytesOut\":", UInt64(s.bytesOut.load(ordering: .relaxed)))
                b.writeMember(",\"overflows\":", UInt64(s.overflows.load(ordering: .relaxed)))
                b.writeMember(",\"errors\":", UInt64(s.errors.load(ordering: .relaxed)))
                b.writeMember(",\"uptimeSeconds\":", UInt64(max(0, uptime.components.seconds)))
                b.writeMember(",\"storage\":", hub.storage.summary)
                if let c = hub.storage.counters {
                    b.writeMember(",\"storageCommits\":", UInt64(c.commits.load(ordering: .relaxed)))
                    b.writeMember(",\"storageFsyncs\":", UInt64(c.fsyncs.load(ordering: .relaxed)))
                    b.writeMember(",\"storageRecords\":", UInt64(c.records.load(ordering: .relaxed)))
                    b.writeMember(",\"storageFailures\":", UInt64(c.failures.load(ordering: .relaxed)))
                }
                b.writeMember(",\"server\":", "obsd/\(ObsServer.version)")
            }
        }
    }

    private func write(_ id: JSONValue, repo: String, _ ops: [WriteOp<StoredValue>], single: Bool) {
        let now = WallClock.unixSeconds()
        let (repository, result) = hub.using(repo) { repository in
            (repository, Result { () throws(WriteError) in try repository.write(ops, now: now) })
        }
        let outcome: WriteOutcome
        switch result {
        case .success(let o):
            outcome = o
        case .failure(let error):
            let code: ErrorCode = if case .conflict = error { .conflict } else { .badRequest }
            return fail(id: id, ProtocolError(code, error.description), after: repository.sequence, in: repository)
        }
        if outcome.changed { hub.stats.writes.add(1, ordering: .relaxed) }
        reply(id, after: outcome.sequence, in: repository) { b in
            b.writeMember(",\"rev\":", outcome.revision)
            b.writeMember(",\"changed\":", outcome.changed)
            if single, let previous = outcome.previous {
                b.writeRaw(",\"old\":")
                b.writeStored(previous)
            }
        }
    }

    private func subscribe(_ id: JSONValue, _ request: SubscribeRequest) {
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

    // MARK: Replies

    /// Appends a success reply — at once if the state it reports (`sequence`) is durable in
    /// `repository` (or no repository is involved), else in a slot filled when it is.
    private func reply(
        _ id: JSONValue, after sequence: StateSequence = 0, in repository: Repository? = nil, _ members: (inout ByteBuffer) -> Void
    ) {
        scratch.clear()
        ReplyEncoder.begin(&scratch, id: id)
        members(&scratch)
        ReplyEncoder.end(&scratch)
        send(scratch, id: id, after: sequence, in: repository)
    }

    /// Appends an error reply, held back like `reply` when it reports non-durable state.
    private func fail(id: JSONValue, _ error: ProtocolError, after sequence: StateSequence = 0, in repository: Repository? = nil) {
        hub.stats.errors.add(1, ordering: .relaxed)
        scratch.clear()
        ReplyEncoder.error(&scratch, id: id, error)
        send(scratch, id: id, after: sequence, in: repository)
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
    private static func storageFailure(id: JSONValue, _ error: StorageError, repo: String) -> ByteBuffer {
        var buffer = ByteBuffer()
        let message = "storage failure in repository \(repo): the change this reply depends on could not be stored and was undone (\(error.description)); retry once the cause is fixed"
        ReplyEncoder.error(&buffer, id: id, ProtocolError(.internal, message))
        return buffer
    }

    private static func stored(_ op: WriteOp<JSONValue>) -> WriteOp<StoredValue> {
        switch op {
        case .set(let key, let value, let ifRev, let force): return .set(key, StoredValue(value), ifRevision: ifRev, force: force)
        case .delete(let key, let ifRev): return .delete(key, ifRevision: ifRev)
        }
    }
}

@available(*, unavailable)
extension Session: Sendable {}

/// What a session needs to know of the server's configuration.
struct SessionSettings: Sendable {
    var maxLine: Int
    var maxDepth: Int
    var startTime: ContinuousClock.Instant
}
