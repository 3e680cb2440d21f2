// obsd — from settings to a server configuration: the data directory, the listener
// (a path, or the sockets systemd passed), sync policy, limits, heartbeat.

import Logging
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
            listener = .path(s.socketPath ?? SocketPath.defaultPath(environment: environment))
        } else {
            listener = .inherited(inherited.map(\.descriptor))
            if let path = s.socketPath {
                logger.notice("socket-activated: serving the sockets systemd passed, not socket.path \(path)")
            }
        }
        var config = ServerConfiguration(listener: listener)
        config.socketMode = s.socketMode
        config.socketUser = s.socketUser
        config.socketGroup = s.socketGroup
        config.limits = limits(s)
        config.policy = try policy(s)
        config.historyLimit = s.historyLimit
        config.historyMaxAge = s.historyMaxAgeSeconds > 0 ? .seconds(s.historyMaxAgeSeconds) : nil
        if s.threads > 0 { config.threads = s.threads }
        config.faultFile = environment["OBSD_FAULT_FILE"]  // test seam, see FaultInjection
        if !s.inMemory {
            guard let directory = s.dataDir ?? DataDirectory.defaultPath(environment: environment) else {
                throw Failure(description: "no data directory: set storage.data-dir (or HOME), or storage.in-memory")
            }
            config.storage = .sqlite(
                directory: directory, sync: s.sync == "relaxed" ? .relaxed(interval: .milliseconds(s.syncIntervalMS)) : .always)
        }
        let notifier = SystemdNotifier()
        if let timeout = notifier.watchdogTimeout {
            config.heartbeatInterval = timeout / 2
        } else if notifier.isActive {
            config.heartbeatInterval = .seconds(5)  // keeps STATUS= current
        }
        return config
    }

    /// The limits of `s`.
    static func limits(_ s: DaemonSettings) -> Limits {
        var limits = Limits()
        limits.maxLine = s.maxLine
        limits.queueBytes = s.queueBytes
        limits.queueEvents = s.queueEvents
        limits.overflowGrace = .seconds(s.overflowGraceSeconds)
        limits.maxValueBytes = s.maxValueBytes
        limits.maxKeysPerRequest = s.maxKeysPerRequest
        limits.maxSubscriptionsPerConnection = s.maxSubscriptionsPerConnection
        limits.maxKeysPerRepository = s.maxKeysPerRepository
        limits.maxRepositories = s.maxRepositories
        limits.maxConnections = s.maxConnections
        limits.maxConnectionsPerUID = s.maxConnectionsPerUID
        return limits
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
