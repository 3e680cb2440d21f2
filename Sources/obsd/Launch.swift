// obsd — from settings to a server configuration: the data directory or the etcd cluster, the listener
// (a path, or the sockets systemd passed), sync policy, limits, heartbeat.

import Logging
import ObsCluster
import ObsConfig
import ObsProtocol
import ObsServer
import ObsStore
import Systemd

#if canImport(Glibc)
import Glibc
#endif

enum Launch {
    struct Failure: Error, CustomStringConvertible {
        let description: String
    }

    static func serverConfiguration(_ s: DaemonSettings, environment: [String: String], logger: Logger) throws -> ServerConfiguration {
        let inherited = try ListenFDs.take()
        let listener: Listener
        if inherited.isEmpty {
            // OBSD_SOCKET is already part of the settings (the environment layer).
            let path = s.socketPath ?? SocketPath.defaultPath(environment: environment)
            if let problem = SocketPath.problem(path) { throw Failure(description: problem) }
            listener = .path(path)
        } else {
            listener = .inherited(inherited.map(\.descriptor))
            if let path = s.socketPath {
                logger.notice("socket-activated: serving the sockets systemd passed, not socket.path \(path)")
            }
        }
        let storage: StorageConfiguration
        if !s.etcdEndpoints.isEmpty {
            var cluster = ClusterStorage.Configuration(endpoints: s.etcdEndpoints, prefix: s.etcdPrefix, historyLimit: s.historyLimit)
            cluster.readTimeout = .seconds(1)
            do {
                storage = .custom(try ClusterStorage(configuration: cluster, logger: logger))
            } catch {
                throw Failure(description: "storage.etcd-endpoints: \(error)")
            }
            if let dataDir = s.dataDir { logger.notice("storage.etcd-endpoints is set: repositories live in etcd, not in \(dataDir)") }
        } else if s.inMemory {
            storage = .inMemory
        } else {
            guard let directory = s.dataDir ?? DataDirectory.defaultPath(environment: environment) else {
                throw Failure(description: "no data directory: set storage.data-dir (or HOME), or storage.in-memory")
            }
            storage = .disk(
                directory: directory, sync: s.sync == "relaxed" ? .relaxed(interval: .milliseconds(s.syncIntervalMS)) : .always)
        }
        let notifier = SystemdNotifier()
        // The watchdog wants pings every half of its timeout; under systemd without one, the
        // heartbeat still keeps STATUS= current.
        let heartbeat: Duration? = notifier.watchdogTimeout.map { $0 / 2 } ?? (notifier.isActive ? .seconds(5) : nil)
        let (owner, group) = try socketOwnership(s)
        return ServerConfiguration(
            listener: listener, socketMode: s.socketMode, socketOwner: owner, socketGroup: group, limits: limits(s),
            policy: try policy(s), storage: storage, historyLimit: s.historyLimit, historyMaxBytes: s.historyMaxBytes,
            historyMaxAge: s.historyMaxAgeSeconds > 0 ? .seconds(s.historyMaxAgeSeconds) : nil, historyTombstones: s.historyTombstones,
            threads: s.threads > 0 ? s.threads : nil, busyPoll: .microseconds(s.busyPollMicroseconds),
            heartbeatInterval: heartbeat)
    }

    /// The socket file's owner and group as ids, from names or numbers; unknown names are
    /// configuration errors (checked by --check-config too).
    static func socketOwnership(_ s: DaemonSettings) throws(ConfigError) -> (owner: UInt32?, group: UInt32?) {
        let owner = try s.socketUser.map { (name) throws(ConfigError) -> UInt32 in
            if let id = UInt32(name) { return id }
            guard let entry = getpwnam(name) else { throw ConfigError("socket.user: no user named \(name)") }
            return entry.pointee.pw_uid
        }
        let group = try s.socketGroup.map { (name) throws(ConfigError) -> UInt32 in
            if let id = UInt32(name) { return id }
            guard let entry = getgrnam(name) else { throw ConfigError("socket.group: no group named \(name)") }
            return entry.pointee.gr_gid
        }
        return (owner, group)
    }

