// ObsServer — the daemon as a `Service`: opening storage, starting the event loops, listening
// (binding a path, or adopting sockets passed by socket activation), a heartbeat that proves
// every loop still runs, and graceful shutdown. Once it serves, it runs as a swift-service-
// lifecycle `ServiceGroup` of stages — event loops, storage, the shared store, connections,
// listener, heartbeat — which stop in the reverse order, stated once (`assemble`).
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
    private let hub = Locked<Hub?>(nil)
    /// Why the server must stop (a shared store's history no longer matches), and how to stop
    /// it once it serves.
    private let fatal = Locked<(reason: String?, stop: (@Sendable () -> Void)?)>((nil, nil))
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
            subscriptions: max(0, hub.stats.subscriptions.load(ordering: .relaxed)), repositories: hub.repositories.count)
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
        let opened = ContinuousClock.now
        if let path = config.listener.path { try SocketFile.prepare(path) }
        let storage = try openStorage()
        // Whatever fails from here on to serving, the storage it opened is closed here.
        let stages: [any Service]
        do {
            guard let assembled = try await assemble(storage, opened: opened) else {
                storage.close()
                logger.info("obsd stopped before it reached the shared store")
                return
            }
            stages = assembled
        } catch {
            storage.close()
            throw error
        }
        // The stages stop in the reverse of their order in `stages` (ServiceGroup's ordered
        // shutdown). The group runs in a task of its own, which cancelling this one does not
        // cancel: a cancellation stops the server in order, as a graceful shutdown does.
        let group = ServiceGroup(configuration: ServiceGroupConfiguration(services: stages.map { .init(service: $0) }, logger: logger))
        let stop: @Sendable () -> Void = { Task { await group.triggerGracefulShutdown() } }
        if fatal.withLock({ f in f.stop = stop; return f.reason != nil }) { stop() }
        let running = Task { try await group.run() }
        try await withTaskCancellationHandler {
            try await withGracefulShutdownHandler { try await running.value } onGracefulShutdown: { stop() }
        } onCancel: {
            stop()
        }
        if let reason = fatal.withLock({ $0.reason }) { throw ServerFailure(description: reason) }
        logger.info("obsd stopped")
    }

    /// Builds the server on `storage` and starts it serving: the shared store reached (nil:
    /// stopped before it was), the event loops and the hub made, the leases restored, the
    /// listener bound and the loops' threads started. Returns the stages that stop it, in
    /// the order they were started — the last to start stops first:
    ///
    /// 1. the event loops: what is still queued for clients gets two seconds to go out, then
    ///    every connection closes and the loops' threads end;
    /// 2. storage: what it holds is made durable, the replies waiting for it fill their
    ///    slots, and it closes;
    /// 3. the shared store, when there is one: the leases bound to this daemon's connections
    ///    end (1 s at most);
    /// 4. the connections: none takes another request;
    /// 5. the listener: no connection is accepted, and the socket path goes;
    /// 6. the heartbeat (when configured): no more watchdog pings.
    private func assemble(_ storage: any Storage, opened: ContinuousClock.Instant) async throws -> [any Service]? {
        let config = configuration
        let (threads, threadsReason) = config.threads.map { ($0, "server.threads") } ?? Loop.sized()
        let mode = StorageMode(storage)
        // A shared store (etcd): nothing is served until the cluster was reached and read.
        if let shared = mode.shared {
            logger.info("reaching the shared store before serving", metadata: ["storage": "\(storage.summary)"])
            do {
                try await cancelWhenGracefulShutdown { try await shared.connect() }
            } catch is CancellationError {
                return nil
            }
        }
        let loops = try (0..<max(1, threads)).map { i throws(SocketError) in try Loop(index: i, delivery: delivery, busyPoll: config.busyPollNanoseconds) }
        let limits = HistoryLimits(
            count: config.historyLimit, maxBytes: config.historyMaxBytes, maxAge: config.historyMaxAge?.components.seconds, tombstones: config.historyTombstones)
        let hub = try Hub(
            shards: loops.map(\.shard), historyLimits: limits, storage: storage, runtime: runtime,
            onHistoryLost: { [weak self] reason in self?.historyLost(reason) })
        if let shared = mode.shared, let delivery = hub.delivery { shared.start(delivering: delivery) }
        // Leases a persisting store kept: restored, and the deletions a restart owes made,
        // before anything is served.
        hub.leases.restore(time: WallClock.unixSeconds(), in: hub)
        let (repositories, keys) = hub.repositories.listed().reduce(into: (0, 0)) { $0.0 += 1; $0.1 += $1.summary.keys }
        logger.info(
            "storage ready",
            metadata: [
                "storage": "\(storage.summary)", "repositories": "\(repositories)", "keys": "\(keys)",
                "loadSeconds": "\(ContinuousClock.now - opened)",
            ])
        for notice in storage.notices { logger.notice("\(notice)") }

        let listening = try listen()
        let ownSocket = config.listener.path.map { (path: $0, identity: SocketFile.identity(of: $0)) }
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

        let (observer, logger) = (self.observer, self.logger)
        var stages: [any Service] = [
            Stage("event loops") {
                for loop in loops { await loop.drain(within: 2_000_000_000) }
                for loop in loops { await loop.run { for connection in loop.connections.all.values { connection.close() } } }
                for loop in loops { loop.io.stop() }
                for thread in threadsRunning { thread.join() }
            },
            Stage("storage") { storage.close() },
        ]
        if let shared = mode.shared { stages.append(Stage("shared store") { await shared.leave() }) }
        stages.append(Stage("connections") { for loop in loops { await loop.run { for connection in loop.connections.all.values { connection.quiesce() } } } })
        stages.append(
            Stage("listener") {
                observer?.serverWillStop()
                let open = await loops.asyncMap { loop in await loop.run { loop.connections.count } }.reduce(0, +)
                logger.info("obsd shutting down", metadata: ["connections": "\(open)"])
                await loops[0].run { acceptor.close() }
                if let ownSocket { SocketFile.remove(ownSocket.path, ifStill: ownSocket.identity) }
            })
        if let interval = config.heartbeatInterval {
            stages.append(Stage("heartbeat", running: { await self.beat(every: interval, loops: loops.map(\.io)) }, stop: {}))
        }
        return stages
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

/// One stage of the running server (see `Server.assemble`): it runs `running` (or nothing)
/// until the server stops, then `stop` undoes what its start did.
private struct Stage: Service, CustomStringConvertible {
    let description: String
    let running: @Sendable () async -> Void
    let stop: @Sendable () async -> Void

    init(_ name: String, running: @escaping @Sendable () async -> Void = {}, stop: @escaping @Sendable () async -> Void) {
        self.description = name
        self.running = running
        self.stop = stop
    }

    func run() async {
        await cancelWhenGracefulShutdown { await running() }
        try? await gracefulShutdown()
        await stop()
    }
}

extension Array where Element: Sendable {
    fileprivate func asyncMap<T>(_ transform: (Element) async -> T) async -> [T] {
        var out: [T] = []
        for element in self { out.append(await transform(element)) }
        return out
    }
}
