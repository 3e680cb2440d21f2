// End-to-end test support: a storage that fails on demand, for the daemon run in the test
// process (TestSupport's InProcessDaemon) — failures no real disk produces on demand.

import Logging
import ObsServer
import ObsStore
import Synchronization
import TestSupport

/// A disk store that fails on demand the way a failing disk fails a group commit: each
/// repository that appends while it fails is reported its revisions failed (posted as the
/// committer thread posts, for the server to deliver), and its later revisions are dropped
/// until it has undone them (`discard`).
/// Turn failures on only once earlier writes were acknowledged: a failure reported while
/// the real store still holds earlier revisions would confirm those early.
final class FailingStorage: Storage {
    let disk: DiskStorage
    private let state = Mutex<(failure: StorageError?, poisoned: Set<ObjectIdentifier>)>((nil, []))

    init(directory: String) throws {
        disk = try DiskStorage(
            options: .init(directory: directory, sync: .always, historyLimit: 1000, historyMaxBytes: 64 << 20, historyMaxAge: nil),
            logger: Logger(label: "obsd-in-process"))
    }

    /// Makes every later group commit fail with `error` (nil: work again).
    func fail(with error: StorageError?) { state.withLock { $0.failure = error } }

    var isImmediate: Bool { false }
    var summary: String { "failing on demand (test) over \(disk.summary)" }
    var counters: StorageCounters? { disk.counters }
    var reports: DurabilityReports? { disk.reports }
    var notices: [String] { disk.notices }
    func load() throws(StorageError) -> [LoadedRepository] { try disk.load() }

    func loadLeases() -> PersistedLeases { disk.loadLeases() }

    func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool {
        let id = ObjectIdentifier(listener)
        let (failure, report) = state.withLock { s -> (StorageError?, Bool) in
            guard let failure = s.failure else { return (nil, false) }
            return (failure, s.poisoned.insert(id).inserted)
        }
        if let failure {
            if report {
                disk.counters?.failures.add(1, ordering: .relaxed)
                disk.reports?.post(listener, .failed(after: sequence - 1, error: failure), wake: true)
            }
            return true
        }
        if state.withLock({ $0.poisoned.contains(id) }) { return true }  // built on a failed revision
        return disk.append(frame, sequence: sequence, listener: listener)
    }

    func discard(_ listener: any DurabilityListener, after sequence: UInt64) {
        _ = state.withLock { $0.poisoned.remove(ObjectIdentifier(listener)) }
        disk.discard(listener, after: sequence)
    }

    func flush() { disk.flush() }

    func close() { disk.close() }
}
