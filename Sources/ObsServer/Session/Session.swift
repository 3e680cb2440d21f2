// ObsServer — one connection's requests: access checks, limits, execution against the hub,
// and replies.
//
// A `Session` lives on its connection's event loop and handles requests in order. Every
// request gets exactly one reply, appended to the connection's outbox in request order (see
// Session+Replies.swift for how replies wait for durability). Before each request it picks
// up the current limits and access policy if a reload changed them.

import Logging
import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

final class Session {
    // unowned(unsafe): the connection owns its session and ends it in `close()`; nothing
    // reaches a session but through its connection, on their loop.
    unowned(unsafe) let connection: Connection
    let hub: Hub
    let peer: Peer
    /// The peer as the writer of revisions (`by`).
    let writer: Writer
    let maxLine: Int
    let maxDepth: Int
    let logger: Logger
    var nextSub: UInt64 = 1
    // unowned(unsafe): the connection's own, which outlive the session like the connection.
    unowned(unsafe) let outbox: Outbox
    unowned(unsafe) let shard: LoopShard
    /// The limits and policy this session last read, and what the policy grants per repository.
    var runtime: Runtime.Snapshot
    var permissions: [String: Permission] = [:]
    var deniedCount = 0
    /// The repository this session wrote last, once the hub keeps it for good: a client writes
    /// one repository many times, and this skips the hub's lock and lookup — and, as the peer
    /// was allowed to write it under the current policy, the access check of a single-key
    /// write (forgotten when the policy changes).
    var lastWritten: Repository? {
        didSet { lastWrittenRef = lastWritten.map { Unmanaged.passUnretained($0) } }
    }
    /// Unretained views of `lastWritten` and of the objects this session is given, read on
    /// the single-key write path with `_withUnsafeGuaranteedRef`: `lastWritten` holds the
    /// repository and the connection owns outbox and shard beyond the session's life, so each
    /// view is valid whenever the session runs.
    private var lastWrittenRef: Unmanaged<Repository>?
    private let connectionRef: Unmanaged<Connection>
    private let outboxRef: Unmanaged<Outbox>
    private let shardRef: Unmanaged<LoopShard>
    /// The hub's sequencer (kept here: read through the hub, it was retained per write).
    private let sequencer: any Sequencer
    /// Scratch space the request scanner canonicalizes values into, and where a single-key
    /// write's old value is copied for its reply.
    private var scanValues: [UInt8] = []
    private var singleOld: [UInt8] = []

    /// Why the connection holds its further requests for now, if it does.
    enum Wait {
        /// A request waits for the shared store: its successors take effect after it.
        case cluster
        /// This session wrote while a loop's delivery backlog was at its limit.
        case delivery
    }

    private(set) var waits: Set<Wait> = []
    /// Whether the connection must hold its further requests for now.
    var holdsInput: Bool { !waits.isEmpty }
    /// Writes waiting for the shared store, by token: their reply slots and what they need.
    var pendingWrites: [UInt64: PendingWrite] = [:]
    private var nextToken: UInt64 = 0

    struct PendingWrite {
        let id: JSONValue
        let repository: Repository
        let slot: Outbox.Slot
        let single: Bool
        let held: Bool
    }

    init(connection: Connection, hub: Hub, peer: Peer, limits: Limits, logger: Logger) {
        self.connection = connection
        self.outbox = connection.outbox
        self.shard = connection.shard
        self.connectionRef = Unmanaged.passUnretained(connection)
        self.outboxRef = Unmanaged.passUnretained(connection.outbox)
        self.shardRef = Unmanaged.passUnretained(connection.shard)
        self.sequencer = hub.sequencer
        self.hub = hub
        self.peer = peer
        self.writer = Writer(uid: peer.uid, gid: peer.gid, pid: peer.pid)
        self.maxLine = limits.maxLine
        self.maxDepth = limits.maxDepth
        var logger = logger
        logger[metadataKey: "peer.uid"] = "\(peer.uid)"
        logger[metadataKey: "peer.pid"] = "\(peer.pid)"
        self.logger = logger
        self.runtime = hub.runtime.snapshot
    }

    var limits: Limits { runtime.limits }

    func wait(for reason: Wait) { waits.insert(reason) }

    func resume(from reason: Wait) {
        waits.remove(reason)
        if waits.isEmpty { connection.sessionResumed() }
    }

    // MARK: Input

