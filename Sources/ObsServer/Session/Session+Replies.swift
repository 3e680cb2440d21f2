// ObsServer — how a session replies: encoding straight into the outbox, and holding a reply
// back until the state it reports is durable (in an outbox slot, so order is kept).
//
// A reply that reports state at a revision not yet durable holds its place in the outbox and
// is sent when storage confirms that revision — or replaced by an error if storage fails and
// the revision is undone. So nothing a client is told can be lost.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    /// Appends a success reply — encoded into the outbox at once if the state it reports
    /// (`sequence`) is durable in `repository` (or no repository is involved), else held in a
    /// slot until it is.
    func reply(_ id: JSONValue, after sequence: StateSequence = 0, in repository: Repository? = nil, _ members: (inout ByteQueue) -> Void) {
        if let repository, !repository.isDurable(sequence) {
            var bytes = ByteQueue()
            Self.encode(&bytes, id: id, members)
            return bytes.withUnsentBytes { hold(Array($0), id: id, until: sequence, in: repository) }
        }
        outbox.appendReply { Self.encode(&$0, id: id, members) }
        shard.markDirty(connection)
    }

    /// Appends a typed reply (see `reply(_:after:in:_:)`). One held back is encoded straight
    /// into the array its slot keeps (no queue to copy it out of).
    func reply(_ id: JSONValue, _ message: some ReplyMessage, after sequence: StateSequence = 0, in repository: Repository? = nil) {
        if let repository, !repository.isDurable(sequence) {
            var bytes: [UInt8] = []
            bytes.reserveCapacity(128)
            message.encode(into: &bytes, id: id)
            return hold(bytes, id: id, until: sequence, in: repository)
        }
        outbox.appendReply { message.encode(into: &$0, id: id) }
        shard.markDirty(connection)
    }

    /// Appends an error reply, held back like `reply` when it reports non-durable state.
    func fail(id: JSONValue, _ error: ProtocolError, after sequence: StateSequence = 0, in repository: Repository? = nil) {
        hub.stats.errors.add(1, ordering: .relaxed)
        if let repository, !repository.isDurable(sequence) {
            var bytes: [UInt8] = []
            ReplyEncoder.error(&bytes, id: id, error)
            return hold(bytes, id: id, until: sequence, in: repository)
        }
        outbox.appendReply { ReplyEncoder.error(&$0, id: id, error) }
        shard.markDirty(connection)
    }

    private static func encode(_ sink: inout ByteQueue, id: JSONValue, _ members: (inout ByteQueue) -> Void) {
        ReplyEncoder.begin(&sink, id: id)
        members(&sink)
        ReplyEncoder.end(&sink)
    }

    /// Queues `bytes` in a slot, sent once `sequence` of `line` is durable (or replaced by an
    /// error if it is undone — `failure`'s, else the plain storage failure; a subscription that
    /// began there ends). (`stream`: a large subscription start, sent as that stream instead
    /// of `bytes`.)
    func hold<Line: DurableLine>(
        _ bytes: [UInt8], events: Int = 0, id: JSONValue, until sequence: StateSequence, in line: Line,
        subscription: Subscription? = nil, stream: OutboxStream? = nil, failure: (@Sendable (StorageError) -> [UInt8])? = nil
    ) {
        let slot = outbox.reserveSlot()
        switch line.awaitDurable(sequence, on: shard) {
        case .durable:
            if let stream { outbox.fill(slot, with: stream) } else { outbox.fill(slot, with: bytes, events: events) }
        case .pending:
            shard.wait(
                LoopShard.Waiter(
                    sequence: sequence, connection: connection, slot: slot, bytes: bytes, events: events, id: id, subscription: subscription,
                    stream: stream, failure: failure),
                on: line)
        case .failed(let error):
            if let subscription { shard.end(subscription.id, of: outbox) }
            outbox.fill(slot, with: failure?(error) ?? Replies.storageFailure(id: id, error, in: line.subject))
        }
        shard.markDirty(connection)
    }

    /// Queues `bytes` in a slot, sent once every listed state is durable (or replaced by an
    /// error if one is undone, as `hold(_:events:id:until:in:)` does) — a reply that reports
    /// states of several lines (a `revoke`: the lease table's, and each repository's).
    func hold(
        _ bytes: [UInt8], id: JSONValue, until states: [(any DurableLine, StateSequence)], failure: (@Sendable (StorageError) -> [UInt8])? = nil
    ) {
        let pending = states.filter { !$0.0.isDurable($0.1) }
        if pending.isEmpty {
            bytes.withUnsafeBytes { outbox.append($0) }
            return shard.markDirty(connection)
        }
        let slot = outbox.reserveSlot()
        let group = WaitGroup(remaining: pending.count)
        for (line, sequence) in pending {
            switch line.awaitDurable(sequence, on: shard) {
            case .durable:
                group.remaining -= 1
            case .pending:
                shard.wait(
                    LoopShard.Waiter(
                        sequence: sequence, connection: connection, slot: slot, bytes: bytes, events: 0, id: id, subscription: nil, group: group,
                        failure: failure),
                    on: line)
            case .failed(let error):
                if !group.failed { outbox.fill(slot, with: failure?(error) ?? Replies.storageFailure(id: id, error, in: line.subject)) }
                group.failed = true
            }
        }
        if group.remaining == 0, !group.failed { outbox.fill(slot, with: bytes) }
        shard.markDirty(connection)
    }

    // MARK: Writes

    /// Replies to a write that succeeded, once the state it reports is durable: straight into
    /// the outbox if it is, else held in a slot. `old`: the value a single-key write replaced
    /// (canonical bytes), if its reply carries one.
    @inline(__always)
    func answerWrite(_ id: JSONValue, _ outcome: WriteOutcome, old: UnsafeRawBufferPointer?, in repository: Repository) {
        if repository.isDurable(outcome.sequence) {
            outboxRef._withUnsafeGuaranteedRef { outbox in
                outbox.appendReply {
                    WriteReply<CanonicalJSON>.encode(into: &$0, id: id, revision: outcome.revision, changed: outcome.changed, canonicalOld: old)
                }
            }
            connectionRef._withUnsafeGuaranteedRef { connection in
                if !connection.isDirty { shardRef._withUnsafeGuaranteedRef { $0.markDirty(connection) } }
            }
        } else {
            var bytes: [UInt8] = []
            bytes.reserveCapacity(64 + (old?.count ?? 0))
            WriteReply<CanonicalJSON>.encode(into: &bytes, id: id, revision: outcome.revision, changed: outcome.changed, canonicalOld: old)
            hold(bytes, id: id, until: outcome.sequence, in: repository)
        }
    }

    /// Encodes the whole reply to a write decided later (its state is current: shown at once),
    /// with `previous`, the value a single-key write replaced or left in place.
    func encodeWrite(_ sink: inout [UInt8], _ id: JSONValue, _ repo: String, _ result: WriteDecision, previous: CanonicalJSON?) {
        switch result {
        case .success(let outcome):
            if outcome.changed { shard.counters.countWrite() }
            let old = outcome.existed ? previous : nil
            (old?.bytes ?? []).withUnsafeBytes { bytes in
                WriteReply<CanonicalJSON>.encode(into: &sink, id: id, revision: outcome.revision, changed: outcome.changed, canonicalOld: old == nil ? nil : bytes)
            }
        case .failure(let failure):
            hub.stats.errors.add(1, ordering: .relaxed)
            ReplyEncoder.error(&sink, id: id, Self.protocolError(failure, repo: repo))
        }
    }

    /// The error reply for a write that failed.
    static func protocolError(_ failure: WriteFailure, repo: String) -> ProtocolError {
        switch failure {
        case .refused(.conflict(let key, let expected, let actual), _):
            // The contract's words for a failed condition, as the in-process model says them.
            return ProtocolError(.conflict, WriteError.conflict(key: key, expected: expected, actual: actual).description)
        case .refused(.tooManyKeys(let limit), _):
            return ProtocolError(.overloaded, "repository \(repo) would hold more than \(limit) keys")
        case .refused(.revisionTooLarge(let bytes, let limit), _):
            return ProtocolError(
                .tooLarge,
                "this write's revision would carry \(bytes) bytes of keys and old and new values; the limit is \(limit) (limits.max-revision-bytes): split it into smaller batches")
        case .tooManyRepositories(let limit):
            return ProtocolError(.overloaded, "creating repository \(repo) would exceed the limit of \(limit) repositories")
        case .storageClosed:
            return ProtocolError(.internal, "the daemon is stopping and takes no more writes; nothing was applied")
        case .shared(let failure):
            return ProtocolError(failure.kind == .tooLarge ? .tooLarge : .internal, failure.message)
        case .lease(let refusal):
            return refusal.protocolError
        }
    }

    // MARK: Reads in etcd mode

    /// The repositories a request reads (nil: it reads no repository state).
    func readScope(_ command: Command) -> SharedScope? {
        switch command {
        case .get(let repo, _), .list(let repo, _, _): .repository(repo)
        case .subscribe(let request): .repository(request.repo)
        case .repos: .all
        // A `sync` reads its subscription's repository (an unknown `sub` is answered at once).
        case .sync(let sub): outbox.live[sub].map { .repository($0.repository.name) }
        default: nil
        }
    }

    /// Runs `body` on this session's loop once this daemon's state of `scope` includes every
    /// revision committed before now (or the cluster could not say so quickly — then it is
    /// answered from the state held here, as etcd's serializable reads are), holding the
    /// connection's later requests meanwhile.
    func afterLinearizing(_ scope: SharedScope, _ shared: any SharedStorage, _ body: @escaping (Session) -> Void) {
        afterStore { await shared.linearize(scope) } then: { session, _ in body(session) }
    }
}

/// Carries a loop-confined closure to a task that hands it back to the loop.
struct UncheckedSendableBox<Value>: @unchecked Sendable {
    // @unchecked Sendable: the value is created on a loop and called only back on that loop
    // (the one `afterStore` hops to); the task in between only holds it.
    let value: Value
    init(_ value: Value) { self.value = value }
}

/// Replies the daemon makes outside a session's flow.
enum Replies {
    /// The reply to a request whose outcome storage could not keep — or, for
    /// `.outcomeUnknown`, could not say whether it kept (a restart may apply it) — in
    /// `subject` ("repository ui", "the lease table").
    static func storageFailure(id: JSONValue, _ error: StorageError, in subject: String) -> [UInt8] {
        let message =
            error.kind == .outcomeUnknown
            ? "storage failure in \(subject): the change this reply depends on may or may not have been stored: its outcome is unknown (\(error.description)); read after obsd restarts before retrying"
            : "storage failure in \(subject): the change this reply depends on could not be stored and was undone (\(error.description)); retry once the cause is fixed"
        var bytes: [UInt8] = []
        ReplyEncoder.error(&bytes, id: id, ProtocolError(.internal, message))
        return bytes
    }
}
