// obsd — where log records go: the journal when running under systemd (or when asked),
// else standard error; the level can change at run time (SIGHUP reload).

import Logging
import ObservableKit
import Systemd

/// The current log level, shared by every handler so a reload changes it everywhere.
final class LogLevelSource: Sendable {
    private let level: Locked<Logger.Level>
    init(_ level: Logger.Level) { self.level = Locked(level) }
    var current: Logger.Level {
        get { level.withLock { $0 } }
        set { level.withLock { $0 = newValue } }
    }
}

/// A handler whose level is read from a `LogLevelSource` (when not set on the logger).
struct ReloadableLevelHandler<Base: LogHandler>: LogHandler {
    var base: Base
    let source: LogLevelSource
    /// A level set on this logger value, overriding the shared one.
    private var own: Logger.Level?

    init(base: Base, source: LogLevelSource) {
        var base = base
        base.logLevel = .trace  // filtering happens here
        self.base = base
        self.source = source
    }

    var logLevel: Logger.Level {
        get { own ?? source.current }
        set { own = newValue }
    }

    var metadata: Logger.Metadata {
        get { base.metadata }
        set { base.metadata = newValue }
    }

    var metadataProvider: Logger.MetadataProvider? {
        get { base.metadataProvider }
        set { base.metadataProvider = newValue }
    }

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { base[metadataKey: key] }
        set { base[metadataKey: key] = newValue }
    }

    func log(event: LogEvent) { base.log(event: event) }
}

enum Logging {
    /// Whether to log to the journal: `log.target = journal`, or `auto` under systemd.
    static func useJournal(target: String, environment: [String: String]) -> Bool {
        switch target {
        case "journal": return true
        case "stderr": return false
        default: return SystemdEnvironment.isUnderSystemd(environment: environment)
        }
    }

    static func handler(label: String, journal: Bool, level: LogLevelSource) -> any LogHandler {
        if journal {
            return ReloadableLevelHandler(base: JournalLogHandler(identifier: "obsd"), source: level)
        }
        return ReloadableLevelHandler(base: StreamLogHandler.standardError(label: label), source: level)
    }
}
