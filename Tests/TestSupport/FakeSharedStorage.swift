// End-to-end test support: a shared store in memory, for the daemon's etcd mode without etcd.
// It decides revisions the way ObsCluster does — a group commits only if its basis is the
// repository's current revision, and every committed revision reaches the daemon through its
// sink, in order — and can, on demand, apply a group but report its outcome as unknown, then
// deliver it later (as etcd may after a timed-out request).

import ObsStore
import ObservableKit

public final class FakeSharedStorage: SharedStorage {
    public let epoch = "fake-shared-store"

    public init() {}

    private struct State {
        var revisions: [String: UInt64] = [:]
        var sink: (any SharedStorageSink)?
        /// The next group that commits is applied but reported `outcomeUnknown`, and its
        /// revisions wait in `parked` until `deliverParked`.
        var reportNextAsUnknown = false
        var parked: [(repo: String, revisions: [SharedRevision])] = []
    }

    private let state = Locked(State())

    /// The next group that commits is applied, but its writer is told the outcome is
    /// unknown; its revisions reach the daemon only at `deliverParked` (or before the next
    /// commit to the same repository, as a stale basis would bring them).
    public func reportNextCommitAsUnknown() { state.withLock { $0.reportNextAsUnknown = true } }

    /// Delivers the revisions of groups reported as unknown.
    public func deliverParked() {
        let (sink, parked) = state.withLock { s -> ((any SharedStorageSink)?, [(repo: String, revisions: [SharedRevision])]) in
            defer { s.parked = [] }
            return (s.sink, s.parked)
        }
        for group in parked { sink?.deliver(repo: group.repo, revisions: group.revisions) }
    }

    // MARK: SharedStorage

    public func connect() async throws {}

    public func start(delivering sink: any SharedStorageSink) { state.withLock { $0.sink = sink } }

    public func limitExceeded(by records: [RevisionRecord]) -> String? { nil }

    public func commit(_ group: SharedCommit) async -> SharedCommitOutcome {
        enum Decision { case stale, current, committed([SharedRevision]), unknown }
        let (decision, sink) = state.withLock { s -> (Decision, (any SharedStorageSink)?) in
            guard s.revisions[group.repo, default: 0] == group.basisRevision else { return (.stale, s.sink) }
            guard let last = group.records.last else { return (.current, s.sink) }
            s.revisions[group.repo] = last.revision
            let revisions = group.records.map { SharedRevision(record: $0, writeID: group.writeID) }
            if s.reportNextAsUnknown {
                s.reportNextAsUnknown = false
                s.parked.append((group.repo, revisions))
                return (.unknown, s.sink)
            }
            return (.committed(revisions), s.sink)
        }
        switch decision {
        case .stale:
            deliverParked()
            return .stale
        case .current:
            return .current
        case .committed(let revisions):
            sink?.deliver(repo: group.repo, revisions: revisions)
            return .committed
        case .unknown:
            return .failed(SharedFailure(.outcomeUnknown, "the fake store reports this commit's outcome as unknown"))
        }
    }

    public func linearize(_ scope: SharedScope) async -> Bool { true }

    // MARK: Storage

    public var isImmediate: Bool { false }
    public var summary: String { "fake shared store (test)" }
    public var counters: StorageCounters? { nil }
    public var notices: [String] { [] }
    public func load() throws(StorageError) -> [LoadedRepository] { [] }
    public func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool { false }
    public func discard(_ listener: any DurabilityListener, after sequence: UInt64) {}
    public func close() {}
}
