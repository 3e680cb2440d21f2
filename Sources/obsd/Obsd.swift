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
            A data directory obsd refuses to start with for a damaged write-ahead log record, or a log segment cut short or removed, can be repaired with --repair-log.

            SETTINGS:
            """ + Setting.helpText,
        version: Server.version)

    @Option(help: ArgumentHelp("Configuration file (default: none; also $OBSD_CONFIG).", valueName: "file"))
    var config: String?

    @Option(help: ArgumentHelp("Check a configuration file, print the settings it yields, and exit.", valueName: "file"))
    var checkConfig: String?

    @Flag(
        help: ArgumentHelp(
            "Repair the data directory's write-ahead log and exit: cut it at the first damaged record, dropping that record and everything after it, or go on without what a segment cut short or removed held (their revisions are lost; every repository starts a new epoch). For a directory obsd refuses to start with, once you have kept a copy of it."
        ))
    var repairLog = false

    /// Every setting's flag (`--socket PATH`, `--in-memory`, …), parsed against the settings table.
    @Argument(parsing: .allUnrecognized, help: .hidden)
    var settingFlags: [String] = []

    func run() async throws {
        let environment = ProcessEnvironment.current
        let flags: [String: RawSetting]
        do {
            flags = try Setting.parseFlags(settingFlags)
        } catch {
            var stderr = StandardError()
            print("obsd: \(error)", to: &stderr)
            throw ExitCode(64)
        }
        if case .string(let inMemory)? = flags["storage.in-memory"], ["true", "1", "yes"].contains(inMemory), flags["storage.data-dir"] != nil {
            var stderr = StandardError()
            print("obsd: use one of --data-dir and --in-memory", to: &stderr)
            throw ExitCode(64)
        }
        if let checkConfig {
            let settings = try Self.orExit { () throws(ConfigError) in try Self.load(file: checkConfig, environment: [:], flags: flags) }
            let policy = try Self.orExit { () throws(ConfigError) in
                do throws(AccessPolicyError) { return try Launch.policy(settings) } catch { throw ConfigError("\(checkConfig): \(error)") }
            }
            _ = try Self.orExit { () throws(ConfigError) in
                do throws(ConfigError) { return try Launch.socketOwnership(settings) } catch { throw ConfigError("\(checkConfig): \(error)") }
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
        if repairLog {
            var stderr = StandardError()
            do {
                let notices = try Launch.repairLog(settings, environment: environment, logger: Logger(label: "obsd"))
                if !notices.contains(where: { $0.hasPrefix("repaired the write-ahead log") }) { print("obsd: the write-ahead log has no damaged record and lost nothing: nothing was cut") }
                for notice in notices { print("obsd: \(notice)") }
                return
            } catch {
                print("obsd: cannot repair: \(error)", to: &stderr)
                throw ExitCode.failure
            }
        }
        if !settings.etcdEndpoints.isEmpty && settings.inMemory {
            var stderr = StandardError()
            print("obsd: use one of --etcd-endpoints and --in-memory (repositories live either in etcd or in this process)", to: &stderr)
            throw ExitCode(64)
        }

        // Data files are the daemon's alone; the socket's mode is set explicitly.
        umask(0o077)
        let level = LogLevelSource(Logger.Level(rawValue: settings.logLevel) ?? .info)
        let journal = Logging.useJournal(target: settings.logTarget, environment: environment)
        LoggingSystem.bootstrap { label in Logging.handler(label: label, journal: journal, level: level) }
        let logger = Logger(label: "obsd")
        Launch.raiseDescriptorLimit(for: settings.maxConnections, logger: logger)

        let server: Server
        do {
            server = Server(
                configuration: try Launch.serverConfiguration(settings, environment: environment, logger: logger),
                logger: logger, observer: SystemdBridge(logger: logger))
        } catch {
            logger.critical("obsd cannot start: \(error)")
            throw ExitCode(78)
        }
        let reload = ReloadService(
            server: server, logger: logger, level: level, initial: settings,
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
