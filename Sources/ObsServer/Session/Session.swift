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
    let connectionRef: Unmanaged<Connection>
    let outboxRef: Unmanaged<Outbox>
    let shardRef: Unmanaged<LoopShard>
    /// The hub's sequencer (kept here: read through the hub, it was retained per write).
    private let sequencer: any Sequencer
    /// Scratch space the request scanner canonicalizes values into, and what writes reuse
    /// (their plans; where a single-key write's old value is copied for its reply).
    private var scanValues: [UInt8] = []
    private let scratch = WriteScratch()
    private let scratchRef: Unmanaged<WriteScratch>

    /// Why the connection holds its further requests for now, if it does.
    enum Wait {
        /// A request waits for the shared store: its successors take effect after it.
        case cluster
        /// This session wrote while a loop's delivery backlog was at its limit.
        case delivery
        /// A `sync` waits for its subscription's events (Session+Sync.swift).
        case sync
    }

    private(set) var waits: Set<Wait> = []
    /// Whether the connection must hold its further requests for now.
    var holdsInput: Bool { !waits.isEmpty }
    /// The `sync` waiting for its subscription's events, if one is (Session+Sync.swift).
    var pendingSync: PendingSync?
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
        self.scratchRef = Unmanaged.passUnretained(scratch)
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
            // The fast path reads the common requests in place; a write to the repository this
            // session writes may not even become a `Request`. What it cannot read, the general
            // decoder does.
            let handled = Request.scan(bytes, maxDepth: maxDepth, values: &scanValues) { scanned in
                if scanned.withWrite({ repo, single, ops in writeInPlace(scanned.id, repo, single, ops) }) == true { return true }
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
        pendingSync = nil
        shard.end(allOf: outbox, closing: true)
        for (_, pending) in pendingWrites where pending.held { hub.repositories.release(pending.repository.name) }
        pendingWrites.removeAll()
    }

    /// Ends every subscription and keeps the connection for its replies (the client shut
    /// down its sending side: it asks for nothing more).
    func endSubscriptions() {
        shard.end(allOf: outbox, closing: false)
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
        if let barrier = hub.readBarrier, let scope = readScope(request.command) {
            return afterLinearizing(scope, barrier) { $0.perform(request) }
        }
        perform(request)
    }

    /// Runs a request whose access was checked.
    func perform(_ request: Request) {
        let id = request.id
        switch request.command {
        case .hello:
            reply(id, HelloReply(server: "obsd/\(Server.version)", maxLine: maxLine))
        case .ping:
            reply(id, EmptyReply())
        case .get(let repo, let key):
            get(id, repo: repo, key: key)
        case .set(let repo, let key, let value, let ifRev, let force):
            let lease = request.leases.isEmpty ? nil : request.leases[key]
            write(id, repo: repo, WriteOps([.set(key, value, ifRevision: ifRev, force: force)], leases: [lease]), single: true)
        case .delete(let repo, let key, let ifRev):
            write(id, repo: repo, WriteOps([.delete(key, ifRevision: ifRev)]), single: true)
        case .batch(let repo, let ops):
            // The lease each `set` names, by position (a `delete` detaches).
            let leases: [UInt64?] =
                request.leases.isEmpty ? [] : ops.map { op in if case .set = op { request.leases[op.key] } else { nil } }
            write(id, repo: repo, WriteOps(ops, leases: leases), single: false)
        case .list(let repo, let prefix, let values):
            list(id, repo: repo, prefix: prefix, values: values)
        case .repos:
            // Held until every state it reports is durable, as a `list` is.
            var states: [(any DurableLine, StateSequence)] = []
            let repos = hub.repositories.listed().filter { permission($0.name) >= .read }.map { repository in
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
            guard shard.end(sub, of: outbox) != nil else {
                return fail(id: id, ProtocolError(.notFound, "no subscription \(sub) on this connection"))
            }
            reply(id, EmptyReply())
        case .stats:
            stats(id)
        case .sync(let sub):
            sync(id, sub)
        case .lease(.grant(let ttl)):
            grant(id, ttl: ttl.map(Int64.init))
        case .lease(.keepalive(let lease)):
            keepAlive(id, lease)
        case .lease(.revoke(let lease)):
            revoke(id, lease)
        }
    }

    private func get(_ id: JSONValue, repo: String, key: Key) {
        guard let repository = hub.repositories.existing(repo) else {
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
        let repository = hub.repositories.existing(repo)
        var (revision, entries, sequence) = repository?.list(prefix: prefix) ?? (0, [], 0)
        if let refusal = Self.tooLargeToSend(entries, values: values, what: "this list") { return fail(id: id, refusal) }
        entries.sort { $0.key < $1.key }  // outside the repository's lock
        let listing = ListReply(
            revision: revision, epoch: repository?.epoch ?? hub.freshEpoch, keys: entries.map(\.key),
            valuesInKeyOrder: values ? entries.map(\.value) : nil)
        reply(id, listing, after: sequence, in: repository)
    }

    // MARK: Writing

    /// A write the general decoder read (its access was checked): its operations, copied into
    /// one buffer, go the one way every write goes.
    private func write(_ id: JSONValue, repo: String, _ ops: WriteOps, single: Bool) {
        // A repository the hub keeps for good needs no hold; any other is held while the
        // write is under way (a write that changes nothing leaves no repository behind).
        let held = lastWritten?.name != repo
        let repository = held ? hub.repositories.hold(repo) : lastWritten!
        ops.withRawOps { write(id, ops: $0, to: repository, held: held, single: single) }
    }

    /// A write — `set`, `delete`, `batch` — read in place, to the repository this session wrote
    /// last (whose write access it was granted under the current policy): it goes the one way
    /// every write goes with nothing copied out of the request, no `Request` made. False, with
    /// nothing done, for any other repository: the general decoder and the access check take it.
    private func writeInPlace(_ id: JSONValue, _ repo: UnsafeRawBufferPointer, _ single: Bool, _ ops: UnsafeBufferPointer<RawWriteOp>) -> Bool {
        // Read through `_withUnsafeGuaranteedRef` (see `lastWrittenRef`): as plain loads, the
        // optimizer retained and released the objects a write passes through.
        guard let last = lastWrittenRef, last._withUnsafeGuaranteedRef({ $0.hasName(repo) }) else { return false }
        last._withUnsafeGuaranteedRef { repository in write(id, ops: ops, to: repository, held: false, single: single) }
        return true
    }

    /// The one write path: every `set`, `delete` and `batch`, its operations read in place —
    /// checked against the request limits, handed to the sequencer, answered once what it
    /// reports is durable. `held`: the repository is held for it (and released here).
    private func write(_ id: JSONValue, ops: UnsafeBufferPointer<RawWriteOp>, to repository: Repository, held: Bool, single: Bool) {
        let limits = self.limits
        if let refusal = Self.refusal(ops, limits) {
            if held { hub.repositories.release(repository.name) }
            return fail(id: id, refusal)
        }
        nextToken += 1
        let token = nextToken
        // The scratch space and the shard read unretained (the session holds them beyond any
        // write): as plain loads they were retained and released around every reply.
        scratchRef._withUnsafeGuaranteedRef { scratch in
            shardRef._withUnsafeGuaranteedRef { shard in
                let input = WriteInput(
                    ops: ops,
                    context: WriteContext(
                        limits: WriteLimits(maxKeys: limits.maxKeysPerRepository, maxRevisionBytes: limits.maxRevisionBytes),
                        maxRepositories: limits.maxRepositories, peer: peer, writer: writer, origin: connection.id, time: shard.loop.wallSeconds,
                        single: single))
                guard let result = sequencer.submit(input, to: repository, scratch: scratch, route: { connection.answers }, token: token) else {
                    // Decided later: its reply holds its place, and the connection's later requests
                    // wait for it, so they take effect in the order they were sent and each sees the
                    // ones before.
                    pendingWrites[token] = PendingWrite(id: id, repository: repository, slot: outbox.reserveSlot(), single: single, held: held)
                    return wait(for: .cluster)
                }
                if held { hub.repositories.release(repository.name) }
                if lastWrittenRef?.toOpaque() != Unmanaged.passUnretained(repository).toOpaque(), repository.isPermanent { lastWritten = repository }
                switch result {
                case .success(let outcome):
                    if outcome.changed { shard.counters.countWrite() }
                    scratch.old.withUnsafeBytes { old in answerWrite(id, outcome, old: single && outcome.existed ? old : nil, in: repository) }
                case .failure(let failure):
                    // A refusal reports the state it was checked against, named by the check
                    // itself: read afterwards, the sequence could already be the durable one an
                    // undo went back to, and a conflict with a write that never happened would
                    // be shown (found by the robustness suite under a full disk).
                    if case .refused(_, let checked) = failure {
                        fail(id: id, Self.protocolError(failure, repo: repository.name), after: checked, in: repository)
                    } else {
                        fail(id: id, Self.protocolError(failure, repo: repository.name))
                    }
                }
                holdForDelivery()
            }
        }
    }

    /// The request limits a write's operations pass (nil), or the refusal: too many
    /// operations, a value too large.
    private static func refusal(_ ops: UnsafeBufferPointer<RawWriteOp>, _ limits: Limits) -> ProtocolError? {
        if ops.count > 1, ops.count > limits.maxKeysPerRequest {
            return ProtocolError(.tooLarge, "the batch has \(ops.count) operations; the limit is \(limits.maxKeysPerRequest)")
        }
        for op in ops {
            guard let value = op.value, value.count > limits.maxValueBytes else { continue }
            let key = Key(String(decoding: op.key, as: UTF8.self))
            return ProtocolError(
                .tooLarge, "the value of key \(key.debugDescription) is \(value.count) bytes of JSON; the limit is \(limits.maxValueBytes)")
        }
        return nil
    }

    /// A write decided later is answered (on this loop).
    func answered(_ token: UInt64, _ result: WriteDecision, previous: CanonicalJSON?) {
        guard let pending = pendingWrites.removeValue(forKey: token) else { return }
        var reply: [UInt8] = []
        encodeWrite(&reply, pending.id, pending.repository.name, result, previous: pending.single ? previous : nil)
        outbox.fill(pending.slot, with: reply)
        if pending.held { hub.repositories.release(pending.repository.name) }
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

}

@available(*, unavailable)
extension Session: Sendable {}
