// ObsServer — subscribing: the reply, then the state it starts with (a snapshot, or a
// catch-up's diff) or the replay, then `synced` — one run of bytes appended to the outbox (past
// `streamAbove`, or with a state too large to read at once, a stream encoded as the socket
// takes it: no size is refused), held in a slot while the state it starts from is not
// durable; the subscription is live from the revision it reports.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    /// A subscription's start larger than this (its reply, state or replay, in bytes) is
    /// streamed (OutboxStream.swift) instead of appended whole.
    static let streamAbove = 4 << 20

    func subscribe(_ id: JSONValue, _ request: SubscribeRequest) {
        let number = nextSub
        nextSub += 1
        let now = shard.loop.wallSeconds
        let repository = hub.repositories.hold(request.repo)
        defer { hub.repositories.release(request.repo) }
        let subscription = Subscription(id: number, repository: repository, connection: connection, request: request)
        let started: Repository.Started
        do throws(RepositoryCore.StartRefusal) {
            started = try repository.subscribe(subscription, request, on: shard, now: now, firstBytes: Self.streamAbove)
        } catch {
            switch error {
            case .compacted(let message): return fail(id: id, ProtocolError(.compacted, message))
            }
        }
        let start = started.start
        // The run: the reply, the state event's head and first members (its other members read
        // later, if it has more), then its end, the replay and `synced`.
        var head: [UInt8] = []
        SubscribeReply(subscription: number, revision: start.revision, epoch: repository.epoch, catchup: start.catchUp).encode(into: &head, id: id)
        switch start.state?.kind {
        case .snapshot:
            SnapshotEvent<CanonicalJSON>(subscription: number, repository: repository.name, revision: start.revision, entries: []).encodeHead(into: &head)
        case .diff(let from, _):
            CatchUpEvent<CanonicalJSON>(subscription: number, repository: repository.name, from: from, revision: start.revision, entries: [], deleted: [])
                .encodeHead(into: &head)
        case nil:
            break
        }
        head.append(contentsOf: started.members)
        // A `once` subscription whose change was replayed ended there: no `synced` follows.
        let synced = request.since != nil && !(request.once && start.replayed > 0)
        let events = (start.state == nil ? 0 : 1) + start.replayed + (synced ? 1 : 0)
        var rest: [UInt8] = []
        switch start.state?.kind {
        case .snapshot:
            SnapshotEvent<CanonicalJSON>.encodeTail(into: &rest)
        case .diff(_, let deleted):
            CatchUpEvent<CanonicalJSON>.encodeDeletedHead(into: &rest)
            for (i, key) in deleted.enumerated() { CatchUpEvent<CanonicalJSON>.encodeDeleted(key, first: i == 0, into: &rest) }
            CatchUpEvent<CanonicalJSON>.encodeTail(into: &rest)
        case nil:
            break
        }
        rest.append(contentsOf: start.replay)
        if synced { SyncedEvent(subscription: number, repository: repository.name, revision: start.revision).encode(into: &rest) }

        if let reader = started.reader {
            let state = StateSource(
                repository: repository, reader: reader, keys: started.keys, next: started.next, sorted: started.sorted, first: started.members.isEmpty)
            return send(OutboxStream(head: head, state: state, tail: rest, events: events), id: id, started: started, subscription: subscription, in: repository)
        }
        if head.count + rest.count > Self.streamAbove {
            // A large replay — a copy of history records — streams within the daemon's budget of
            // such copies (StartBudget.swift); a subscription that asked to be caught up is never
            // refused for it (its copy is bounded by the history's limits).
            let size = head.count + rest.count
            let limit = limits.maxStartBytes
            guard request.catchup || hub.startBudget.take(size, limit: limit) else {
                shard.end(subscription.id, of: outbox)
                return fail(
                    id: id,
                    ProtocolError(
                        .overloaded,
                        "this subscription starts with \(size >> 20) MiB of replay, and other subscriptions' large starts hold \(hub.startBudget.bytes >> 20) MiB being sent (limits.max-start-bytes: \(limit >> 20) MiB); nothing was subscribed: retry shortly, resume with catchup: true, or select fewer keys"
                    ))
            }
            let budget = request.catchup ? nil : (hub.startBudget, size)
            return send(OutboxStream(head: head, tail: rest, events: events, budget: budget), id: id, started: started, subscription: subscription, in: repository)
        }
        var bytes = head
        bytes.append(contentsOf: rest)
        if repository.isDurable(started.sequence) {
            bytes.withUnsafeBytes { outbox.append($0, events: events) }
            shard.markDirty(connection)
        } else {
            hold(bytes, events: events, id: id, until: started.sequence, in: repository, subscription: started.registered ? subscription : nil)
        }
    }

    /// Queues a start streamed: at once if the state it reports is durable, else in a slot.
    private func send(_ stream: OutboxStream, id: JSONValue, started: Repository.Started, subscription: Subscription, in repository: Repository) {
        if repository.isDurable(started.sequence) {
            outbox.append(stream)
            shard.markDirty(connection)
        } else {
            hold([], events: stream.events, id: id, until: started.sequence, in: repository, subscription: started.registered ? subscription : nil, stream: stream)
        }
    }
}
