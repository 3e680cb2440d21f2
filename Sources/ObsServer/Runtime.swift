// ObsServer — the settings that can change while the daemon runs: limits and the access
// policy. A reload swaps them and bumps a generation number; each connection re-reads
// them on its next request (one atomic load per request when nothing changed).

import NIOCore
import ObsProtocol
import ObservableKit
import Synchronization

/// Every limit, with its default. Crossing a size limit of one request is `too_large`;
/// crossing a count of resources is `overloaded`. Neither affects other clients.
public struct Limits: Sendable, Equatable {
    // Per connection; a reload applies them to connections accepted afterwards.
    /// The longest request line, in bytes before the `\n`.
    public var maxLine: Int = ProtocolRules.defaultMaxLine
    /// The deepest nesting of arrays and objects accepted in a request.
    public var maxDepth: Int = JSONParser.defaultMaxDepth
    /// A connection's outgoing queue limit, in bytes and in events.
    public var queueBytes: Int = 16 << 20
    public var queueEvents: Int = 100_000
    /// How long an overflowed connection may take to read its last messages.
    public var overflowGrace: Duration = .seconds(30)

    // Per request and per connection; a reload applies them at once.
    /// The largest value, in bytes of compact JSON.
    public var maxValueBytes: Int = 512 << 10
    /// The most keys in one `subscribe` or operations in one `batch`.
    public var maxKeysPerRequest: Int = 4096
    /// The most live subscriptions of one connection.
    public var maxSubscriptionsPerConnection: Int = 1024

    // Daemon-wide; a reload applies them at once.
    public var maxKeysPerRepository: Int = 1_000_000
    public var maxRepositories: Int = 10_000
    public var maxConnections: Int = 16_384
    /// Not applied to root and the daemon's own uid.
    public var maxConnectionsPerUID: Int = 1024

    public init() {}
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

    init(limits: Limits, policy: AccessPolicy) {
        current = Locked(Snapshot(generation: 0, limits: limits, policy: policy))
    }

    var generation: UInt64 { generationCounter.load(ordering: .acquiring) }

    var snapshot: Snapshot { current.withLock { $0 } }

    func update(limits: Limits, policy: AccessPolicy) {
        current.withLock { s in
            s = Snapshot(generation: s.generation + 1, limits: limits, policy: policy)
            generationCounter.store(s.generation, ordering: .releasing)
        }
    }
}
