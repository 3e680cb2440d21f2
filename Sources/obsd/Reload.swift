// obsd — SIGHUP: re-read the configuration and apply what can change while running (log
// level, limits, access policy — without dropping connections), telling systemd
// RELOADING=1 … READY=1. Settings that need a restart (socket, storage, threads) are
// reported, not applied.

import Logging
import ObsConfig
import ObsServer
import ServiceLifecycle
import Systemd
import UnixSignals

struct ReloadService: Service {
    let server: ObsServer
    let logger: Logger
    let level: LogLevelSource
    let reread: @Sendable () throws(ConfigError) -> DaemonSettings

    func run() async throws {
        let notifier = SystemdNotifier()
        var applied: DaemonSettings? = try? reread()
        for await _ in await UnixSignalsSequence(trapping: .sighup).cancelOnGracefulShutdown() {
            notifier.reloading()
            do {
                let settings = try reread()
                let policy = try Launch.policy(settings)
                level.current = Logger.Level(rawValue: settings.logLevel) ?? .info
                server.reload(limits: Launch.limits(settings), policy: policy)
                if let previous = applied {
                    for setting in Setting.all where ["socket", "storage", "server"].contains(where: { setting.key.hasPrefix($0 + ".") }) {
                        if setting.describe(previous) != setting.describe(settings) {
                            logger.warning("\(setting.key) changed; it takes effect at the next restart")
                        }
                    }
                }
                applied = settings
                logger.info("configuration reloaded", metadata: ["log.level": "\(settings.logLevel)"])
            } catch {
                logger.error("configuration not reloaded: \(error); keeping the current settings")
            }
            notifier.ready(status: "serving: \(server.status)")
        }
    }
}
