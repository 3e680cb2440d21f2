// ObsServer — one subscription of one connection, as its loop delivers to it.

import ObsCore
import ObsProtocol
import ObsValues
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
    // Unmanaged (unowned(unsafe)): a connection's subscriptions end (are unrouted) when it
    // closes, before it goes, and nothing reaches one but on their loop. Not strong references,
    // and not unowned ones: delivery touches a thousand subscriptions per revision at fan-out,
    // and a retain and release of each one's connection and outbox per event were a third of
    // the daemon's time (cache misses on cold reference counts).
    private let connectionRef: Unmanaged<Connection>
    private let outboxRef: Unmanaged<Outbox>
    var connection: Connection { connectionRef.takeUnretainedValue() }
    var outbox: Outbox { outboxRef.takeUnretainedValue() }
    let selection: Selection
    /// Ends after its first change event.
    let once: Bool
    /// Trades intermediate values for state while its connection lags (see `Lag`).
    let coalesce: Bool
    /// Its change events carry `by`.
    let writers: Bool
    /// `false`: revisions its own connection wrote are not sent.
    let echo: Bool
    /// Gets `progress` events (a resume position that keeps up).
    let progress: Bool
    /// When its last `progress` event was queued (the loop's clock), at most one a second.
    var lastProgress: UInt64 = 0
    /// Its registration in the loop's routes.
    let routeID = ObserverID.next()
    /// `{"event":"change","sub":<id>` — the part of its change events that is its own, kept
    /// inline (written for every event: no array to retain).
    private let head: InlineBytes
    /// Live on its connection (registered, not ended).
    var isLive = false
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
        self.connectionRef = .passUnretained(connection)
        self.outboxRef = .passUnretained(connection.outbox)
        self.selection = request.selection
        self.once = request.once
        self.coalesce = request.coalesce
        self.writers = request.writers
        self.echo = request.echo
        self.progress = request.progress
        var head: [UInt8] = []
        EventEncoder.writeChangeHead(&head, sub: id)
        self.head = InlineBytes(head)
    }

    /// Calls `body` with the connection and its outbox, retaining neither (see above).
    @inline(__always)
    func withConnection<R>(_ body: (Connection, Outbox) -> R) -> R {
        connectionRef._withUnsafeGuaranteedRef { connection in outboxRef._withUnsafeGuaranteedRef { body(connection, $0) } }
    }

    /// Writes `{"event":"change","sub":<id>`.
    @inline(__always)
    func writeHead(_ sink: inout some JSONSink & ~Copyable) {
        head.write(&sink)
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

/// Up to 48 bytes stored inline.
struct InlineBytes {
    private var storage: (UInt64, UInt64, UInt64, UInt64, UInt64, UInt64) = (0, 0, 0, 0, 0, 0)
    private let count: Int

    init(_ bytes: [UInt8]) {
        precondition(bytes.count <= 48, "inline bytes hold 48")
        count = bytes.count
        withUnsafeMutableBytes(of: &storage) { $0.copyBytes(from: bytes) }
    }

    @inline(__always)
    func write(_ sink: inout some JSONSink & ~Copyable) {
        withUnsafeBytes(of: storage) { sink.writeBytes(UnsafeRawBufferPointer(rebasing: $0[..<count])) }
    }
}
