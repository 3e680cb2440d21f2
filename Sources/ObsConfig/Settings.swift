// ObsConfig — the daemon's settings: their defaults, and how the configuration file,
// the environment and command-line flags set them (flags > environment > file > defaults).
//
// One table (`Setting.all`) says, for each setting, its key in the file, its environment
// variable, its flag, and how to read and check a value — so every source is validated the
// same way and every error names the setting and where it came from.

/// Every setting of the daemon, with its default.
public struct DaemonSettings: Sendable, Equatable {
    /// `socket.path`; nil: `$XDG_RUNTIME_DIR/obsd.sock`, else `/run/obsd/obsd.sock`.
    public var socketPath: String? = nil
    public var socketMode: UInt32 = 0o660
    public var socketUser: String? = nil
    public var socketGroup: String? = nil
    /// `storage.data-dir`; nil: `$STATE_DIRECTORY`, `/var/lib/obsd` (root), `$XDG_STATE_HOME/obsd`, `~/.local/state/obsd`.
    public var dataDir: String? = nil
    public var inMemory = false
    /// `storage.etcd-endpoints`; empty: repositories stay on this machine (data-dir or in-memory).
    public var etcdEndpoints: [String] = []
    /// `storage.etcd-prefix`: where this daemon's repositories live in etcd.
    public var etcdPrefix = "/obsd/"
    public var sync = "always"
    public var syncIntervalMS = 1000
    public var historyLimit = 10_000
    public var historyMaxAgeSeconds = 0
    public var historyMaxBytes = 64 << 20
    /// `history.tombstones`: deleted keys remembered per repository, for catch-ups (ObsStore's `Tombstones.defaultLimit`).
    public var historyTombstones = 100_000
    public var maxLine = 1 << 20
    public var queueBytes = 16 << 20
    public var queueEvents = 100_000
    public var overflowGraceSeconds = 30
    public var maxValueBytes = 512 << 10
    public var maxRevisionBytes = 16 << 20
    public var maxKeysPerRepository = 1_000_000
    public var maxRepositories = 10_000
    public var maxConnections = 16_384
    public var maxConnectionsPerUID = 1024
    public var maxLeasesPerUID = 1024
    public var maxSubscriptionsPerConnection = 1024
    public var maxKeysPerRequest = 4096
    public var maxStartBytes = 1 << 30
    /// What peers no access rule matches may do: none, read or write.
    public var accessDefault = "none"
    /// `[[access.rule]]` tables, in file order.
    public var accessRules: [AccessRuleSetting] = []
    public var logLevel = "info"
    public var logTarget = "auto"
    /// 0: one per CPU.
    public var threads = 0
    /// `server.busy-poll-us`: the longest an event loop polls for work before it sleeps; 0: never.
    public var busyPollMicroseconds = 50

    public init() {}
}

/// One `[[access.rule]]`: who may do what to which repositories.
public struct AccessRuleSetting: Sendable, Equatable {
    /// Repository name patterns (`*` and `?` wildcards).
    public var repos: [String]
    /// User names or numeric ids.
    public var users: [String]
    /// Group names or numeric ids.
    public var groups: [String]
    /// "read" (get, list, subscribe) or "write" (also set, delete, batch).
    public var allow: String

    public init(repos: [String], users: [String], groups: [String], allow: String) {
        self.repos = repos
        self.users = users
        self.groups = groups
        self.allow = allow
    }
}

/// A configuration error: what is wrong, naming the setting and its source.
public struct ConfigError: Error, Sendable, CustomStringConvertible, Equatable {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// A value as a source provides it, before checking.
public enum RawSetting: Sendable, Equatable {
    case string(String)
    case integer(Int)
    case boolean(Bool)
    /// A TOML array of strings (the configuration file's form of a list setting).
    case list([String])

    var text: String {
        switch self {
        case .string(let s): return "\"\(s)\""
        case .integer(let i): return String(i)
        case .boolean(let b): return String(b)
        case .list(let items): return "[" + items.map { "\"\($0)\"" }.joined(separator: ", ") + "]"
        }
    }
}

/// One setting: its names in each source, what it does, and how to apply a value. This
/// table is the only place a setting is named: the file's keys, the environment, obsd's
/// flags and its `--help` all come from it, and the defaults from `DaemonSettings()`.
public struct Setting: Sendable {
    /// The key in the file, `section.name`.
    public let key: String
    /// The environment variable.
    public let environment: String
    /// The command-line flag, without dashes.
    public let flag: String
    /// What a valid value looks like, for messages.
    public let expects: String
    /// What the setting does, one line for `--help`.
    public let help: String
    /// The placeholder of the flag's value in `--help`; nil for a switch (`--in-memory`).
    public let valueName: String?
    /// Checks a value and stores it.
    let apply: @Sendable (inout DaemonSettings, RawSetting) -> Bool
    /// The setting's value in TOML syntax (or a note saying where the default comes from).
    public let describe: @Sendable (DaemonSettings) -> String
    /// Whether the file gives it as an array (`storage.etcd-endpoints`).
    public internal(set) var takesList = false

