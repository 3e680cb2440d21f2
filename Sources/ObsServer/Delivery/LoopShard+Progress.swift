// ObsServer — `progress` events (the contract's "a resume position that keeps up"): once a
// second, while any subscription on this loop asked for them.

import ObsProtocol
import ObsValues

extension LoopShard {
    /// Once a second, while any subscription here asked for `progress`: each live one whose
    /// repository moved past what it was last told, with nothing of its own waiting (a
    /// lagging coalescing subscription gets none), is told the newest revision delivered on
    /// this loop — every change it selects up to there is queued before the event.
    func scheduleProgress() {
        progressTimer = loop.schedule(in: 1_000_000_000) { [unowned self] in
            progressTimer = nil
            sendProgress()
            if !progressing.isEmpty { scheduleProgress() }
        }
    }

    func sendProgress() {
        let now = loop.now
        for subscription in progressing.values {
            guard subscription.isLive, subscription.lag == nil, now &- subscription.lastProgress >= 1_000_000_000,
                let entry = routes[subscription.repository.id], entry.revision > subscription.completeThrough
            else { continue }
            let revision = entry.revision
            subscription.withConnection { connection, outbox in
                guard outbox.isOpen, !outbox.isFull else { return }
                outbox.appendEvent { ProgressEvent(subscription: subscription.id, repository: subscription.repository.name, revision: revision).encode(into: &$0) }
                subscription.completeThrough = revision
                subscription.lastProgress = now
                markDirty(connection)
            }
        }
    }
}
