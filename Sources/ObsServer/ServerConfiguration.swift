// ObsServer — what the daemon is configured with and what it tells its observer: where it
// listens, where it keeps repositories, limits and policy, threads, the heartbeat.

import ObsStore

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