    public static let logLevels = ["trace", "debug", "info", "notice", "warning", "error", "critical"]

    /// Every setting, in the order of the shipped configuration file.
    public static let all: [Setting] = [
        text("socket.path", "OBSD_SOCKET", "socket", \.socketPath, "path", "The Unix socket to serve.",
             default: "$XDG_RUNTIME_DIR/obsd.sock, else /run/obsd/obsd.sock"),
        Setting(
            key: "socket.mode", environment: "OBSD_SOCKET_MODE", flag: "socket-mode", expects: "an octal mode such as \"0660\"",
            help: "Permission bits of the socket file, octal.", valueName: "mode",
            apply: { s, raw in
                guard case .string(let text) = raw, let mode = UInt32(text, radix: 8), mode <= 0o777 else { return false }
                s.socketMode = mode
                return true
            },
            describe: { "\"0\(String($0.socketMode, radix: 8))\"" }),
        text("socket.user", "OBSD_SOCKET_USER", "socket-user", \.socketUser, "user", "Owner of the socket file: a user name or uid.",
             default: "the daemon's user"),
        text("socket.group", "OBSD_SOCKET_GROUP", "socket-group", \.socketGroup, "group", "Group of the socket file: a group name or gid.",
             default: "the daemon's group"),
        text("storage.data-dir", "OBSD_DATA_DIR", "data-dir", \.dataDir, "dir", "Directory for persistent data.",
             default: "$STATE_DIRECTORY, /var/lib/obsd for root, else $XDG_STATE_HOME/obsd or ~/.local/state/obsd"),
        boolean("storage.in-memory", "OBSD_IN_MEMORY", "in-memory", \.inMemory,
                "Keep repositories in memory only: nothing survives a restart."),
        list("storage.etcd-endpoints", "OBSD_ETCD_ENDPOINTS", "etcd-endpoints", \.etcdEndpoints, "urls",
             "etcd client URLs (http://HOST:PORT, comma-separated): share repositories with every obsd on the same cluster and prefix.",
             default: "none: repositories stay on this machine"),
        string("storage.etcd-prefix", "OBSD_ETCD_PREFIX", "etcd-prefix", \.etcdPrefix, "prefix",
               "With --etcd-endpoints: the etcd key prefix under which every key obsd writes lies."),
        choice("storage.sync", "OBSD_SYNC", "sync", ["always", "relaxed"], \.sync, "policy", "When a write is acknowledged: always or relaxed."),
        integer("storage.sync-interval-ms", "OBSD_SYNC_INTERVAL_MS", "sync-interval", 1...3_600_000, \.syncIntervalMS, "ms",
                "With --sync relaxed: the longest time between fsyncs."),
        integer("history.limit", "OBSD_HISTORY_LIMIT", "history-limit", 0...100_000_000, \.historyLimit, "n",
                "Revisions kept per repository for `since`."),
        integer("history.max-bytes", "OBSD_HISTORY_MAX_BYTES", "history-max-bytes", 0...(1 << 40), \.historyMaxBytes, "bytes",
                "Bytes of history kept per repository (keys and old and new values); the newest revision stays whatever its size."),
        integer("history.max-age-seconds", "OBSD_HISTORY_MAX_AGE", "history-max-age", 0...Int(Int32.max), \.historyMaxAgeSeconds, "s",
                "Drop history older than this; 0: no age limit."),
        integer("history.tombstones", "OBSD_HISTORY_TOMBSTONES", "history-tombstones", 100_000...100_000_000, \.historyTombstones, "n",
                "Deleted keys remembered per repository (the newest deletions), so a `catchup` past the history still lists what was deleted; from before the oldest remembered it is a snapshot."),
        integer("limits.max-line", "OBSD_MAX_LINE", "max-line", 64...(1 << 30), \.maxLine, "bytes", "Longest request line in bytes."),
        integer("limits.queue-bytes", "OBSD_QUEUE_BYTES", "queue-bytes", 4096...(1 << 34), \.queueBytes, "bytes",
                "Outgoing queue limit per connection in bytes."),
        integer("limits.queue-events", "OBSD_QUEUE_EVENTS", "queue-events", 1...100_000_000, \.queueEvents, "n",
                "Outgoing queue limit per connection in events."),
        integer("limits.overflow-grace-seconds", "OBSD_OVERFLOW_GRACE", "overflow-grace", 0...86_400, \.overflowGraceSeconds, "s",
                "Seconds an overflowed connection may take to read its last messages."),
        integer("limits.max-value-bytes", "OBSD_MAX_VALUE_BYTES", "max-value-bytes", 16...(1 << 30), \.maxValueBytes, "bytes",
                "Largest value, in bytes of compact JSON."),
        integer("limits.max-revision-bytes", "OBSD_MAX_REVISION_BYTES", "max-revision-bytes", 4096...(512 << 20), \.maxRevisionBytes, "bytes",
                "Most bytes one revision may carry: its keys and their old and new values."),
        integer("limits.max-keys-per-repository", "OBSD_MAX_KEYS_PER_REPOSITORY", "max-keys-per-repository", 1...1_000_000_000,
                \.maxKeysPerRepository, "n", "Most keys per repository."),
        integer("limits.max-repositories", "OBSD_MAX_REPOSITORIES", "max-repositories", 1...100_000_000, \.maxRepositories, "n",
                "Most repositories."),
        integer("limits.max-connections", "OBSD_MAX_CONNECTIONS", "max-connections", 1...10_000_000, \.maxConnections, "n",
                "Most connections."),
        integer("limits.max-connections-per-uid", "OBSD_MAX_CONNECTIONS_PER_UID", "max-connections-per-uid", 1...10_000_000,
                \.maxConnectionsPerUID, "n", "Most connections per uid, root and obsd's uid exempt."),
        integer("limits.max-leases-per-uid", "OBSD_MAX_LEASES_PER_UID", "max-leases-per-uid", 1...10_000_000,
                \.maxLeasesPerUID, "n", "Most live leases per uid, root's and obsd's too (past it, grant is overloaded)."),
        integer("limits.max-subscriptions-per-connection", "OBSD_MAX_SUBSCRIPTIONS", "max-subscriptions", 1...10_000_000,
                \.maxSubscriptionsPerConnection, "n", "Most live subscriptions per connection."),
        integer("limits.max-keys-per-request", "OBSD_MAX_KEYS_PER_REQUEST", "max-keys-per-request", 1...10_000_000, \.maxKeysPerRequest,
                "n", "Most keys in one subscribe or operations in one batch."),
        integer("limits.max-start-bytes", "OBSD_MAX_START_BYTES", "max-start-bytes", 0...(1 << 50), \.maxStartBytes, "bytes",
                "Most bytes of history copied for large since replays being sent at once, daemon-wide; past it another plain since is overloaded (one alone always may start; a catchup never is)."),
        choice("access.default", "OBSD_ACCESS_DEFAULT", "access-default", ["none", "read", "write"], \.accessDefault, "policy",
               "What peers no access rule matches may do: none, read or write."),
        choice("log.level", "OBSD_LOG_LEVEL", "log-level", logLevels, \.logLevel, "level",
               "trace, debug, info, notice, warning, error or critical."),
        choice("log.target", "OBSD_LOG_TARGET", "log-target", ["auto", "journal", "stderr"], \.logTarget, "target",
               "auto (the journal under systemd, else stderr), journal or stderr."),
        integer("server.threads", "OBSD_THREADS", "threads", 0...1024, \.threads, "n",
                "Event-loop threads; 0: one per CPU the daemon may use."),
        integer("server.busy-poll-us", "OBSD_BUSY_POLL_US", "busy-poll", 0...1_000_000, \.busyPollMicroseconds, "µs",
                "The longest an event loop polls for work before it sleeps, adapting below it to how soon work comes; 0: never."),
    ]

