// In-process tests of the daemon's shared state: which repository objects the hub hands
// out, and that none is ever used after the hub let go of it.

import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import Testing

@testable import ObsServer

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

extension Limits {
    /// The daemon's defaults, for in-process tests.
    static let testing = Limits(
        maxLine: 1 << 20, queueBytes: 16 << 20, queueEvents: 100_000, overflowGrace: .seconds(30), maxValueBytes: 512 << 10,
        maxRevisionBytes: 16 << 20, maxKeysPerRequest: 4096, maxSubscriptionsPerConnection: 1024, maxKeysPerRepository: 1_000_000,
        maxRepositories: 10_000, maxConnections: 16_384, maxConnectionsPerUID: 1024)
}

func makeHub(storage: any Storage = InMemoryStorage()) throws -> Hub {
    try Hub(
        historyLimit: 100, historyMaxAge: nil, storage: storage, deliveryLoops: nil,
        runtime: Runtime(limits: .testing, policy: .open))
}

let writeLimits = WriteLimits(maxKeys: 1000, maxRepositories: 1000, maxRevisionBytes: 1 << 20)

@Suite struct HubTests {
    @Test func aRepositoryWhoseFirstRevisionWasUndoneIsStillTheOneTheHubHandsOut() throws {
        let storage = ManualStorage()
        let hub = try makeHub(storage: storage)
        let set: (Int64) -> [WriteOp<StoredValue>] = { [.set("k", StoredValue(.int($0)))] }
        _ = try hub.using("r") { try $0.write(set(1), now: 0, limits: writeLimits) }
        let first = try #require(hub.existing("r"))
        try hub.using("r") { held in
            // Storage fails revision 1: the repository is back at revision 0.
            held.failed(after: 0, error: StorageError(.full, "test: disk full"))
            #expect(held.revision == 0)
            // Someone else uses the repository meanwhile and lets go of it.
            hub.using("r") { _ in }
            // The holder writes again: into the repository the hub still has.
            _ = try held.write(set(2), now: 0, limits: writeLimits)
        }
        let now = try #require(hub.existing("r"), "the hub kept the repository")
        #expect(now === first)
        #expect(now.get("k").entry?.value == StoredValue(.int(2)), "the write is where readers look")
    }

    @Test func placeholdersOfRepositoriesNobodyWroteAreDroppedWhenUnused() throws {
        let hub = try makeHub()
        hub.using("ghost") { _ in }
        #expect(hub.existing("ghost") == nil)
    }
}
