// ObsServer — the daemon as a `Service`: opening storage, starting the event loops, listening
// (binding a path, or adopting sockets passed by socket activation), a heartbeat that proves
// every loop still runs, and graceful shutdown.
//
// The path of a write, from socket bytes to a subscriber's socket (README "Architecture"):
// Connection (read, frame) → Session (decode, check access) → Sequencer (plan and commit on
// the Repository's core, under its lock) → Repository.publish (the revision's record into the
// inbox of each loop with subscribers) → LoopShard.tick (route, append events to outboxes) →
// Connection.flush (one send per connection per tick).

import Logging
import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import ServiceLifecycle
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// The obsd server.
public final class Server: Service, Sendable {
    /// The daemon's version, reported by `hello`.
    public static let version = ObsRelease.version

    public let configuration: ServerConfiguration
    private let logger: Logger
    private let observer: (any ServerObserver)?
    private let runtime: Runtime
    /// Set once serving, for `status` and `reload`.
    private let hub = Mutex<Hub?>(nil)
    /// Why the server must stop (a shared store's history no longer matches), and how to stop
    /// it once it serves.
    private let fatal = Mutex<(reason: String?, stop: (@Sendable () -> Void)?)>((nil, nil))
    /// The delivery budget of every loop (in-process tests make it small).
    let delivery: DeliveryBudget

    public convenience init(configuration: ServerConfiguration, logger: Logger, observer: (any ServerObserver)? = nil) {
        self.init(configuration: configuration, logger: logger, observer: observer, delivery: DeliveryBudget())
    }

    init(configuration: ServerConfiguration, logger: Logger, observer: (any ServerObserver)?, delivery: DeliveryBudget) {
        self.configuration = configuration
        self.logger = logger
        self.observer = observer
        self.runtime = Runtime(limits: configuration.limits, policy: configuration.policy)
        self.delivery = delivery
    }

    /// Applies new limits and an access policy. Requests are checked against them at once;
    /// subscriptions to repositories a peer may no longer read end with a `revoked` event;
    /// per-connection limits (line length, outgoing queue) apply to new connections.
    public func reload(limits: Limits, policy: AccessPolicy) {
        if let hub = hub.withLock({ $0 }) {
            hub.reload(limits: limits, policy: policy)
        } else {
            runtime.update(limits: limits, policy: policy)
        }
        logger.info("limits and access policy reloaded", metadata: ["rules": "\(policy.rules.count)"])
    }

    /// Records that a reload ended: `failure` says why the running settings were kept, nil if
    /// the new ones apply. `stats` counts it (`reloads`, `reloadFailures`, `reloadError`), which
    /// is how `obsctl reload` (the units' `ExecReload=`) knows the reload it asked for is done.
    public func reloadEnded(failure: String?) {
        runtime.reloadEnded(failure: failure)
    }

    /// What the server is doing now (zeros before it serves).
    public var status: ServerStatus {
        guard let hub = hub.withLock({ $0 }) else { return ServerStatus(connections: 0, subscriptions: 0, repositories: 0) }
        return ServerStatus(
            connections: hub.stats.connections.load(ordering: .relaxed),
            subscriptions: max(0, hub.stats.subscriptions.load(ordering: .relaxed)), repositories: hub.repositoryCount)
    }

    private func openStorage() throws(StorageError) -> any Storage {
        switch configuration.storage.kind {
        case .inMemory:
            return InMemoryStorage()
        case .disk(let directory, let sync):
            var options = DiskStorage.Options(
                directory: directory, sync: sync, historyLimit: configuration.historyLimit,
                historyMaxBytes: configuration.historyMaxBytes, historyMaxAge: configuration.historyMaxAge)
            options.tombstoneLimit = configuration.historyTombstones
            return try DiskStorage(options: options, logger: logger)
        case .custom(let storage):
            return storage
        }
    }