    /// Handles one frame from the connection.
    func handle(_ frame: LineFramer.Frame) {
        shard.counters.countRequest()
        if hub.runtime.generation != runtime.generation {
            runtime = hub.runtime.snapshot
            permissions.removeAll()
            lastWritten = nil
        }
        switch frame {
        case .tooLarge:
            fail(id: .null, ProtocolError(.tooLarge, "line longer than \(maxLine) bytes; the rest of it is discarded"))
        case .line(let bytes):
            // The fast path reads the common requests in place; a single-key write may not
            // even become a `Request`. What it cannot read, the general decoder does.
            let handled = Request.scan(bytes, maxDepth: maxDepth, values: &scanValues) { scanned in
                if let write = scanned.write, writeSingle(scanned.id, write) { return true }
                guard let request = scanned.request() else { return false }
                execute(request)
                return true
            }
            if handled == true { return }
            do {
                let request = try Request.decodeInGeneral(line: bytes, maxDepth: maxDepth)
                execute(request)
            } catch {
                fail(id: error.id, error.error)
            }
        }
    }

    /// Ends every subscription; called when the connection closes.
    func close() {
        for subscription in outbox.close() { shard.unroute(subscription) }
        for (_, pending) in pendingWrites where pending.held { hub.release(pending.repository.name) }
        pendingWrites.removeAll()
    }

    /// Ends every subscription and keeps the connection for its replies (the client shut
    /// down its sending side: it asks for nothing more).
    func endSubscriptions() {
        for subscription in outbox.unregisterAll() { shard.unroute(subscription) }
    }

    // MARK: Commands

    private func execute(_ request: Request) {
        let id = request.id
        if let repo = request.command.repo {
            let needed: Permission
            switch request.command {
            case .set, .delete, .batch: needed = .write
            default: needed = .read
            }
            guard permits(repo, needed, op: request.command.op, id: id) else { return }
        }
        if let shared = hub.shared, let scope = Self.readScope(request.command) {
            return afterLinearizing(scope, shared) { $0.perform(request) }
        }
        perform(request)
    }

    /// Runs a request whose access was checked.
    func perform(_ request: Request) {
        let id = request.id
        switch request.command {
        case .hello:
            reply(id, HelloReply(server: "obsd/\(ObsServer.version)", maxLine: maxLine))
        case .ping:
            reply(id, EmptyReply())
        case .get(let repo, let key):
            get(id, repo: repo, key: key)
        case .set(let repo, let key, let value, let ifRev, let force):
            guard withinValueLimit(value, key: key, id: id) else { return }
            let lease = request.leases.isEmpty ? nil : request.leases[key]
            write(id, repo: repo, [.set(key, value, ifRevision: ifRev, force: force)], leases: lease.map { [$0] } ?? [], single: true)
        case .delete(let repo, let key, let ifRev):
            write(id, repo: repo, [.delete(key, ifRevision: ifRev)], single: true)
        case .batch(let repo, let ops):
            guard ops.count <= limits.maxKeysPerRequest else {
                return fail(id: id, ProtocolError(.tooLarge, "the batch has \(ops.count) operations; the limit is \(limits.maxKeysPerRequest)"))
            }
            for case .set(let key, let value, _, _) in ops {
                guard withinValueLimit(value, key: key, id: id) else { return }
            }
            // The lease each `set` names, by position (a `delete` detaches).
            let leases: [UInt64?] =
                request.leases.isEmpty ? [] : ops.map { op in if case .set = op { request.leases[op.key] } else { nil } }
            write(id, repo: repo, ops, leases: leases, single: false)
        case .list(let repo, let prefix, let values):
            list(id, repo: repo, prefix: prefix, values: values)
        case .repos:
            // Held until every state it reports is durable, as a `list` is.
            var states: [(any DurableLine, StateSequence)] = []
            let repos = hub.listed().filter { permission($0.name) >= .read }.map { repository in
                let (revision, keys, sequence) = repository.summary
                states.append((repository, sequence))
                return RepositoryInfo(name: repository.name, revision: revision, keys: keys, epoch: repository.epoch)
            }
            var bytes: [UInt8] = []
            ReposReply(repositories: repos).encode(into: &bytes, id: id)
            hold(bytes, id: id, until: states)
        case .subscribe(let request):
            if case .keys(let keys) = request.selection, keys.count > limits.maxKeysPerRequest {
                return fail(id: id, ProtocolError(.tooLarge, "the subscription names \(keys.count) keys; the limit is \(limits.maxKeysPerRequest)"))
            }
            guard outbox.liveCount < limits.maxSubscriptionsPerConnection else {
                return fail(
                    id: id,
                    ProtocolError(.overloaded, "this connection has \(outbox.liveCount) subscriptions; the limit is \(limits.maxSubscriptionsPerConnection)"))
            }
            subscribe(id, request)
        case .unsubscribe(let sub):
            guard let subscription = outbox.unregister(sub) else {
                return fail(id: id, ProtocolError(.notFound, "no subscription \(sub) on this connection"))
            }
            shard.unroute(subscription)
            reply(id, EmptyReply())
        case .stats:
            stats(id)
        case .sync:
            // Decoded (ObsProtocol), not served yet: answered as before the op was known.
            fail(id: id, ProtocolError(.unknownOp, "unknown op \"sync\""))
        case .lease(.grant(let ttl)):
            grant(id, ttl: ttl.map(Int64.init))
        case .lease(.keepalive(let lease)):
            keepAlive(id, lease)
        case .lease(.revoke(let lease)):
            revoke(id, lease)
        }
    }

