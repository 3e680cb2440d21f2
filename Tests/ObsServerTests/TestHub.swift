// What the ObsServer tests share to build a daemon's state in process: a `Hub` over an
// `EmbeddedEventLoop` (one shard per loop), with in-memory storage and the default limits,
// and a storage that reports durability only when a test says so.

import NIOCore
import NIOEmbedded
import ObsStore
import Synchronization

@testable import ObsServer

extension Limits {
    /// The daemon's defaults, for in-process tests.
    static let testing = Limits(
        maxLine: 1 << 20, queueBytes: 16 << 20, queueEvents: 100_000, overflowGrace: .seconds(30), maxValueBytes: 512 << 10,
        maxRevisionBytes: 16 << 20, maxKeysPerRequest: 4096, maxSubscriptionsPerConnection: 1024, maxKeysPerRepository: 1_000_000,
        maxRepositories: 10_000, maxConnections: 16_384, maxConnectionsPerUID: 1024)
}

/// A hub whose event loop is `loop` (and `otherLoops`, if any): channels on these loops are
/// its connections.
func makeHub(
    storage: any Storage = InMemoryStorage(), limits: Limits = .testing, loop: any EventLoop = EmbeddedEventLoop(),
    otherLoops: [any EventLoop] = [], delivery: DeliveryBudget = DeliveryBudget()
) throws -> Hub {
    try Hub(
        loops: [loop] + otherLoops, historyLimits: HistoryLimits(count: 100, maxBytes: 64 << 20, maxAge: nil), storage: storage,
        runtime: Runtime(limits: limits, policy: .open), delivery: delivery)
}

/// Storage that keeps what it is given and reports durability only when the test says so.
final class ManualStorage: Storage {
    private let queued = Mutex<[RevisionRecord]>([])
    var isImmediate: Bool { false }
    var summary: String { "manual (test)" }
    var counters: StorageCounters? { nil }
    var notices: [String] { [] }
    func load() -> [LoadedRepository] { [] }
    func append(_ record: RevisionRecord, listener: any DurabilityListener) -> Bool {
        queued.withLock { $0.append(record) }
        return true
    }
    func discard(_ listener: any DurabilityListener, after revision: UInt64) {}
    func close() {}
}
