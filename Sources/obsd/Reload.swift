// obsd — SIGHUP: re-read the configuration and apply what can change while running (log
// level, limits, access policy — without dropping connections), telling systemd
// RELOADING=1 … READY=1, then counting the reload in `stats` (how `obsctl reload`, the
// units' ExecReload=, knows it is done). Settings that need a restart (socket, storage,
// threads) are reported, not applied.

import Logging
import ObsConfig
import ObsServer
import ServiceLifecycle
import Systemd
import UnixSignals

struct ReloadService: Service {
    let server: Server
    let logger: Logger
    let level: LogLevelSource
    /// The settings the daemon started with (the file is read again only on SIGHUP).
    let initial: DaemonSettings
    let reread: @Sendable () throws(ConfigError) -> DaemonSettings

    func run() async throws {
        let notifier = SystemdNotifier()
        var applied = initial
        for await _ in await UnixSignalsSequence(trapping: .sighup).cancelOnGracefulShutdown() {
            notifier.reloading()
            var failure: String? = nil
            do {
                let settings = try reread()
                let policy = try Launch.policy(settings)
                level.current = Logger.Level(rawValue: settings.logLevel) ?? .info
                server.reload(limits: Launch.limits(settings), policy: policy)
                for setting in Setting.all where ["socket", "storage", "server"].contains(where: { setting.key.hasPrefix($0 + ".") }) {
                    if setting.describe(applied) != setting.describe(settings) {
                        logger.warning("\(setting.key) changed; it takes effect at the next restart")
                    }
                }
                applied = settings
                logger.info("configuration reloaded", metadata: ["log.level": "\(settings.logLevel)"])
            } catch {
                failure = "\(error)"
                logger.error("configuration not reloaded: \(error); keeping the current settings")
            }
            notifier.ready(status: "serving: \(server.status)")
            server.reloadEnded(failure: failure)
        }
    }
}
