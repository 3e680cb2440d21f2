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
        // The run: the reply, then the snapshot (`head` + its entries + `tail`) or the replay
        // and `synced` (`tail`).
        var head: [UInt8] = []
        SubscribeReply(subscription: number, revision: start.revision, epoch: repository.epoch).encode(into: &head, id: id)
        var entries: [(key: Key, value: CanonicalJSON)] = []
        var tail: [UInt8] = []
        var events = 0
        if var snapshot = start.snapshot {
            snapshot.sort { $0.key < $1.key }
            SnapshotEvent<CanonicalJSON>(subscription: number, repository: repository.name, revision: start.revision, entries: []).encodeHead(into: &head)
            entries = snapshot
            SnapshotEvent<CanonicalJSON>.encodeTail(into: &tail)
            events += 1
        }
        tail.append(contentsOf: start.replay)
        events += start.replayed
        // A `once` subscription whose change was replayed ended there: no `synced` follows.
        if request.since != nil, !(request.once && start.replayed > 0) {
            SyncedEvent(subscription: number, repository: repository.name, revision: start.revision).encode(into: &tail)
            events += 1
        }
        let entryBytes = entries.reduce(0) { $0 + 2 * $1.key.utf8Count + 4 + $1.value.bytes.count }
        if head.count + entryBytes + tail.count > Self.streamAbove {
            // Large: encoded a piece at a time as the socket takes it (OutboxStream.swift).
            let stream = OutboxStream(head: head, entries: entries, tail: tail, events: events)
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
        bytes.append(contentsOf: tail)
        if repository.isDurable(sequence) {
            bytes.withUnsafeBytes { outbox.append($0, events: events) }
            shard.markDirty(connection)
        } else {
            hold(bytes, events: events, id: id, until: sequence, in: repository, subscription: registered ? subscription : nil)
        }
    }
}