    /// The setting with this file key.
    public static func named(_ key: String) -> Setting? { all.first { $0.key == key } }

    /// Applies `raw`; the error says what was expected, prefixed by `source`.
    func apply(_ raw: RawSetting, to settings: inout DaemonSettings, source: String) throws(ConfigError) {
        guard apply(&settings, raw) else {
            throw ConfigError("\(source): \(key) must be \(expects), not \(raw.text)")
        }
    }

    // MARK: Kinds
    //
    // Key paths into DaemonSettings are captured by @Sendable closures; DaemonSettings is a
    // Sendable value type, and the key paths are literals with no captured state.

    private static func text(
        _ key: String, _ env: String, _ flag: String, _ path: WritableKeyPath<DaemonSettings, String?> & Sendable, _ valueName: String,
        _ help: String, default note: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "a non-empty string", help: help, valueName: valueName,
            apply: { s, raw in
                guard case .string(let v) = raw, !v.isEmpty else { return false }
                s[keyPath: path] = v
                return true
            },
            describe: { $0[keyPath: path].map { "\"\($0)\"" } ?? "(unset: \(note))" })
    }

    private static func string(
        _ key: String, _ env: String, _ flag: String, _ path: WritableKeyPath<DaemonSettings, String> & Sendable, _ valueName: String,
        _ help: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "a non-empty string", help: help, valueName: valueName,
            apply: { s, raw in
                guard case .string(let v) = raw, !v.isEmpty else { return false }
                s[keyPath: path] = v
                return true
            },
            describe: { "\"\($0[keyPath: path])\"" })
    }

    /// A list of strings: an array in the file, comma-separated in the environment and on
    /// the command line. Items are trimmed; empty items are not allowed.
    private static func list(
        _ key: String, _ env: String, _ flag: String, _ path: WritableKeyPath<DaemonSettings, [String]> & Sendable, _ valueName: String,
        _ help: String, default note: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "a non-empty list of non-empty strings (comma-separated, or a TOML array)",
            help: help, valueName: valueName,
            apply: { s, raw in
                let items: [String]
                switch raw {
                case .string(let text): items = text.split(separator: ",", omittingEmptySubsequences: false).map { $0.trimmingSpaces }
                case .list(let list): items = list.map(\.trimmingSpaces)
                case .integer, .boolean: return false
                }
                guard !items.isEmpty, items.allSatisfy({ !$0.isEmpty }) else { return false }
                s[keyPath: path] = items
                return true
            },
            describe: { s in
                let items = s[keyPath: path]
                return items.isEmpty ? "(unset: \(note))" : "[" + items.map { "\"\($0)\"" }.joined(separator: ", ") + "]"
            }, takesList: true)
    }

    private static func boolean(
        _ key: String, _ env: String, _ flag: String, _ path: WritableKeyPath<DaemonSettings, Bool> & Sendable, _ help: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "true or false", help: help, valueName: nil,
            apply: { s, raw in
                switch raw {
                case .boolean(let b): s[keyPath: path] = b
                case .string("true"), .string("1"), .string("yes"): s[keyPath: path] = true
                case .string("false"), .string("0"), .string("no"): s[keyPath: path] = false
                default: return false
                }
                return true
            },
            describe: { String($0[keyPath: path]) })
    }

    private static func integer(
        _ key: String, _ env: String, _ flag: String, _ range: ClosedRange<Int>, _ path: WritableKeyPath<DaemonSettings, Int> & Sendable,
        _ valueName: String, _ help: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "an integer from \(range.lowerBound) to \(range.upperBound)", help: help,
            valueName: valueName,
            apply: { s, raw in
                let value: Int?
                switch raw {
                case .integer(let i): value = i
                case .string(let t): value = Int(t)
                case .boolean, .list: value = nil
                }
                guard let value, range.contains(value) else { return false }
                s[keyPath: path] = value
                return true
            },
            describe: { String($0[keyPath: path]) })
    }

    private static func choice(
        _ key: String, _ env: String, _ flag: String, _ choices: [String], _ path: WritableKeyPath<DaemonSettings, String> & Sendable,
        _ valueName: String, _ help: String
    ) -> Setting {
        Setting(
            key: key, environment: env, flag: flag, expects: "one of " + choices.joined(separator: ", "), help: help,
            valueName: valueName,
            apply: { s, raw in
                guard case .string(let v) = raw, choices.contains(v) else { return false }
                s[keyPath: path] = v
                return true
            },
            describe: { "\"\($0[keyPath: path])\"" })
    }
}

