// ObsServer — a session in etcd mode (a `SharedStorage`): its reads wait until this
// daemon's state is current with the cluster, its writes wait for the cluster to commit
// them, and meanwhile the connection hands over no further request — so a connection's
// requests still take effect in the order it sent them, and each sees the ones before it.
// Events for its subscriptions keep flowing while it waits.
//
// A read asks the store to `linearize` (a linearizable read of the repository's revision
// counter, then waiting until this daemon has applied that far); when the cluster cannot
// answer quickly — no quorum — the read is answered from the state the daemon holds, as etcd's
// serializable reads are. Subscriptions are reads too: a new one starts from a current state.

import NIOCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    /// How long a write may wait for the cluster before it is answered with the cause
    /// (the store may take `ClusterStorage.Configuration.settleGrace` more to settle an
    /// unknown outcome).
    static let sharedWriteTimeout: Duration = .seconds(4)

    /// The repositories a request reads (nil: it reads no repository state).
    static func sharedReadScope(_ command: Command) -> SharedScope? {
        switch command {
        case .get(let repo, _), .list(let repo, _, _): .repository(repo)
        case .subscribe(let request): .repository(request.repo)
        case .repos: .all
        default: nil
        }
    }

    /// Runs `body` on this session's loop once this daemon's state of `scope` includes every
    /// revision committed before now (or the cluster could not say so quickly), holding the
    /// connection's later requests meanwhile.
    func afterLinearizing(_ scope: SharedScope, _ shared: any SharedStorage, _ body: @escaping (Session) -> Void) {
        awaitingCluster = true
        let loop = shard.eventLoop
        let session = NIOLoopBound(self, eventLoop: loop)
        let body = NIOLoopBound(body, eventLoop: loop)
        Task {
            _ = await shared.linearize(scope)
            loop.execute {
                session.value.awaitingCluster = false
                body.value(session.value)
                session.value.resumeInput()
            }
        }
    }

    /// Queues a write for the shared store; its reply is sent once the store answered.
    func writeShared(
        _ id: JSONValue, repo: String, _ ops: [WriteOp<CanonicalJSON>], single: Bool, limits: WriteLimits, writer: Writer,
        origin: ConnectionID
    ) {
        awaitingCluster = true
        let loop = shard.eventLoop
        let session = NIOLoopBound(self, eventLoop: loop)
        let deadline = ContinuousClock.now + Self.sharedWriteTimeout
        // Held (not kept for good) while the write is under way: a write that changes
        // nothing, conflicts or is refused leaves no repository behind; one that commits makes
        // it permanent when its revision is installed.
        let hub = self.hub
        let repository = hub.hold(repo)
        let item = SharedItem(ops: ops, limits: limits, writer: writer, origin: origin, deadline: deadline) { result in
            loop.execute {
                let s = session.value
                s.awaitingCluster = false
                s.answerWrite(id, repo: repo, repository, result, single: single)
                hub.release(repo)
                if !s.holdForDelivery() { s.resumeInput() }
            }
        }
        repository.submitShared(item)
    }
}
