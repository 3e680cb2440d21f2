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
        ReplyEncoder.begin(&bytes, id: id)
        bytes.writeMember(",\"sub\":", number)
        bytes.writeMember(",\"rev\":", start.revision)
        bytes.writeMember(",\"epoch\":", repository.epoch)
        ReplyEncoder.end(&bytes)
        var events = 0
        if var snapshot = start.snapshot {
            snapshot.sort { $0.key < $1.key }
            Self.writeSnapshot(&bytes, sub: number, repo: repository.name, rev: start.revision, snapshot)
            events += 1
        }
        bytes.append(contentsOf: start.replay)
        events += start.replayed
        // A `once` subscription whose change was replayed ended there: no `synced` follows.
        if request.since != nil, !(request.once && start.replayed > 0) {
            EventEncoder.writeSynced(&bytes, sub: number, repo: repository.name, rev: start.revision)
            events += 1
        }
        if repository.isDurable(sequence) {
            bytes.withUnsafeBytes { outbox.append($0, events: events) }
            shard.markDirty(connection)
        } else {
            hold(bytes, events: events, id: id, until: sequence, in: repository, subscription: registered ? subscription : nil)
        }
    }

    private static func writeSnapshot(_ sink: inout [UInt8], sub: UInt64, repo: String, rev: UInt64, _ entries: [(key: Key, value: CanonicalJSON)]) {
        sink.writeMember("{\"event\":\"snapshot\",\"sub\":", sub)
        sink.writeMember(",\"repo\":", repo)
        sink.writeMember(",\"rev\":", rev)
        sink.writeRaw(",\"values\":{")
        for (i, entry) in entries.enumerated() {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            sink.writeJSONString(entry.key)
            sink.writeByte(UInt8(ascii: ":"))
            sink.writeCanonical(entry.value)
        }
        sink.writeRaw("}}\n")
    }
}
