// ObsServer — subscribing: the reply, then the snapshot or the replay, then `synced` — one
// run of bytes appended to the outbox, held in a slot while the state it starts from is not
// durable; the subscription is live from the revision it reports.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
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
        if let refusal = Self.tooLargeToSend(start.snapshot ?? [], values: true, what: "this subscription's snapshot") {
            if registered, outbox.unregister(subscription.id) != nil { shard.unroute(subscription) }
            return fail(id: id, refusal)
        }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(128 + start.replay.count)
        SubscribeReply(subscription: number, revision: start.revision, epoch: repository.epoch).encode(into: &bytes, id: id)
        var events = 0
        if var snapshot = start.snapshot {
            snapshot.sort { $0.key < $1.key }
            SnapshotEvent(subscription: number, repository: repository.name, revision: start.revision, entries: snapshot).encode(into: &bytes)
            events += 1
        }
        bytes.append(contentsOf: start.replay)
        events += start.replayed
        // A `once` subscription whose change was replayed ended there: no `synced` follows.
        if request.since != nil, !(request.once && start.replayed > 0) {
            SyncedEvent(subscription: number, repository: repository.name, revision: start.revision).encode(into: &bytes)
            events += 1
        }
        if repository.isDurable(sequence) {
            bytes.withUnsafeBytes { outbox.append($0, events: events) }
            shard.markDirty(connection)
        } else {
            hold(bytes, events: events, id: id, until: sequence, in: repository, subscription: registered ? subscription : nil)
        }
    }
}
