// ObsServer — `sync`: a subscription's copy known to be fresh. The reply's `rev` is the
// repository's revision when the request is read (pending writes included: a write this
// connection sent before the `sync` is in it); the reply is appended once this loop has
// queued every event of the subscription up to that revision ahead of it — its start (a
// snapshot, diff or replay, and `synced`), its change events, and for a lagging coalescing
// subscription the coalesced event — and the connection's later requests wait for it, so
// replies stay in request order. Only the subscription's own events are awaited: the revision
// is routed on this loop once it is durable, and a storage failure that undoes it answers the
// `sync` with that error instead.

import ObsCore
import ObsProtocol
import ObsStore

extension Session {
    /// A `sync` waiting for its subscription's events.
    struct PendingSync {
        let id: JSONValue
        let subscription: Subscription
        let revision: UInt64
        let sequence: StateSequence
    }

    func sync(_ id: JSONValue, _ sub: UInt64) {
        guard let subscription = outbox.live[sub] else {
            return fail(id: id, ProtocolError(.notFound, "no subscription \(sub) on this connection"))
        }
        let (revision, _, sequence) = subscription.repository.summary
        pendingSync = PendingSync(id: id, subscription: subscription, revision: revision, sequence: sequence)
        if !answerSync() {
            wait(for: .sync)
            shard.awaitSync(connection)
        }
    }

    /// Answers the pending `sync` if its subscription's events up to its revision are queued
    /// (or it ended: none will come); whether it did (or none is pending).
    @discardableResult
    func answerSync() -> Bool {
        guard let pending = pendingSync else { return true }
        let subscription = pending.subscription
        if subscription.isLive {
            guard subscription.lag == nil,
                subscription.after >= pending.revision || shard.latestRevision(of: subscription.repository) >= pending.revision
            else { return false }
        }
        pendingSync = nil
        reply(pending.id, SyncReply(revision: pending.revision))
        if waits.contains(.sync) { resume(from: .sync) }
        return true
    }

    /// Storage undid changes of `line` (`undone`): a pending `sync` whose revision was among
    /// them gets the error (its revision will not be routed as it was read).
    func failSync(_ line: any DurableLine, undone: ClosedRange<StateSequence>, _ error: StorageError) {
        guard let pending = pendingSync, pending.subscription.repository.lineID == line.lineID, undone.contains(pending.sequence) else { return }
        pendingSync = nil
        Replies.storageFailure(id: pending.id, error, in: line.subject).withUnsafeBytes { outbox.append($0) }
        shard.markDirty(connection)
        resume(from: .sync)
    }
}
