// ObsServer — subscribing: the reply, then the snapshot or the replay, then `synced` — one
// run of bytes appended to the outbox (past `streamAbove`, a stream encoded as the socket
// takes it: no size is refused), held in a slot while the state it starts from is not
// durable; the subscription is live from the revision it reports.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    /// A subscription's start larger than this (its reply, snapshot or replay, in bytes) is
    /// streamed (OutboxStream.swift) instead of appended whole.
    static let streamAbove = 4 << 20

    func subscribe(_ id: JSONValue, _ request: SubscribeRequest) {
        let number = nextSub
        nextSub += 1
        let now = shard.loop.wallSeconds
        let repository = hub.hold(request.repo)
        defer { hub.release(request.repo) }
        let subscription = Subscription(id: number, repository: repository, connection: connection, request: request)
        let started: (start: RepositoryCore.Start, sequence: StateSequence, registered: Bool)
        do throws(RepositoryCore.StartRefusal) {
            started = try repository.subscribe(subscription, request, now: now)
        } catch {
            switch error {
            case .compacted(let message): return fail(id: id, ProtocolError(.compacted, message))
            case .tooLarge(let message): return fail(id: id, ProtocolError(.tooLarge, message))
            }
        }
        let (start, sequence, registered) = started
        // The run: the reply, then the snapshot (its head, entries and end) or the replay and
        // `synced` — one array, or past `streamAbove` a stream of head, entries and the rest.
        var head: [UInt8] = []
        SubscribeReply(subscription: number, revision: start.revision, epoch: repository.epoch).encode(into: &head, id: id)
        var entries: [(key: Key, value: CanonicalJSON)] = []
        if var snapshot = start.snapshot {
            snapshot.sort { $0.key < $1.key }
            SnapshotEvent<CanonicalJSON>(subscription: number, repository: repository.name, revision: start.revision, entries: []).encodeHead(into: &head)
            entries = snapshot
        }
        // A `once` subscription whose change was replayed ended there: no `synced` follows.
        let synced = request.since != nil && !(request.once && start.replayed > 0)
        let events = (start.snapshot == nil ? 0 : 1) + start.replayed + (synced ? 1 : 0)
        /// What follows the entries.
        func writeRest(_ sink: inout [UInt8]) {
            if start.snapshot != nil { SnapshotEvent<CanonicalJSON>.encodeTail(into: &sink) }
            sink.append(contentsOf: start.replay)
            if synced { SyncedEvent(subscription: number, repository: repository.name, revision: start.revision).encode(into: &sink) }
        }
        let size = head.count + Self.encodedBytes(of: entries, values: true) + start.replay.count
        if size > Self.streamAbove {
            // Large: encoded a piece at a time as the socket takes it (OutboxStream.swift),
            // within the daemon's budget of such copies (StartBudget.swift).
            let limit = limits.maxStartBytes
            guard hub.startBudget.take(size, limit: limit) else {
                if outbox.unregister(subscription.id) != nil { shard.unroute(subscription) }
                return fail(
                    id: id,
                    ProtocolError(
                        .overloaded,
                        "this subscription starts with \(size >> 20) MiB of snapshot or replay, and other subscriptions' large starts hold \(hub.startBudget.bytes >> 20) MiB being sent (limits.max-start-bytes: \(limit >> 20) MiB); nothing was subscribed: retry shortly, or select fewer keys"
                    ))
            }
            var rest: [UInt8] = []
            writeRest(&rest)
            let stream = OutboxStream(head: head, entries: entries, tail: rest, events: events, budget: (hub.startBudget, size))
            if repository.isDurable(sequence) {
                outbox.append(stream)
                shard.markDirty(connection)
            } else {
                hold([], events: events, id: id, until: sequence, in: repository, subscription: registered ? subscription : nil, stream: stream)
            }
            return
        }
        var bytes = head
        for (i, entry) in entries.enumerated() { SnapshotEvent<CanonicalJSON>.encodeMember(entry.key, entry.value, first: i == 0, into: &bytes) }
        writeRest(&bytes)
        if repository.isDurable(sequence) {
            bytes.withUnsafeBytes { outbox.append($0, events: events) }
            shard.markDirty(connection)
        } else {
            hold(bytes, events: events, id: id, until: sequence, in: repository, subscription: registered ? subscription : nil)
        }
    }
}