    private func get(_ id: JSONValue, repo: String, key: Key) {
        guard let repository = hub.existing(repo) else {
            return fail(id: id, ProtocolError(.notFound, "key \(key.debugDescription) does not exist in repository \(repo)"))
        }
        let (entry, sequence) = repository.get(key)
        guard let entry else {
            return fail(
                id: id, ProtocolError(.notFound, "key \(key.debugDescription) does not exist in repository \(repo)"), after: sequence,
                in: repository)
        }
        reply(id, GetReply(value: entry.value, revision: entry.revision, lease: repository.lease(of: key)), after: sequence, in: repository)
    }

    private func list(_ id: JSONValue, repo: String, prefix: String?, values: Bool) {
        let repository = hub.existing(repo)
        var (revision, entries, sequence) = repository?.list(prefix: prefix) ?? (0, [], 0)
        if let refusal = Self.tooLargeToSend(entries, values: values, what: "this list") { return fail(id: id, refusal) }
        entries.sort { $0.key < $1.key }  // outside the repository's lock
        let listing = ListReply(
            revision: revision, epoch: repository?.epoch ?? hub.freshEpoch, keys: entries.map(\.key),
            valuesInKeyOrder: values ? entries.map(\.value) : nil)
        reply(id, listing, after: sequence, in: repository)
    }

    // MARK: Writing

    private func write(_ id: JSONValue, repo: String, _ ops: [WriteOp<CanonicalJSON>], leases: [UInt64?] = [], single: Bool) {
        let limits = self.limits
        let request = WriteRequest(
            ops: ops, limits: WriteLimits(maxKeys: limits.maxKeysPerRepository, maxRevisionBytes: limits.maxRevisionBytes),
            maxRepositories: limits.maxRepositories, peer: peer, writer: writer, origin: outbox.connection, time: shard.loop.wallSeconds,
            leases: leases)
        // A repository the hub keeps for good needs no hold; any other is held while the
        // write is under way (a write that changes nothing leaves no repository behind).
        let repository: Repository
        let held: Bool
        if let last = lastWritten, last.name == repo {
            (repository, held) = (last, false)
        } else {
            repository = hub.hold(repo)
            held = true
        }
        nextToken += 1
        let token = nextToken
        if let result = sequencer.submit(request, to: repository, route: connection.answers, token: token) {
            if held { hub.release(repo) }
            if repository.isPermanent { lastWritten = repository }
            answerWrite(id, repository, result, single: single)
            holdForDelivery()
            return
        }
        // Decided later: its reply holds its place, and the connection's later requests wait
        // for it, so they take effect in the order they were sent and each sees the ones before.
        pendingWrites[token] = PendingWrite(id: id, repository: repository, slot: outbox.reserveSlot(), single: single, held: held)
        wait(for: .cluster)
    }

