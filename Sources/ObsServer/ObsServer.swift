// ObsServer — the daemon as a `Service`: configuration, listening (binding a path or
// adopting sockets passed by socket activation), serving connections on SwiftNIO event
// loops, a heartbeat that proves every event loop still runs, and graceful shutdown.
//
// Module map: `Hub` (repositories, counters) → `Repository` (state, index, delivery,
// history, durability) → `Outbox` (per-connection ordered output) ← `Session` (request
// execution) ← `ConnectionHandler` (framing, backpressure) ← `ObsServer` (this file).

import Logging
import NIOCore
import NIOPosix
import ObsProtocol
import ObsStore
import ObservableKit
import ServiceLifecycle
import Synchronization

/// Where the daemon accepts connections.
public enum Listener: Sendable, Equatable {
    /// Bind this path (creating its directory, replacing a stale socket).
    case path(String)
    /// Serve these already-bound, listening sockets (passed by systemd socket activation).
    case inherited([Int32])
}

/// Where the daemon keeps repositories.
public enum StorageConfiguration: Sendable {
    /// Nothing persists (tests, ephemeral buses).
    case inMemory
    /// A write-ahead log and a compacted state in `directory`, with the given sync policy.
    case disk(directory: String, sync: SyncPolicy)
    /// A storage the embedder made (e.g. one that fails on demand, in tests).
    case custom(any Storage)
}

/// Everything the daemon is configured with. The defaults are the daemon's settings'
/// (ObsConfig); this type has none of its own.
public struct ServerConfiguration: Sendable {
    public var listener: Listener
    /// Permission bits of a socket file the daemon binds itself.
    public var socketMode: UInt32
    /// Owner and group of a socket file the daemon binds itself (nil: left as created).
    public var socketOwner: UInt32?
    public var socketGroup: UInt32?
    /// Every limit (reloadable, see `ObsServer.reload`).
    public var limits: Limits
    /// Who may read or write which repositories (reloadable).
    public var policy: AccessPolicy
    /// Where repositories are kept.
    public var storage: StorageConfiguration
    /// Revisions kept per repository for `since` replay.
    public var historyLimit: Int
    /// Bytes of revisions kept per repository (`RevisionRecord.byteSize`).
    public var historyMaxBytes: Int
    /// History older than this is dropped (nil: kept until pushed out by `historyLimit`).
    public var historyMaxAge: Duration?
    /// Event-loop threads; nil: one per CPU the process may run on.
    public var threads: Int?
    /// How often to prove the event loops alive (for a watchdog); nil: never.
    public var heartbeatInterval: Duration?

    public init(
        listener: Listener, socketMode: UInt32, socketOwner: UInt32?, socketGroup: UInt32?, limits: Limits, policy: AccessPolicy,
        storage: StorageConfiguration, historyLimit: Int, historyMaxBytes: Int, historyMaxAge: Duration?, threads: Int?,
        heartbeatInterval: Duration?
    ) {
        self.listener = listener
        self.socketMode = socketMode
        self.socketOwner = socketOwner
        self.socketGroup = socketGroup
        self.limits = limits
        self.policy = policy
        self.storage = storage
        self.historyLimit = historyLimit
        self.historyMaxBytes = historyMaxBytes
        self.historyMaxAge = historyMaxAge
        self.threads = threads
        self.heartbeatInterval = heartbeatInterval
    }
}

/// Why the server stopped on its own.
public struct ServerFailure: Error, Sendable, CustomStringConvertible {
    public let description: String
}

/// What the server is doing, for status lines.
public struct ServerStatus: Sendable, CustomStringConvertible {
    public let connections: Int
    public let subscriptions: Int
    public let repositories: Int

    public var description: String {
        "\(connections) connection\(connections == 1 ? "" : "s"), \(subscriptions) subscription\(subscriptions == 1 ? "" : "s"), "
            + "\(repositories) repositor\(repositories == 1 ? "y" : "ies")"
    }
}

