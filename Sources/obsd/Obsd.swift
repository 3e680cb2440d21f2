// obsd — the daemon executable: parses flags, sets up logging, runs the server until
// SIGTERM or SIGINT, then shuts down gracefully and exits 0.

import ArgumentParser
import Logging
import ObsProtocol
import ObsServer
import ObsStore
import ServiceLifecycle

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

@main
struct Obsd: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "obsd",
        abstract: "Event-bus daemon: keyed observable repositories over a Unix socket.",
        discussion: """
            Clients speak line-delimited JSON on the socket (see docs/PROTOCOL.md); obsctl is the CLI.
            The socket path is, in order: --socket, $OBSD_SOCKET, $XDG_RUNTIME_DIR/obsd.sock, /run/obsd/obsd.sock.
            SIGTERM or SIGINT shut the daemon down gracefully (exit status 0).
            """,
        version: ObsServer.version)

    @Option(help: ArgumentHelp("The Unix socket to serve.", valueName: "path"))
    var socket: String?

    @Option(help: ArgumentHelp(
        "Directory for persistent data (default: $STATE_DIRECTORY under systemd, /var/lib/obsd for root, else $XDG_STATE_HOME/obsd or ~/.local/state/obsd).",
        valueName: "dir"))
    var dataDir: String?

    @Flag(help: "Keep repositories in memory only: nothing survives a restart.")
    var inMemory = false

    @Option(help: ArgumentHelp(
        "When a write is acknowledged: always (fsync first; concurrent writes share one fsync) or relaxed (after write(2); fsync every --sync-interval).",
        valueName: "policy"))
    var sync: String = "always"

    @Option(help: ArgumentHelp("With --sync relaxed: the longest time between fsyncs, in milliseconds.", valueName: "ms"))
    var syncInterval: Int = 1000

    @Option(help: ArgumentHelp("Configuration file. (Not supported yet: every setting has a flag.)", valueName: "file"))
    var config: String?

    @Option(help: ArgumentHelp("Log level: trace, debug, info, notice, warning, error, critical.", valueName: "level"))
    var logLevel: String = "info"

    @Option(help: ArgumentHelp("Longest request line in bytes.", valueName: "bytes"))
    var maxLine: Int = ProtocolRules.defaultMaxLine

    @Option(help: ArgumentHelp("Revisions kept per repository for `since` replay.", valueName: "n"))
    var historyLimit: Int = 10_000

    @Option(help: ArgumentHelp("Drop history older than this many seconds (0: no age limit).", valueName: "s"))
    var historyMaxAge: Int = 0

    @Option(help: ArgumentHelp("Outgoing queue limit per connection, in bytes.", valueName: "bytes"))
    var queueBytes: Int = 16 << 20

    @Option(help: ArgumentHelp("Outgoing queue limit per connection, in events.", valueName: "n"))
    var queueEvents: Int = 100_000

    @Option(help: ArgumentHelp("Seconds an overflowed connection may take to read its last messages.", valueName: "s"))
    var overflowGrace: Int = 30

    @Option(help: ArgumentHelp("Event-loop threads (default: one per CPU).", valueName: "n"))
    var threads: Int?

    func validate() throws {
        guard Logger.Level(rawValue: logLevel) != nil else {
            throw ValidationError("unknown log level '\(logLevel)'; use trace, debug, info, notice, warning, error or critical")
        }
        if config != nil {
            throw ValidationError("--config is not supported yet: configure obsd with flags")
        }
        guard maxLine >= 64 else { throw ValidationError("--max-line must be at least 64 bytes") }
        guard historyLimit >= 0 else { throw ValidationError("--history-limit must not be negative") }
        guard historyMaxAge >= 0 else { throw ValidationError("--history-max-age must not be negative") }
        guard sync == "always" || sync == "relaxed" else { throw ValidationError("--sync must be always or relaxed, not '\(sync)'") }
        guard syncInterval >= 1 else { throw ValidationError("--sync-interval must be at least 1 ms") }
        if inMemory && dataDir != nil { throw ValidationError("use one of --data-dir and --in-memory") }
        guard queueBytes >= 4096 else { throw ValidationError("--queue-bytes must be at least 4096") }
        guard queueEvents >= 1 else { throw ValidationError("--queue-events must be at least 1") }
        guard overflowGrace >= 0 else { throw ValidationError("--overflow-grace must not be negative") }
        if let threads, threads < 1 { throw ValidationError("--threads must be at least 1") }
    }

    func run() async throws {
        // Data files are the daemon's alone; the socket's mode is set explicitly.
        umask(0o077)
        let level = Logger.Level(rawValue: logLevel) ?? .info
        LoggingSystem.bootstrap { label in
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = level
            return handler
        }
        let logger = Logger(label: "obsd")
        let environment = ProcessEnvironment.current

        var configuration = ServerConfiguration(
            socketPath: SocketPath.resolve(explicit: socket, configured: nil, environment: environment))
        configuration.maxLine = maxLine
        configuration.historyLimit = historyLimit
        configuration.historyMaxAge = historyMaxAge > 0 ? .seconds(historyMaxAge) : nil
        if !inMemory {
            guard let directory = dataDir ?? DataDirectory.defaultPath(environment: environment) else {
                logger.critical("no data directory: set --data-dir (or HOME), or run with --in-memory")
                throw ExitCode.failure
            }
            // OBSD_FAULT_FILE is a test seam for storage failures; see docs/DURABILITY.md.
            configuration.storage = .sqlite(
                directory: directory, sync: sync == "relaxed" ? .relaxed(interval: .milliseconds(syncInterval)) : .always,
                faultFile: environment["OBSD_FAULT_FILE"])
        }
        configuration.outboxMaxBytes = queueBytes
        configuration.outboxMaxEvents = queueEvents
        configuration.overflowGrace = .seconds(overflowGrace)
        if let threads { configuration.threads = threads }

        let server = ObsServer(configuration: configuration, logger: logger)
        let group = ServiceGroup(
            configuration: .init(
                services: [.init(service: server)],
                gracefulShutdownSignals: [.sigterm, .sigint],
                logger: logger))
        do {
            try await group.run()
        } catch {
            logger.critical("obsd failed: \(error)")
            throw ExitCode.failure
        }
    }
}