    public func run() async throws {
        let config = configuration
        let (threads, threadsReason) = config.threads.map { ($0, "server.threads") } ?? Loop.sized()
        let opened = ContinuousClock.now
        if let path = config.listener.path { try SocketFile.prepare(path) }
        let storage = try openStorage()
        let mode = StorageMode(storage)
        // A shared store (etcd): nothing is served until the cluster was reached and read.
        if let shared = mode.shared {
            logger.info("reaching the shared store before serving", metadata: ["storage": "\(storage.summary)"])
            do {
                try await cancelWhenGracefulShutdown { try await shared.connect() }
            } catch {
                storage.close()
                if error is CancellationError {
                    logger.info("obsd stopped before it reached the shared store")
                    return
                }
                throw error
            }
        }
        let loops: [Loop]
        let hub: Hub
        do {
            loops = try (0..<max(1, threads)).map { i throws(SocketError) in try Loop(index: i, delivery: delivery, busyPoll: config.busyPollNanoseconds) }
            let limits = HistoryLimits(
                count: config.historyLimit, maxBytes: config.historyMaxBytes, maxAge: config.historyMaxAge?.components.seconds, tombstones: config.historyTombstones)
            hub = try Hub(
                shards: loops.map(\.shard), historyLimits: limits, storage: storage, runtime: runtime,
                onHistoryLost: { [weak self] reason in self?.historyLost(reason) })
        } catch {
            storage.close()
            throw error
        }
        if let shared = mode.shared, let delivery = hub.delivery { shared.start(delivering: delivery) }
        // Leases a persisting store kept: restored, and the deletions a restart owes made,
        // before anything is served.
        hub.leases.restore(time: WallClock.unixSeconds(), in: hub)
        let (repositories, keys) = hub.listed().reduce(into: (0, 0)) { $0.0 += 1; $0.1 += $1.summary.keys }
        logger.info(
            "storage ready",
            metadata: [
                "storage": "\(storage.summary)", "repositories": "\(repositories)", "keys": "\(keys)",
                "loadSeconds": "\(ContinuousClock.now - opened)",
            ])
        for notice in storage.notices { logger.notice("\(notice)") }

        let listening: [Int32]
        var ownSocket: (path: String, identity: SocketFile.Identity?)? = nil
        do {
            listening = try listen()
            if let path = config.listener.path { ownSocket = (path, SocketFile.identity(of: path)) }
        } catch {
            storage.close()
            throw error
        }
        let acceptor = Acceptor(loops: loops, hub: hub, runtime: runtime, logger: logger)
        // TTLs start again in full from the moment the daemon serves.
        hub.leases.startClocks(now: loops[0].io.currentTime)
        let threadsRunning = loops.map { loop in DedicatedThread { loop.io.run() } }
        await loops[0].run { for fd in listening { acceptor.listen(on: fd) } }
        self.hub.withLock { $0 = hub }
        logger.info(
            "obsd serving",
            metadata: ["listener": "\(config.listener)", "version": "\(Self.version)", "threads": "\(loops.count)", "threadsFrom": "\(threadsReason)"])
        observer?.serverDidStart(status)

        let (stopped, stop) = AsyncStream<Void>.makeStream()
        let stopServing: @Sendable () -> Void = { stop.finish() }
        if fatal.withLock({ f in f.stop = stopServing; return f.reason != nil }) { stopServing() }
        await withTaskCancellationHandler {
            await withGracefulShutdownHandler {
                await withTaskGroup(of: Void.self) { tasks in
                    if let interval = config.heartbeatInterval {
                        tasks.addTask { await self.beat(every: interval, loops: loops.map(\.io)) }
                    }
                    for await _ in stopped {}
                    tasks.cancelAll()
                }
            } onGracefulShutdown: {
                stopServing()
            }
        } onCancel: {
            stopServing()
        }

        observer?.serverWillStop()
        let open = await loops.asyncMap { loop in await loop.run { loop.connections.count } }.reduce(0, +)
        logger.info("obsd shutting down", metadata: ["connections": "\(open)"])
        await loops[0].run { acceptor.close() }
        if let ownSocket { SocketFile.remove(ownSocket.path, ifStill: ownSocket.identity) }
        // Stop taking requests, make durable what storage holds (its replies fill their
        // slots), let those replies reach their clients (two seconds at most), then close.
        for loop in loops { await loop.run { for connection in loop.connections.all.values { connection.quiesce() } } }
        // A shared store ends the leases bound to this daemon's connections now (1 s at most).
        await mode.shared?.leave()
        storage.close()
        for loop in loops { await loop.drain(within: 2_000_000_000) }
        for loop in loops { await loop.run { for connection in loop.connections.all.values { connection.close() } } }
        for loop in loops { loop.io.stop() }
        for thread in threadsRunning { thread.join() }
        if let reason = fatal.withLock({ $0.reason }) { throw ServerFailure(description: reason) }
        logger.info("obsd stopped")
    }

    /// A shared store's history no longer matches what this daemon served: stops the server,
    /// which then fails (a service manager restarts it, and it reads the store afresh).
    private func historyLost(_ reason: String) {
        logger.critical("stopping: \(reason); a restart reads the shared store afresh, and clients resubscribe")
        let stop = fatal.withLock { f -> (@Sendable () -> Void)? in
            if f.reason == nil { f.reason = reason }
            return f.stop
        }
        stop?()
    }

    /// Binds the configured path, or adopts the inherited sockets; returns the listening
    /// descriptors.
    private func listen() throws -> [Int32] {
        switch configuration.listener.kind {
        case .path(let path):
            // Bound beside its path, given its mode and owner, then renamed into place: the
            // socket never shows at `path` with other permissions than the configured ones.
            // (A leftover staging file is this pid's own; the path itself was checked by
            // `SocketFile.prepare` and is never removed here.)
            let staging = SocketFile.stagingPath(for: path)
            let fd = try Sockets.listen(on: staging ?? path)
            do {
                try SocketFile.setOwnership(
                    staging ?? path, mode: configuration.socketMode, owner: configuration.socketOwner, group: configuration.socketGroup)
                if let staging { try SocketFile.moveIntoPlace(staging, path) }
            } catch {
                if let staging { SocketFile.discard(staging) }
                close(fd)
                throw error
            }
            return [fd]
        case .inherited(let descriptors):
            for fd in descriptors { try Sockets.adopt(fd) }
            return descriptors
        }
    }

    /// Reports a heartbeat every `interval` while every event loop runs (see `Heartbeat`).
    private func beat(every interval: Duration, loops: [IOLoop]) async {
        let logger = self.logger
        await Heartbeat(loops: loops, interval: interval).run { event in
            switch event {
            case .beat: self.observer?.serverHeartbeat(self.status)
            case .stalled: logger.error("an event loop has not run a task for \(interval); withholding the watchdog ping")
            case .resumed: logger.notice("event loops respond again; watchdog pings resume")
            }
        }
    }
}

extension Array where Element: Sendable {
    fileprivate func asyncMap<T>(_ transform: (Element) async -> T) async -> [T] {
        var out: [T] = []
        for element in self { out.append(await transform(element)) }
        return out
    }
}
