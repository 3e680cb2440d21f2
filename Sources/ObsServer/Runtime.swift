// ObsServer — the settings that can change while the daemon runs: limits and the access
// policy. A reload swaps them and bumps a generation number; each connection re-reads
// them on its next request (one atomic load per request when nothing changed). Each
// reload's end is counted, for `stats` and whoever waits on it (`obsctl reload`).

import ObsProtocol
import ObservableKit
import Synchronization

/// Every limit. Crossing a size limit of one request is `too_large`; crossing a count of
/// resources is `overloaded`. Neither affects other clients. `Limits()` has the daemon's
/// defaults (those of `obsd` with no configuration file; ObsConfig's `DaemonSettings`,
/// which a test keeps in step with these).
public struct Limits: Sendable, Equatable {
    // Per connection; a reload applies them to connections accepted afterwards.
    /// The longest request line, in bytes before the `\n`.
    public var maxLine: Int
    /// The deepest nesting of arrays and objects accepted in a request (a protocol constant).
    public var maxDepth: Int = JSONParser.defaultMaxDepth
    /// A connection's outgoing queue limit, in bytes and in events.
    public var queueBytes: Int
    public var queueEvents: Int
    /// How long an overflowed connection may take to read its last messages.
    public var overflowGrace: Duration

    // Per request and per connection; a reload applies them at once.
    /// The largest value, in bytes of compact JSON.
    public var maxValueBytes: Int
    /// The most bytes one revision may carry: its keys and their old and new values.
    public var maxRevisionBytes: Int
    /// The most keys in one `subscribe` or operations in one `batch`.
    public var maxKeysPerRequest: Int
    /// The most live subscriptions of one connection.
    public var maxSubscriptionsPerConnection: Int

    // Daemon-wide; a reload applies them at once.
    public var maxKeysPerRepository: Int
    public var maxRepositories: Int
    public var maxConnections: Int
    /// Not applied to root and the daemon's own uid.
    public var maxConnectionsPerUID: Int
    /// The most live leases of one uid (root's too).
    public var maxLeasesPerUID: Int
    /// The most bytes of large subscription starts copied for streaming at once (StartBudget).
    public var maxStartBytes: Int

    /// The daemon's defaults, but for the limits given.
    public init(
        maxLine: Int = 1 << 20, queueBytes: Int = 16 << 20, queueEvents: Int = 100_000, overflowGrace: Duration = .seconds(30),
        maxValueBytes: Int = 512 << 10, maxRevisionBytes: Int = 16 << 20, maxKeysPerRequest: Int = 4096,
        maxSubscriptionsPerConnection: Int = 1024, maxKeysPerRepository: Int = 1_000_000, maxRepositories: Int = 10_000,
        maxConnections: Int = 16_384, maxConnectionsPerUID: Int = 1024, maxLeasesPerUID: Int = 1024, maxStartBytes: Int = 1 << 30
    ) {
        self.maxLine = maxLine
        self.queueBytes = queueBytes
        self.queueEvents = queueEvents
        self.overflowGrace = overflowGrace
        self.maxValueBytes = maxValueBytes
        self.maxRevisionBytes = maxRevisionBytes
        self.maxKeysPerRequest = maxKeysPerRequest
        self.maxSubscriptionsPerConnection = maxSubscriptionsPerConnection
        self.maxKeysPerRepository = maxKeysPerRepository
        self.maxRepositories = maxRepositories
        self.maxConnections = maxConnections
        self.maxConnectionsPerUID = maxConnectionsPerUID
        self.maxLeasesPerUID = maxLeasesPerUID
        self.maxStartBytes = maxStartBytes
    }
}

/// The current limits and access policy.
final class Runtime: Sendable {
    struct Snapshot: Sendable {
        let generation: UInt64
        let limits: Limits
        let policy: AccessPolicy
    }

    private let current: Locked<Snapshot>
    private let generationCounter = Atomic<UInt64>(0)
    /// Reloads that ended, applied or not; those that kept the running settings; and why the
    /// last one did, while it is the last.
    private let reloadsEnded = Atomic<Int>(0)
    private let reloadsFailed = Atomic<Int>(0)
    private let lastReloadError = Locked<String?>(nil)

    init(limits: Limits, policy: AccessPolicy) {
        current = Locked(Snapshot(generation: 0, limits: limits, policy: policy))
    }

    var generation: UInt64 { generationCounter.load(ordering: .acquiring) }

    var snapshot: Snapshot { current.withLock { $0 } }

    /// The reload counters, as `stats` shows them. A reload's failure and error are visible
    /// to whoever sees it counted in `ended`.
    var reloads: (ended: Int, failed: Int, error: String?) {
        let ended = reloadsEnded.load(ordering: .acquiring)
        return (ended, reloadsFailed.load(ordering: .relaxed), lastReloadError.withLock { $0 })
    }

    /// Counts a reload that ended: applied (`failure` nil) or not (`failure` says why).
    func reloadEnded(failure: String?) {
        lastReloadError.withLock { $0 = failure }
        if failure != nil { reloadsFailed.add(1, ordering: .relaxed) }
        reloadsEnded.add(1, ordering: .releasing)
    }

    func update(limits: Limits, policy: AccessPolicy) {
        current.withLock { s in
            s = Snapshot(generation: s.generation + 1, limits: limits, policy: policy)
            generationCounter.store(s.generation, ordering: .releasing)
        }
    }
}