/// Told about the server's life: the place to notify a service manager.
public protocol ServerObserver: Sendable {
    /// The sockets accept connections and the store is open.
    func serverDidStart(_ status: ServerStatus)
    /// Every event loop ran a task within the last heartbeat interval.
    func serverHeartbeat(_ status: ServerStatus)
    /// Shutdown has begun.
    func serverWillStop()
}

/// The obsd server.
public final class ObsServer: Service, Sendable {
    /// The daemon's version, reported by `hello`.
    public static let version = ObsRelease.version

    public let configuration: ServerConfiguration
    private let logger: Logger
    private let observer: (any ServerObserver)?
    private let runtime: Runtime
    /// Set once serving, for `status` and `reload`.
    private let hub = Locked<Hub?>(nil)
    /// Why the server must stop (a shared store's history no longer matches), and how to
    /// stop it once it listens.
    private let fatal = Locked<(reason: String?, stop: (@Sendable () -> Void)?)>((nil, nil))

    public init(configuration: ServerConfiguration, logger: Logger, observer: (any ServerObserver)? = nil) {
        self.configuration = configuration
        self.logger = logger
        self.observer = observer
        self.runtime = Runtime(limits: configuration.limits, policy: configuration.policy)
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
        switch configuration.storage {
        case .inMemory:
            return InMemoryStorage()
        case .disk(let directory, let sync):
            let options = DiskStorage.Options(
                directory: directory, sync: sync, historyLimit: configuration.historyLimit,
                historyMaxBytes: configuration.historyMaxBytes, historyMaxAge: configuration.historyMaxAge)
            return try DiskStorage(options: options, logger: logger)
        case .custom(let storage):
            return storage
        }
    }

    public func run() async throws {
        let config = configuration
        let (threads, threadsReason) = config.threads.map { ($0, "server.threads") } ?? EventLoops.sized()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: max(1, threads))
        let opened = ContinuousClock.now
        let storage: any Storage
        let hub: Hub
        do {
            if case .path(let path) = config.listener { try SocketFile.prepare(path) }
            storage = try openStorage()
        } catch {
            try? await group.shutdownGracefully()
            throw error
        }
        // A shared store (etcd): nothing is served until the cluster was reached and read.
        if let shared = storage as? any SharedStorage {
            logger.info("reaching the shared store before serving", metadata: ["storage": "\(storage.summary)"])
            do {
                try await cancelWhenGracefulShutdown { try await shared.connect() }
            } catch {
                storage.close()
                try? await group.shutdownGracefully()
                if error is CancellationError {
                    logger.info("obsd stopped before it reached the shared store")
                    return
                }
                throw error
            }
        }
        do {
            let limits = HistoryLimits(
                count: config.historyLimit, maxBytes: config.historyMaxBytes, maxAge: config.historyMaxAge?.components.seconds)
            hub = try Hub(
                loops: Array(group.makeIterator()), historyLimits: limits, storage: storage, runtime: runtime,
                onHistoryLost: { [weak self] reason in self?.historyLost(reason) })
        } catch {
            storage.close()
            try? await group.shutdownGracefully()
            throw error
        }
        (storage as? any SharedStorage)?.start(delivering: hub)
        let (repositories, keys) = hub.listed().reduce(into: (0, 0)) { $0.0 += 1; $0.1 += $1.summary.keys }
        logger.info(
            "storage ready",
            metadata: [
                "storage": "\(storage.summary)", "repositories": "\(repositories)", "keys": "\(keys)",
                "loadSeconds": "\(ContinuousClock.now - opened)",
            ])
        for notice in storage.notices { logger.notice("\(notice)") }

        let connections = ConnectionRegistry()
        let listeners: [any Channel]
        var ownSocket: (path: String, identity: SocketFile.Identity?)? = nil
        do {
            listeners = try await listen(group: group, hub: hub, connections: connections)
            if case .path(let path) = config.listener { ownSocket = (path, SocketFile.identity(of: path)) }
        } catch {
            storage.close()
            try? await group.shutdownGracefully()
            throw error
        }
        self.hub.withLock { $0 = hub }
        logger.info(
            "obsd serving",
            metadata: ["listener": "\(config.listener)", "version": "\(Self.version)", "threads": "\(threads)", "threadsFrom": "\(threadsReason)"])
        observer?.serverDidStart(status)

