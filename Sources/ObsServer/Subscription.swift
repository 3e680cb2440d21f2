// ObsServer — one subscription of one connection, as its loop delivers to it.

import ObsProtocol
import ObservableKit

/// One subscription of one connection. Lives on its connection's event loop: created by the
/// session, routed by the loop's shard, delivered to by its outbox.
final class Subscription {
    /// The subscription number on its connection.
    let id: UInt64
    let repository: Repository
    let outbox: Outbox
    /// Ends after its first change event.
    let once: Bool
    /// Its registration in the loop's routes.
    let routeID = ObserverID.next()
    /// `{"event":"change","sub":<id>` — the part of its change events that is its own.
    let head: [UInt8]
    /// Revisions up to here were covered by the subscribe reply (snapshot or replay); set
    /// when it is registered.
    var after: UInt64
    /// Every change it selects up to here was queued (for `overflow`'s `revs`).
    var completeThrough: UInt64

    init(id: UInt64, repository: Repository, outbox: Outbox, once: Bool, after: UInt64 = 0) {
        self.id = id
        self.repository = repository
        self.outbox = outbox
        self.once = once
        self.after = after
        self.completeThrough = after
        var head: [UInt8] = []
        EventEncoder.writeChangeHead(&head, sub: id)
        self.head = head
    }
}

@available(*, unavailable)
extension Subscription: Sendable {}
