// TestSupport — the daemon run in the test process, on a temporary socket, with a storage the
// test provides: for failures no real disk produces on demand (EndToEndTests), and for
// settings the obsd binary refuses (ObsClusterTests: a tombstone bound below 100,000 on a
// store in etcd). Clients reach it over the socket exactly as they reach the obsd binary.

import Logging
import ObsServer
import ObsStore

public final class InProcessDaemon: Sendable {
    public let socketPath: String
    private let task: Task<Void, any Error>

    private struct Started: ServerObserver {
        let continuation: AsyncStream<Void>.Continuation
        func serverDidStart(_ status: ServerStatus) { continuation.yield() }
        func serverHeartbeat(_ status: ServerStatus) {}
        func serverWillStop() {}
    }

    /// Starts serving `storage` with the daemon's default settings but for the history's
    /// (`historyLimit` revisions and `historyTombstones` deleted keys per repository);
    /// returns once it accepts connections.
    public static func start(
        storage: any Storage, threads: Int = 2, historyLimit: Int = 10_000, historyTombstones: Int = Tombstones.defaultLimit
    ) async throws -> InProcessDaemon {
        let socketPath = TemporaryDirectory.make(prefix: "obsd-test-") + "/obsd.sock"
        let configuration = ServerConfiguration(
            listener: .path(socketPath), socketMode: 0o600, policy: .open, storage: .custom(storage), historyLimit: historyLimit,
            historyTombstones: historyTombstones, threads: threads)
        let (started, continuation) = AsyncStream<Void>.makeStream()
        let server = Server(configuration: configuration, logger: Logger(label: "obsd-in-process"), observer: Started(continuation: continuation))
        let task = Task { try await server.run() }
        var iterator = started.makeAsyncIterator()
        guard await iterator.next() != nil else { throw TestFailure("the in-process daemon did not start") }
        return InProcessDaemon(socketPath: socketPath, task: task)
    }

    private init(socketPath: String, task: Task<Void, any Error>) {
        self.socketPath = socketPath
        self.task = task
    }

    public func connect() throws -> WireConnection { try WireConnection(path: socketPath) }

    /// Stops serving (gracefully: storage is closed) and waits until it has.
    public func stop() async throws {
        task.cancel()
        try await task.value
    }
}
