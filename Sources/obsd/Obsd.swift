// obsd — the daemon executable: reads its settings (flags > environment > file >
// defaults), sets up logging, takes sockets passed by systemd, and runs the server until
// SIGTERM or SIGINT (exit 0). SIGHUP reloads the configuration file.

import ArgumentParser
import Logging
import ObsConfig
import ObsProtocol
import ObsServer
import ObsStore
import ServiceLifecycle
import Systemd

#if canImport(Glibc)
import Glibc
#endif

@main
struct Obsd: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "obsd",
        abstract: "Event-bus daemon: keyed observable repositories over a Unix socket.",
        discussion: """
            Every setting has a built-in default, a key in the configuration file (config/obsd.toml documents them all),
            an environment variable and a flag; flags win over the environment, the environment over the file.
            Clients speak line-delimited JSON on the socket (docs/PROTOCOL.md); obsctl is the CLI.
            SIGTERM or SIGINT stop the daemon gracefully (exit 0); SIGHUP reloads the log level and connection limits.
            Exit status: 0 stopped, 1 failed, 64 bad flags, 78 bad configuration.
            """,
        version: ObsServer.version)

    @Option(help: ArgumentHelp("Configuration file (default: none; also $OBSD_CONFIG).", valueName: "file"))
    var config: String?

    @Option(help: ArgumentHelp("Check a configuration file, print the settings it yields, and exit.", valueName: "file"))
    var checkConfig: String?

    @Option(help: ArgumentHelp("The Unix socket to serve [socket.path].", valueName: "path"))
    var socket: String?

    @Option(help: ArgumentHelp("Permission bits of the socket file, octal [socket.mode, 0660].", valueName: "mode"))
    var socketMode: String?

    @Option(help: ArgumentHelp("Owner of the socket file: a user name or uid [socket.user].", valueName: "user"))
    var socketUser: String?

    @Option(help: ArgumentHelp("Group of the socket file: a group name or gid [socket.group].", valueName: "group"))
    var socketGroup: String?

    @Option(help: ArgumentHelp("Directory for persistent data [storage.data-dir].", valueName: "dir"))
    var dataDir: String?

    @Flag(help: "Keep repositories in memory only: nothing survives a restart [storage.in-memory].")
    var inMemory = false

    @Option(help: ArgumentHelp("When a write is acknowledged: always or relaxed [storage.sync, always].", valueName: "policy"))
    var sync: String?

    @Option(help: ArgumentHelp("With --sync relaxed: the longest time between fsyncs [storage.sync-interval-ms, 1000].", valueName: "ms"))
    var syncInterval: Int?

    @Option(help: ArgumentHelp("Revisions kept per repository for `since` [history.limit, 10000].", valueName: "n"))
    var historyLimit: Int?

    @Option(help: ArgumentHelp("Drop history older than this; 0: no age limit [history.max-age-seconds, 0].", valueName: "s"))
    var historyMaxAge: Int?

    @Option(help: ArgumentHelp("Longest request line in bytes [limits.max-line, 1048576].", valueName: "bytes"))
    var maxLine: Int?

    @Option(help: ArgumentHelp("Outgoing queue limit per connection in bytes [limits.queue-bytes, 16777216].", valueName: "bytes"))
    var queueBytes: Int?

    @Option(help: ArgumentHelp("Outgoing queue limit per connection in events [limits.queue-events, 100000].", valueName: "n"))
    var queueEvents: Int?

    @Option(help: ArgumentHelp("Seconds an overflowed connection may take to read its last messages [limits.overflow-grace-seconds, 30].", valueName: "s"))
    var overflowGrace: Int?

    @Option(help: ArgumentHelp("Largest value, in bytes of JSON [limits.max-value-bytes, 524288].", valueName: "bytes"))
    var maxValueBytes: Int?

    @Option(help: ArgumentHelp("Most keys in one subscribe or operations in one batch [limits.max-keys-per-request, 4096].", valueName: "n"))
    var maxKeysPerRequest: Int?

    @Option(help: ArgumentHelp("Most live subscriptions per connection [limits.max-subscriptions-per-connection, 1024].", valueName: "n"))
    var maxSubscriptions: Int?

    @Option(help: ArgumentHelp("Most keys per repository [limits.max-keys-per-repository, 1000000].", valueName: "n"))
    var maxKeysPerRepository: Int?

    @Option(help: ArgumentHelp("Most repositories [limits.max-repositories, 10000].", valueName: "n"))
    var maxRepositories: Int?

    @Option(help: ArgumentHelp("Most connections [limits.max-connections, 16384].", valueName: "n"))
    var maxConnections: Int?

    @Option(help: ArgumentHelp("Most connections per uid, root and obsd's uid exempt [limits.max-connections-per-uid, 1024].", valueName: "n"))
    var maxConnectionsPerUid: Int?

    @Option(help: ArgumentHelp("What peers no access rule matches may do: none, read or write [access.default, none].", valueName: "policy"))
    var accessDefault: String?

    @Option(help: ArgumentHelp("trace, debug, info, notice, warning, error or critical [log.level, info].", valueName: "level"))
    var logLevel: String?

    @Option(help: ArgumentHelp("auto (the journal under systemd, else stderr), journal or stderr [log.target, auto].", valueName: "target"))
    var logTarget: String?

    @Option(help: ArgumentHelp("Event-loop threads; 0: one per CPU [server.threads, 0].", valueName: "n"))
    var threads: Int?

    /// The flags given, by configuration key.
    var flagLayer: [String: RawSetting] {
        var flags: [String: RawSetting] = [:]
        func put(_ key: String, _ value: String?) { if let value { flags[key] = .string(value) } }
        func put(_ key: String, _ value: Int?) { if let value { flags[key] = .integer(value) } }
        put("socket.path", socket)
        put("socket.mode", socketMode)
        put("socket.user", socketUser)
        put("socket.group", socketGroup)
        put("storage.data-dir", dataDir)
        if inMemory { flags["storage.in-memory"] = .boolean(true) }
        put("storage.sync", sync)
        put("storage.sync-interval-ms", syncInterval)
        put("history.limit", historyLimit)
        put("history.max-age-seconds", historyMaxAge)
        put("limits.max-line", maxLine)
        put("limits.queue-bytes", queueBytes)
        put("limits.queue-events", queueEvents)
        put("limits.overflow-grace-seconds", overflowGrace)
        put("limits.max-value-bytes", maxValueBytes)
        put("limits.max-keys-per-request", maxKeysPerRequest)
        put("limits.max-subscriptions-per-connection", maxSubscriptions)
        put("limits.max-keys-per-repository", maxKeysPerRepository)
        put("limits.max-repositories", maxRepositories)
        put("limits.max-connections", maxConnections)
        put("limits.max-connections-per-uid", maxConnectionsPerUid)
        put("access.default", accessDefault)
        put("log.level", logLevel)
        put("log.target", logTarget)
        put("server.threads", threads)
        return flags
    }

    func validate() throws {
        if inMemory && dataDir != nil { throw ValidationError("use one of --data-dir and --in-memory") }
    }

    func run() async throws {
        let environment = ProcessEnvironment.current
        let flags = flagLayer
        if let checkConfig {
            let settings = try Self.orExit { () throws(ConfigError) in try Self.load(file: checkConfig, environment: [:], flags: flags) }
            let policy = try Self.orExit { () throws(ConfigError) in
                do throws(AccessPolicyError) { return try Launch.policy(settings) } catch { throw ConfigError("\(checkConfig): \(error)") }
            }
            print("\(checkConfig): OK")
            for setting in Setting.all {
                print("\(setting.key) = \(setting.describe(settings))    # --\(setting.flag), $\(setting.environment)")
            }
            print("access rules: \(policy.rules.count)")
            return
        }
        let configPath = config ?? environment["OBSD_CONFIG"].flatMap { $0.isEmpty ? nil : $0 }
        let settings = try Self.orExit { () throws(ConfigError) in try Self.load(file: configPath, environment: environment, flags: flags) }

        // Data files are the daemon's alone; the socket's mode is set explicitly.
        umask(0o077)
        let level = LogLevelSource(Logger.Level(rawValue: settings.logLevel) ?? .info)
        let journal = Logging.useJournal(target: settings.logTarget, environment: environment)
        LoggingSystem.bootstrap { label in Logging.handler(label: label, journal: journal, level: level) }
        let logger = Logger(label: "obsd")
        Launch.raiseDescriptorLimit(for: settings.maxConnections, logger: logger)

        let server: ObsServer
        do {
            server = ObsServer(
                configuration: try Launch.serverConfiguration(settings, environment: environment, logger: logger),
                logger: logger, observer: SystemdBridge(logger: logger))
        } catch {
            logger.critical("obsd cannot start: \(error)")
            throw ExitCode(78)
        }
        let reload = ReloadService(
            server: server, logger: logger, level: level,
            reread: { () throws(ConfigError) in try Self.load(file: configPath, environment: environment, flags: flags) })
        let group = ServiceGroup(
            configuration: .init(
                services: [.init(service: server), .init(service: reload, successTerminationBehavior: .ignore)],
                gracefulShutdownSignals: [.sigterm, .sigint],
                logger: logger))
        do {
            try await group.run()
        } catch {
            logger.critical("obsd failed: \(error)")
            throw ExitCode.failure
        }
    }

    /// Defaults ← file ← environment ← flags.
    static func load(file path: String?, environment: [String: String], flags: [String: RawSetting]) throws(ConfigError) -> DaemonSettings {
        let file = try path.map { (p) throws(ConfigError) in try ConfigFile.load(path: p) }
        return try DaemonSettings.resolve(file: file, environment: environment, flags: flags)
    }

    /// Runs `body`; a configuration error is printed and exits with status 78 (EX_CONFIG).
    static func orExit<T>(_ body: () throws(ConfigError) -> T) throws -> T {
        do {
            return try body()
        } catch {
            var stderr = StandardError()
            print("obsd: \(error)", to: &stderr)
            throw ExitCode(78)
        }
    }
}

/// Writes to standard error.
struct StandardError: TextOutputStream {
    mutating func write(_ string: String) {
        var text = string
        text.withUTF8 { _ = Glibc.write(2, $0.baseAddress, $0.count) }
    }
}