    /// `obsd --repair-log`: opens the data directory of `s` with its write-ahead log cut at the
    /// first damaged record (everything after it dropped, every epoch renewed, a snapshot
    /// written), closes it, and returns what the store reported.
    static func repairLog(_ s: DaemonSettings, environment: [String: String], logger: Logger) throws -> [String] {
        guard s.etcdEndpoints.isEmpty, !s.inMemory else {
            throw Failure(description: "--repair-log repairs a data directory's write-ahead log: not with storage.etcd-endpoints or storage.in-memory")
        }
        guard let directory = s.dataDir ?? DataDirectory.defaultPath(environment: environment) else {
            throw Failure(description: "no data directory: set storage.data-dir (or HOME)")
        }
        var options = DiskStorage.Options(
            directory: directory, sync: .always, historyLimit: s.historyLimit, historyMaxBytes: s.historyMaxBytes,
            historyMaxAge: s.historyMaxAgeSeconds > 0 ? .seconds(s.historyMaxAgeSeconds) : nil)
        options.tombstoneLimit = s.historyTombstones
        options.repairLog = true
        let storage = try DiskStorage(options: options, logger: logger)
        let notices = storage.notices
        storage.close()
        return notices
    }

    /// The limits of `s`.
    static func limits(_ s: DaemonSettings) -> Limits {
        Limits(
            maxLine: s.maxLine, queueBytes: s.queueBytes, queueEvents: s.queueEvents, overflowGrace: .seconds(s.overflowGraceSeconds),
            maxValueBytes: s.maxValueBytes, maxRevisionBytes: s.maxRevisionBytes, maxKeysPerRequest: s.maxKeysPerRequest,
            maxSubscriptionsPerConnection: s.maxSubscriptionsPerConnection, maxKeysPerRepository: s.maxKeysPerRepository,
            maxRepositories: s.maxRepositories, maxConnections: s.maxConnections, maxConnectionsPerUID: s.maxConnectionsPerUID,
            maxLeasesPerUID: s.maxLeasesPerUID, maxStartBytes: s.maxStartBytes)
    }

    /// Raises the soft descriptor limit to the hard one (the soft default of 1024 would cap
    /// a daemon started by hand at about a thousand clients, far below limits.max-connections;
    /// systemd's documentation asks services that need more to do exactly this), and warns
    /// when even the hard limit cannot hold `maxConnections` plus the daemon's own files.
    static func raiseDescriptorLimit(for maxConnections: Int, logger: Logger) {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return }
        if limit.rlim_cur < limit.rlim_max {
            var raised = limit
            raised.rlim_cur = limit.rlim_max
            if setrlimit(Int32(RLIMIT_NOFILE.rawValue), &raised) == 0 { limit = raised }
        }
        let needed = rlim_t(maxConnections) + 64
        if limit.rlim_cur != rlim_t.max && limit.rlim_cur < needed {  // rlim_t.max is RLIM_INFINITY
            logger.warning(
                "the descriptor limit (\(limit.rlim_cur)) is below limits.max-connections (\(maxConnections)) plus the daemon's own files; connections past it are refused (raise LimitNOFILE= or ulimit -n)")
        }
    }

    /// The access policy of `s`; user and group names are looked up now.
    static func policy(_ s: DaemonSettings) throws(AccessPolicyError) -> AccessPolicy {
        try AccessPolicy(rules: s.accessRules.map { ($0.repos, $0.users, $0.groups, $0.allow) }, fallback: s.accessDefault)
    }
}

/// Tells systemd about the server's life: READY=1 once serving, STATUS= and WATCHDOG=1 on
/// every heartbeat (proof that every event loop runs), STOPPING=1 at shutdown.
struct SystemdBridge: ServerObserver {
    let logger: Logger
    let notifier = SystemdNotifier()

    func serverDidStart(_ status: ServerStatus) {
        if notifier.ready(status: "serving: \(status)") { logger.debug("notified systemd: READY=1") }
    }

    func serverHeartbeat(_ status: ServerStatus) {
        notifier.notify("WATCHDOG=1\nSTATUS=serving: \(status)")
    }

    func serverWillStop() {
        notifier.stopping()
    }
}