        let closeAll: @Sendable () -> Void = { for listener in listeners { listener.close(promise: nil) } }
        if fatal.withLock({ f in f.stop = closeAll; return f.reason != nil }) { closeAll() }
        await withTaskCancellationHandler {
            await withGracefulShutdownHandler {
                await withTaskGroup(of: Void.self) { tasks in
                    if let interval = config.heartbeatInterval {
                        tasks.addTask { await self.beat(every: interval, loops: group) }
                    }
                    for listener in listeners { try? await listener.closeFuture.get() }
                    tasks.cancelAll()
                }
            } onGracefulShutdown: {
                closeAll()
            }
        } onCancel: {
            closeAll()
        }

        observer?.serverWillStop()
        logger.info("obsd shutting down", metadata: ["connections": "\(connections.count)"])
        if let ownSocket { SocketFile.remove(ownSocket.path, ifStill: ownSocket.identity) }
        // Stop taking requests, make durable what storage holds (its replies fill their
        // slots), let those replies reach their clients (two seconds at most), then close.
        await connections.quiesceAll()
        storage.close()
        await connections.drainAll(within: .seconds(2))
        await connections.closeAll()
        try await group.shutdownGracefully()
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

    /// Binds the configured path, or adopts the inherited sockets.
    private func listen(group: MultiThreadedEventLoopGroup, hub: Hub, connections: ConnectionRegistry) async throws -> [any Channel] {
        let (runtime, logger) = (self.runtime, self.logger)
        let startTime = ContinuousClock.now
        let bootstrap = ServerBootstrap(group: group)
            .serverChannelOption(.backlog, value: 1024)
            .childChannelOption(.maxMessagesPerRead, value: 16)
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelInitializer { child in
                connections.add(child)
                let limits = runtime.snapshot.limits
                return child.eventLoop.makeCompletedFuture {
                    try child.pipeline.syncOperations.addHandler(
                        ConnectionHandler(hub: hub, limits: limits, startTime: startTime, logger: logger))
                }
            }
        switch configuration.listener {
        case .path(let path):
            // Bound beside its path, given its mode and owner, then renamed into place: the
            // socket never shows at `path` with other permissions than the configured ones.
            // (A leftover staging file is this pid's own; the path itself was checked by
            // `SocketFile.prepare` and is never removed here.)
            let staging = SocketFile.stagingPath(for: path)
            let channel = try await bootstrap.bind(unixDomainSocketPath: staging ?? path, cleanupExistingSocketFile: staging != nil).get()
            do {
                try SocketFile.setOwnership(
                    staging ?? path, mode: configuration.socketMode, owner: configuration.socketOwner, group: configuration.socketGroup)
                if let staging { try SocketFile.moveIntoPlace(staging, path) }
            } catch {
                if let staging { SocketFile.discard(staging) }
                try? await channel.close()
                throw error
            }
            return [channel]
        case .inherited(let descriptors):
            var channels: [any Channel] = []
            for fd in descriptors { channels.append(try await bootstrap.withBoundSocket(fd).get()) }
            return channels
        }
    }

    /// Reports a heartbeat every `interval` while every event loop runs (see `Heartbeat`).
    private func beat(every interval: Duration, loops: MultiThreadedEventLoopGroup) async {
        let logger = self.logger
        await Heartbeat(loops: Array(loops.makeIterator()), interval: interval).run { event in
            switch event {
            case .beat: self.observer?.serverHeartbeat(self.status)
            case .stalled: logger.error("an event loop has not run a task for \(interval); withholding the watchdog ping")
            case .resumed: logger.notice("event loops respond again; watchdog pings resume")
            }
        }
    }
}
