// ObsServer — one connection's requests: execution against the hub and reply encoding.
//
// A `Session` lives on its connection's event loop and handles requests in order. Every
// request gets exactly one reply, appended to the connection's outbox in request order.

import Logging
import NIOCore
import ObsProtocol
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
            guard let entry = hub.existing(repo)?.get(key) else {
                return fail(id: id, ProtocolError(.notFound, "key \(key.debugDescription) does not exist in repository \(repo)"))
            }
            reply(id) { b in
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
            let (revision, entries) = hub.existing(repo)?.list(prefix: prefix) ?? (0, [])
            reply(id) { b in
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
                b.writeMember(",\"server\":", "obsd/\(ObsServer.version)")
            }
        }
    }

    private func write(_ id: JSONValue, repo: String, _ ops: [WriteOp<StoredValue>], single: Bool) {
        let outcome: WriteOutcome
        do {
            outcome = try hub.using(repo) { (repository) throws(WriteError) in try repository.write(ops) }
        } catch .conflict(let key, let expected, let actual) {
            return fail(id: id, ProtocolError(.conflict, WriteError.conflict(key: key, expected: expected, actual: actual).description))
        } catch {
            return fail(id: id, ProtocolError(.badRequest, error.description))
        }
        if outcome.changed { hub.stats.writes.add(1, ordering: .relaxed) }
        reply(id) { b in
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
        do {
            try hub.using(request.repo) { (repository) throws(ProtocolError) in
                let subscription = Subscription(id: number, repository: repository, outbox: outbox, once: request.once)
                let (slot, bytes, events) = try repository.subscribe(subscription, request, replyID: id)
                outbox.fill(slot, with: bytes, events: events)
            }
        } catch {
            fail(id: id, error)
        }
    }

    // MARK: Replies

    private func reply(_ id: JSONValue, _ members: (inout ByteBuffer) -> Void) {
        scratch.clear()
        ReplyEncoder.begin(&scratch, id: id)
        members(&scratch)
        ReplyEncoder.end(&scratch)
        outbox.append(scratch)
    }

    private func fail(id: JSONValue, _ error: ProtocolError) {
        hub.stats.errors.add(1, ordering: .relaxed)
        scratch.clear()
        ReplyEncoder.error(&scratch, id: id, error)
        outbox.append(scratch)
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
