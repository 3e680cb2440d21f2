// obsd — the daemon executable: parses flags, sets up logging, runs the server until
// SIGTERM or SIGINT, then shuts down gracefully and exits 0.

import ArgumentParser
import Logging
import ObsProtocol
import ObsServer
import ServiceLifecycle

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
        "Directory for persistent data. (This version keeps repositories in memory only; the directory is not used yet.)",
        valueName: "dir"))
    var dataDir: String?

    @Option(help: ArgumentHelp("Configuration file. (Not supported yet: every setting has a flag.)", valueName: "file"))
    var config: String?

    @Option(help: ArgumentHelp("Log level: trace, debug, info, notice, warning, error, critical.", valueName: "level"))
    var logLevel: String = "info"

    @Option(help: ArgumentHelp("Longest request line in bytes.", valueName: "bytes"))
    var maxLine: Int = ProtocolRules.defaultMaxLine

    @Option(help: ArgumentHelp("Revisions kept per repository for `since` replay.", valueName: "n"))
    var historyLimit: Int = 10_000

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
        guard queueBytes >= 4096 else { throw ValidationError("--queue-bytes must be at least 4096") }
        guard queueEvents >= 1 else { throw ValidationError("--queue-events must be at least 1") }
        guard overflowGrace >= 0 else { throw ValidationError("--overflow-grace must not be negative") }
        if let threads, threads < 1 { throw ValidationError("--threads must be at least 1") }
    }

    func run() async throws {
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