    /// A single-key write read in place, decided here and now when the sequencer can (the
    /// repository this session writes, a success): applied and answered with no `Request`,
    /// `WriteOp` or value copied. False, with nothing applied: the general path takes it.
    private func writeSingle(_ id: JSONValue, _ scanned: ScannedWrite) -> Bool {
        // Every reference is read through `_withUnsafeGuaranteedRef` (see `lastWrittenRef`):
        // as plain loads, the optimizer retained and released six objects per write here,
        // 6 % of the daemon's time at fan-out 1.
        guard let last = lastWrittenRef else { return false }
        return last._withUnsafeGuaranteedRef { repository in
            guard repository.hasName(scanned.repo) else { return false }
            let limits = self.limits
            if let value = scanned.value, value.count > limits.maxValueBytes { return false }
            let write = SingleWrite(key: scanned.key, value: scanned.value, isPlain: scanned.isPlain, ifRevision: scanned.ifRev, force: scanned.force)
            // The old value's buffer, moved out for the write: read as this class's stored
            // property, it was retained and released around every reply.
            var singleOld: [UInt8] = []
            swap(&singleOld, &self.singleOld)
            defer { swap(&singleOld, &self.singleOld) }
            return shardRef._withUnsafeGuaranteedRef { shard in
                outboxRef._withUnsafeGuaranteedRef { outbox in
                    guard
                        let outcome = sequencer.submitSingle(
                            write, to: repository,
                            limits: WriteLimits(maxKeys: limits.maxKeysPerRepository, maxRevisionBytes: limits.maxRevisionBytes),
                            writer: writer, origin: outbox.connection, time: shard.loop.wallSeconds, old: &singleOld)
                    else { return false }
                    if outcome.changed { shard.counters.countWrite() }
                    singleOld.withUnsafeBytes { old in
                        let old = outcome.existed ? old : nil
                        if repository.isDurable(outcome.sequence) {
                            outbox.appendReply {
                                WriteReply<CanonicalJSON>.encode(into: &$0, id: id, revision: outcome.revision, changed: outcome.changed, canonicalOld: old)
                            }
                            connectionRef._withUnsafeGuaranteedRef { connection in
                                if !connection.isDirty { shard.markDirty(connection) }
                            }
                        } else {
                            var bytes: [UInt8] = []
                            bytes.reserveCapacity(64 + (old?.count ?? 0))
                            WriteReply<CanonicalJSON>.encode(into: &bytes, id: id, revision: outcome.revision, changed: outcome.changed, canonicalOld: old)
                            hold(bytes, id: id, until: outcome.sequence, in: repository)
                        }
                    }
                    holdForDelivery()
                    return true
                }
            }
        }
    }

    /// A write decided later is answered (on this loop).
    func answered(_ token: UInt64, _ result: WriteDecision) {
        guard let pending = pendingWrites.removeValue(forKey: token) else { return }
        var reply: [UInt8] = []
        encodeWrite(&reply, pending.id, pending.repository.name, result, single: pending.single)
        outbox.fill(pending.slot, with: reply)
        if pending.held { hub.release(pending.repository.name) }
        shard.markDirty(connection)
        if !holdForDelivery() { resume(from: .cluster) } else { waits.remove(.cluster) }
    }

    /// After a write: holds the connection's further requests while a loop's delivery backlog
    /// is at its limit, until it is down; whether it did.
    @discardableResult
    func holdForDelivery() -> Bool {
        guard let backlogged = hub.backloggedShard else { return false }
        wait(for: .delivery)
        hub.stats.writersHeld.add(1, ordering: .relaxed)
        let ref = ConnectionRef(connection)
        backlogged.whenDrained {
            ref.loop.execute { ref.session?.resume(from: .delivery) }
        }
        return true
    }

    /// The most one reply (or a subscription's first messages) may hold.
    static let maxMessageBytes = 1 << 30

    /// `too_large`, when sending `entries` (their keys, and values if asked) would take more
    /// than `maxMessageBytes`.
    static func tooLargeToSend(
        _ entries: [(key: Key, value: CanonicalJSON)], values: Bool, what: String, limit: Int = maxMessageBytes
    ) -> ProtocolError? {
        guard encodedBytes(of: entries, values: values) > limit else { return nil }
        return ProtocolError(
            .tooLarge,
            "\(what) would take more than \(limit >> 20) MiB of keys\(values ? " and values" : ""), the most one message holds: select fewer keys (a prefix, or keys)"
        )
    }

    /// About how many bytes `entries` take encoded (keys quoted, and values if asked).
    static func encodedBytes(of entries: [(key: Key, value: CanonicalJSON)], values: Bool) -> Int {
        entries.reduce(0) { $0 + 2 * $1.key.utf8Count + 4 + (values ? $1.value.bytes.count : 0) }
    }

    /// Whether the value's encoding is within the limit; if not, replies `too_large`.
    private func withinValueLimit(_ value: CanonicalJSON, key: Key, id: JSONValue) -> Bool {
        guard value.bytes.count > limits.maxValueBytes else { return true }
        fail(
            id: id,
            ProtocolError(.tooLarge, "the value of key \(key.debugDescription) is \(value.bytes.count) bytes of JSON; the limit is \(limits.maxValueBytes)"))
        return false
    }
}

@available(*, unavailable)
extension Session: Sendable {}
