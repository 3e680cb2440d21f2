// ObsServer — coalescing subscriptions (`coalesce: true`): state instead of every
// intermediate value when the connection lags.
//
// While its connection's queue is full, a coalescing subscription queues nothing: each
// revision it selects is folded into its `Lag` — per key, the value the subscription last
// received and the value now; a key back at what the subscription last received (created and
// deleted again, changed and changed back) is dropped, so a lag holds only keys it owes a
// change of — bounded by the keys the subscription selects, never by the number of writes.
// Once the queue has room again, the lag becomes one `change` event: `rev` the repository's
// revision at that moment (as this loop knows it: the newest revision delivered here), `from`
// the first revision folded in, and a change per key, in byte order of the keys. A
// coalescing subscription never overflows its connection.

import ObsCore
import ObsProtocol
import ObsValues
import ObservableKit

/// The changes a coalescing subscription has not been sent yet: one entry per key whose
/// value differs from the one the subscription last received.
struct Lag {
    /// The first revision folded in.
    let from: UInt64
    /// Per key that changed: the value the subscription last received (nil: absent for it).
    var received: [Key: CanonicalJSON?] = [:]
    /// Per key that changed: its value now (nil: deleted).
    var current: [Key: CanonicalJSON?] = [:]
    /// The newest revision folded in, and who wrote it.
    var revision: UInt64
    var writer: Writer?

    init(from revision: UInt64) {
        self.from = revision
        self.revision = revision
    }

    /// The changes to send, by key bytes.
    var changes: [Change<CanonicalJSON>] {
        current.compactMap { key, now -> Change<CanonicalJSON>? in
            let before = received[key] ?? nil
            return before == now ? nil : Change(key: key, old: before, new: now)
        }.sorted { $0.key < $1.key }
    }
}

extension Outbox {
    /// Folds a revision `subscription` selects into its lag (starting one).
    func fold(_ revision: RevisionView, selected: SelectedChanges, into subscription: Subscription) {
        let starting = subscription.lag == nil
        var lag = subscription.lag ?? Lag(from: revision.revision)
        subscription.lag = nil  // `lag` the only owner: its dictionaries grow in place, never copied per revision
        let own = !subscription.wants(revision)
        for change in revision.changes(selected) {
            if own {
                // Under `echo: false` the client has its own connection's write from the
                // reply: that is the value it last received for the key.
                lag.received[change.key] = .some(change.new)
            } else if lag.received[change.key] == nil {
                lag.received[change.key] = .some(change.old)
            }
            if let received = lag.received[change.key], received == change.new {
                lag.received[change.key] = nil
                lag.current[change.key] = nil
            } else {
                lag.current[change.key] = .some(change.new)
            }
        }
        lag.revision = revision.revision
        lag.writer = revision.info.writer
        if starting { lagging.append(subscription) }
        subscription.lag = lag
    }

    /// Queues one coalesced event per lagging subscription (the queue has room again).
    func releaseLag() {
        let subscriptions = lagging
        lagging.removeAll()
        for subscription in subscriptions {
            guard let lag = subscription.lag else { continue }
            subscription.lag = nil
            guard subscription.isLive else { continue }  // ended meanwhile
            let changes = lag.changes
            let revision = max(lag.revision, latestRevision(subscription.repository))
            subscription.completeThrough = revision
            // Changed and changed back (its own writes under echo: false included): nothing to say.
            guard !changes.isEmpty else { continue }
            appendEvent { sink in
                subscription.writeHead(&sink)
                if subscription.writers, let writer = lag.writer { EventEncoder.writeBy(&sink, writer) }
                EventEncoder.writeChangeBody(
                    &sink, repo: subscription.repository.name, rev: revision, from: lag.from, count: changes.count
                ) { sink, i in
                    EventEncoder.writeChange(&sink, changes[i]) { sink, value in sink.writeCanonical(value) }
                }
            }
        }
    }
}
