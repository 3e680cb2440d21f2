// ObsServer — what the daemon is configured with and what it tells its observer: where it
// listens, where it keeps repositories, limits and policy, threads, the heartbeat.

import ObsStore

/// Where the daemon accepts connections.
///
/// A struct rather than an enum, so that a new kind of listener is not a breaking change to
/// code that inspects one.
public struct Listener: Sendable, Equatable, CustomStringConvertible {
    enum Kind: Sendable, Equatable {
        case path(String)
        case inherited([Int32])
    }

    let kind: Kind

    /// Bind this path (creating its directory, replacing a stale socket).
    public static func path(_ path: String) -> Listener { Listener(kind: .path(path)) }

    /// Serve these already-bound, listening sockets (passed by systemd socket activation).
    public static func inherited(_ descriptors: [Int32]) -> Listener { Listener(kind: .inherited(descriptors)) }

    /// The socket path the daemon binds itself, if it does.
    public var path: String? {
        if case .path(let path) = kind { return path }
        return nil
    }

    public var description: String {
        switch kind {
        case .path(let path): return path
        case .inherited(let descriptors): return "inherited sockets \(descriptors.map(String.init).joined(separator: ", "))"
        }
    }
}

/// Where the daemon keeps repositories.
///
/// A struct rather than an enum, so that a new kind of storage is not a breaking change.
public struct StorageConfiguration: Sendable {
    enum Kind: Sendable {
        case inMemory
        case disk(directory: String, sync: SyncPolicy)
        case custom(any Storage)
    }

    let kind: Kind

    /// Nothing persists (tests, ephemeral buses).
    public static let inMemory = StorageConfiguration(kind: .inMemory)

    /// A write-ahead log and a compacted state in `directory`, synced by `sync` (by default
    /// before every reply).
    public static func disk(directory: String, sync: SyncPolicy = .always) -> StorageConfiguration {
        StorageConfiguration(kind: .disk(directory: directory, sync: sync))
    }

    /// A storage the embedder made (e.g. an etcd cluster's, or one that fails on demand in
    /// tests).
    public static func custom(_ storage: any Storage) -> StorageConfiguration { StorageConfiguration(kind: .custom(storage)) }
}

/// Everything the daemon is configured with. Every setting but the listener has a default,
/// the same as the daemon's own (`obsd` with no configuration file; ObsConfig's
/// `DaemonSettings`, which a test keeps in step with these).
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
    /// Bytes of revisions kept per repository (keys and old and new values).
    public var historyMaxBytes: Int
    /// History older than this is dropped (nil: kept until pushed out by `historyLimit`).
    public var historyMaxAge: Duration?
    /// Deleted keys remembered per repository (tombstones), for catch-ups past the history.
    public var historyTombstones: Int
    /// Event-loop threads; nil: one per CPU the process may run on.
    public var threads: Int?
    /// The longest an event loop polls for work before it sleeps, adapting below it to how
    /// soon work comes (IO/BusyPoll.swift); zero: it never polls.
    public var busyPoll: Duration
    /// How often to prove the event loops alive (for a watchdog); nil: never.
    public var heartbeatInterval: Duration?

    /// A configuration that listens on `listener`; everything else has the daemon's defaults
    /// (only root and the daemon's own uid may use it, socket mode 0660), but for storage:
    /// in memory, where the daemon's default is a data directory chosen by who runs it.
    public init(
        listener: Listener, socketMode: UInt32 = 0o660, socketOwner: UInt32? = nil, socketGroup: UInt32? = nil,
        limits: Limits = Limits(), policy: AccessPolicy = .ownerOnly, storage: StorageConfiguration = .inMemory,
        historyLimit: Int = 10_000, historyMaxBytes: Int = 64 << 20, historyMaxAge: Duration? = nil,
        historyTombstones: Int = Tombstones.defaultLimit, threads: Int? = nil, busyPoll: Duration = .microseconds(50),
        heartbeatInterval: Duration? = nil
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
        self.historyTombstones = historyTombstones
        self.threads = threads
        self.busyPoll = busyPoll
        self.heartbeatInterval = heartbeatInterval
    }

    /// `busyPoll` in nanoseconds.
    var busyPollNanoseconds: UInt64 {
        let (seconds, attoseconds) = busyPoll.components
        return seconds < 0 ? 0 : UInt64(seconds) * 1_000_000_000 + UInt64(attoseconds / 1_000_000_000)
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