extension Substring {
    /// Without leading and trailing spaces and tabs.
    var trimmingSpaces: String {
        String(drop { $0 == " " || $0 == "\t" }.reversed().drop { $0 == " " || $0 == "\t" }.reversed())
    }
}

extension String {
    /// Without leading and trailing spaces and tabs.
    var trimmingSpaces: String { self[...].trimmingSpaces }
}

extension DaemonSettings {
    /// Settings from every source: `defaults` ← `file` ← `environment` ← `flags`.
    ///
    /// - Parameters:
    ///   - file: values read from the configuration file (see `ConfigFile`), if any.
    ///   - environment: the process environment; only the variables in `Setting.all` are read.
    ///   - flags: values given on the command line, by file key.
    public static func resolve(
        file: ConfigFile?, environment: [String: String], flags: [String: RawSetting]
    ) throws(ConfigError) -> DaemonSettings {
        var settings = DaemonSettings()
        if let file {
            for (key, raw) in file.values {
                try Setting.named(key)!.apply(raw, to: &settings, source: file.path)
            }
            settings.accessRules = file.accessRules ?? []
        }
        for setting in Setting.all {
            // An empty variable counts as unset, as for OBSD_SOCKET in the protocol contract.
            if let value = environment[setting.environment], !value.isEmpty {
                try setting.apply(.string(value), to: &settings, source: "environment variable \(setting.environment)")
            }
        }
        for (key, raw) in flags.sorted(by: { $0.key < $1.key }) {
            guard let setting = Setting.named(key) else { throw ConfigError("unknown setting \(key)") }
            try setting.apply(raw, to: &settings, source: "--\(setting.flag)")
        }
        return settings
    }
}
