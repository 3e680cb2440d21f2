// ObsServer — one subscription of one connection, as its loop delivers to it.

import ObsCore
import ObsProtocol
import ObservableKit
import Synchronization

/// Names one connection for as long as the daemon runs: never reused, unlike the address of a
/// connection's objects — a revision's writer outlives its connection in the history, and a
/// new connection at a reused address must not take those revisions for its own (`echo`).
struct ConnectionID: Hashable, Sendable {
    let value: UInt64

    private static let counter = Atomic<UInt64>(0)

    /// A number no other connection of this process has had.
    static func next() -> ConnectionID { ConnectionID(value: counter.add(1, ordering: .relaxed).newValue) }
}

/// One subscription of one connection. Lives on its connection's loop: created by the session,
/// routed by the loop's shard, delivered to through its outbox.
final class Subscription {
    /// The subscription number on its connection.
    let id: UInt64
    let repository: Repository
    unowned let connection: Connection
    var outbox: Outbox { connection.outbox }
    let selection: Selection
    /// Ends after its first change event.
    let once: Bool
    /// Trades intermediate values for state while its connection lags (see `Lag`).
    let coalesce: Bool
    /// Its change events carry `by`.
    let writers: Bool
    /// `false`: revisions its own connection wrote are not sent.
    let echo: Bool
    /// Its registration in the loop's routes.
    let routeID = ObserverID.next()
    /// `{"event":"change","sub":<id>` — the part of its change events that is its own.
    let head: [UInt8]
    /// Revisions up to here were covered by the subscribe reply (snapshot or replay); set
    /// when it is registered.
    var after: UInt64 = 0
    /// Every change it selects up to here was queued — or, written by its own connection
    /// under `echo: false`, needed no event (for `overflow`'s `revs`).
    var completeThrough: UInt64 = 0
    /// A coalescing subscription's changes while its connection lags; nil otherwise.
    var lag: Lag?

    init(id: UInt64, repository: Repository, connection: Connection, request: SubscribeRequest) {
        self.id = id
        self.repository = repository
        self.connection = connection
        self.selection = request.selection
        self.once = request.once
        self.coalesce = request.coalesce
        self.writers = request.writers
        self.echo = request.echo
        var head: [UInt8] = []
        EventEncoder.writeChangeHead(&head, sub: id)
        self.head = head
    }

    /// The origin a replay skips (`echo: false`), if any.
    var skippedOrigin: UInt64? { echo ? nil : outbox.connection.value }

    /// Whether it gets an event for `revision` at all (`echo: false` skips its own connection's).
    func wants(_ revision: RevisionView) -> Bool {
        echo || revision.info.origin != outbox.connection.value
    }
}

@available(*, unavailable)
extension Subscription: Sendable {}
