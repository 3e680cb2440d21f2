// ObsServer — the daemon as a `Service`: configuration, binding the socket, serving
// connections on SwiftNIO event loops, and graceful shutdown.
//
// Module map: `Hub` (repositories, counters) → `Repository` (state, index, delivery,
// history) → `Outbox` (per-connection ordered output) ← `Session` (request execution)
// ← `ConnectionHandler` (framing, backpressure) ← `ObsServer` (this file).

import Logging
import NIOCore
import NIOPosix
import ObsProtocol
import ObsStore
import ObservableKit
import ServiceLifecycle

/// Everything the daemon can be configured with, with its defaults.
public struct ServerConfiguration: Sendable {
    /// The Unix socket to serve.
    public var socketPath: String
    /// Permission bits of the socket file.
    public var socketMode: UInt32 = 0o660
    /// The longest request line, in bytes before the `\n`.
    public var maxLine: Int = ProtocolRules.defaultMaxLine
    /// The deepest nesting of arrays and objects accepted in a request.
    public var maxDepth: Int = JSONParser.defaultMaxDepth
    /// Where repositories are kept.
    public var storage: StorageConfiguration = .inMemory
    /// Revisions kept per repository for `since` replay.
    public var historyLimit: Int = 10_000
    /// History older than this is dropped (nil: kept until pushed out by `historyLimit`).
    public var historyMaxAge: Duration? = nil
    /// A connection's outgoing queue limit, in bytes.
    public var outboxMaxBytes: Int = 16 << 20
    /// A connection's outgoing queue limit, in events.
    public var outboxMaxEvents: Int = 100_000
    /// How long an overflowed connection may take to read its last messages.
    public var overflowGrace: Duration = .seconds(30)
    /// Event-loop threads.
    public var threads: Int = System.coreCount

    public init(socketPath: String) {
        self.socketPath = socketPath
    }
}

/// Where the daemon keeps repositories.
public enum StorageConfiguration: Sendable {
    /// Nothing persists (tests, ephemeral buses).
    case inMemory
    /// SQLite in `directory`, with the given sync policy. `faultFile` is a test seam (see
    /// `SQLiteStorage.Options.faultFile`); leave it nil.
    case sqlite(directory: String, sync: SyncPolicy, faultFile: String? = nil)
}

/// The obsd server.
public final class ObsServer: Service, Sendable {
    /// The daemon's version, reported by `hello`.
    public static let version = "0.1.0"

    public let configuration: ServerConfiguration
    private let logger: Logger
    private let onReady: (@Sendable () -> Void)?

    /// - Parameter onReady: called once the socket accepts connections.
    public init(configuration: ServerConfiguration, logger: Logger, onReady: (@Sendable () -> Void)? = nil) {
        self.configuration = configuration
        self.logger = logger
        self.onReady = onReady
    }

    private func openStorage() throws(StorageError) -> any Storage {
        switch configuration.storage {
        case .inMemory:
            return InMemoryStorage()
        case .sqlite(let directory, let sync, let faultFile):
            var options = SQLiteStorage.Options(directory: directory)
            options.sync = sync
            options.faultFile = faultFile
            options.historyLimit = configuration.historyLimit
            options.historyMaxAge = configuration.historyMaxAge
            return try SQLiteStorage(options: options)
        }
    }

    public func run() async throws {
        let config = configuration
        let group = MultiThreadedEventLoopGroup(numberOfThreads: max(1, config.threads))
        let opened = ContinuousClock.now
        let storage: any Storage
        let hub: Hub
        do {
            try SocketFile.prepare(config.socketPath)
            storage = try openStorage()
            hub = try Hub(
                historyLimit: config.historyLimit, historyMaxAge: config.historyMaxAge?.components.seconds, storage: storage,
                deliveryLoops: group)
        } catch {
            try? await group.shutdownGracefully()
            throw error
        }
        let (repositories, keys) = hub.listed().reduce(into: (0, 0)) { $0.0 += 1; $0.1 += $1.summary.keys }
        logger.info(
            "storage ready",
            metadata: [
                "storage": "\(storage.summary)", "repositories": "\(repositories)", "keys": "\(keys)",
                "loadSeconds": "\(ContinuousClock.now - opened)",
            ])
        let connections = ConnectionRegistry()
        let limits = OutboxLimits(
            maxBytes: config.outboxMaxBytes, maxEvents: config.outboxMaxEvents,
            grace: TimeAmount(config.overflowGrace))
        let settings = SessionSettings(maxLine: config.maxLine, maxDepth: config.maxDepth, startTime: .now)
        let logger = self.logger

        let channel: any Channel
        do {
            channel = try await ServerBootstrap(group: group)
                .serverChannelOption(.backlog, value: 1024)
                .childChannelOption(.maxMessagesPerRead, value: 16)
                .childChannelInitializer { child in
                    connections.add(child)
                    return child.eventLoop.makeCompletedFuture {
                        try child.pipeline.syncOperations.addHandler(
                            ConnectionHandler(hub: hub, limits: limits, settings: settings, logger: logger))
                    }
                }
                .bind(unixDomainSocketPath: config.socketPath).get()
            try SocketFile.setMode(config.socketPath, config.socketMode)
        } catch {
            storage.close()
            try? await group.shutdownGracefully()
            throw error
        }
        let identity = SocketFile.identity(of: config.socketPath)
        logger.info(
            "obsd serving",
            metadata: ["socket": "\(config.socketPath)", "version": "\(Self.version)", "threads": "\(config.threads)"])
        onReady?()

        await withTaskCancellationHandler {
            await withGracefulShutdownHandler {
                try? await channel.closeFuture.get()
            } onGracefulShutdown: {
                channel.close(promise: nil)
            }
        } onCancel: {
            channel.close(promise: nil)
        }

        logger.info("obsd shutting down", metadata: ["connections": "\(connections.count)"])
        SocketFile.remove(config.socketPath, ifStill: identity)
        await connections.closeAll()
        storage.close()
        try await group.shutdownGracefully()
        logger.info("obsd stopped")
    }
}

/// The open client connections, so shutdown can close them.
final class ConnectionRegistry: Sendable {
    private let channels = Locked<[ObjectIdentifier: any Channel]>([:])

    func add(_ channel: any Channel) {
        let id = ObjectIdentifier(channel)
        channels.withLock { $0[id] = channel }
        channel.closeFuture.whenComplete { [self] _ in
            _ = self.channels.withLock { $0.removeValue(forKey: id) }
        }
    }

    var count: Int { channels.withLock { $0.count } }

    /// Closes every connection and waits until they are closed.
    func closeAll() async {
        let all = channels.withLock { Array($0.values) }
        for channel in all { channel.close(promise: nil) }
        for channel in all { try? await channel.closeFuture.get() }
    }
}
