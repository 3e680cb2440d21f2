// End-to-end test support: the daemon run in the test process, on a temporary socket, with
// a storage the test provides — for failures no real disk produces on demand. Clients
// reach it over the socket exactly as they reach the obsd binary.

import Foundation
import Logging
import ObsServer
import ObsStore
import Synchronization
import TestSupport

final class InProcessDaemon: Sendable {
    let socketPath: String
    private let task: Task<Void, any Error>

    private struct Started: ServerObserver {
        let continuation: AsyncStream<Void>.Continuation
        func serverDidStart(_ status: ServerStatus) { continuation.yield() }
        func serverHeartbeat(_ status: ServerStatus) {}
        func serverWillStop() {}
    }

    /// Starts serving `storage` with the daemon's default settings; returns once it accepts
    /// connections.
    static func start(storage: any Storage, threads: Int = 2) async throws -> InProcessDaemon {
        let socketPath = TestDaemon.makeTemporaryDirectory() + "/obsd.sock"
        let configuration = ServerConfiguration(
            listener: .path(socketPath), socketMode: 0o600, policy: .open, storage: .custom(storage), threads: threads)
        let (started, continuation) = AsyncStream<Void>.makeStream()
        let server = ObsServer(configuration: configuration, logger: Logger(label: "obsd-in-process"), observer: Started(continuation: continuation))
        let task = Task { try await server.run() }
        var iterator = started.makeAsyncIterator()
        guard await iterator.next() != nil else { throw TestFailure("the in-process daemon did not start") }
        return InProcessDaemon(socketPath: socketPath, task: task)
    }

    private init(socketPath: String, task: Task<Void, any Error>) {
        self.socketPath = socketPath
        self.task = task
    }

    func connect() throws -> WireConnection { try WireConnection(path: socketPath) }

    /// Stops serving (gracefully: storage is closed) and waits until it has.
    func stop() async throws {
        task.cancel()
        try await task.value
    }
}

/// A disk store that fails on demand the way a failing disk fails a group commit: each
/// repository that appends while it fails is told its revisions failed (from another
/// thread), and its later revisions are dropped until it has undone them (`discard`).
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
                DispatchQueue.global().async { listener.failed(after: sequence - 1, error: failure) }
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
