// ObsConfig — settings on the command line: obsd's flags and their `--help` text, both
// derived from the settings table (`Setting.all`), so a setting is named in one place.
//
// Flags are `--flag VALUE` or `--flag=VALUE`; a switch (`--in-memory`) takes no value, or
// `--in-memory=false`. An unknown flag, a missing value or a stray argument is a usage
// error naming it (with the closest known flag); a value that fails the setting's check is
// a configuration error naming the flag, like one from the file or the environment.

/// A command line obsd cannot make sense of (exit status 64).
public struct UsageError: Error, Sendable, CustomStringConvertible, Equatable {
    public let description: String
    public init(_ description: String) { self.description = description }
}

extension Setting {
    /// The setting with this flag (without dashes).
    public static func flagged(_ flag: String) -> Setting? { all.first { $0.flag == flag } }

    /// Parses setting flags into values by file key, for `DaemonSettings.resolve(flags:)`.
    public static func parseFlags(_ arguments: [String]) throws(UsageError) -> [String: RawSetting] {
        var values: [String: RawSetting] = [:]
        var i = 0
        while i < arguments.count {
            let argument = arguments[i]
            i += 1
            guard argument.hasPrefix("--"), argument.count > 2 else {
                throw UsageError("unexpected argument \(argument.debugDescription); settings are given as --flag value (see obsd --help)")
            }
            let body = argument.dropFirst(2)
            let name = String(body.prefix { $0 != "=" })
            let inline: String? = body.contains("=") ? String(body.drop { $0 != "=" }.dropFirst()) : nil
            guard let setting = flagged(name) else {
                throw UsageError("unknown option --\(name)" + suggestion(for: name))
            }
            let value: String
            if let inline {
                value = inline
            } else if setting.valueName == nil {
                value = "true"
            } else {
                guard i < arguments.count else { throw UsageError("--\(name) needs a value (\(setting.expects))") }
                value = arguments[i]
                i += 1
            }
            values[setting.key] = .string(value)
        }
        return values
    }

    /// " (did you mean --x?)" for the flag closest to `flag`, if close enough.
    static func suggestion(for flag: String) -> String {
        let scored = all.map { ($0.flag, ConfigFile.distance(flag, $0.flag)) }.min { $0.1 < $1.1 }
        guard let (best, d) = scored, d <= max(2, flag.count / 4) else { return "" }
        return " (did you mean --\(best)?)"
    }

    /// Every setting as `--help` shows it: the flag, what it does, and where else it is set,
    /// with its default (from `DaemonSettings()`).
    public static var helpText: String {
        let defaults = DaemonSettings()
        var lines: [String] = []
        for setting in all {
            let flag = "--\(setting.flag)" + (setting.valueName.map { " <\($0)>" } ?? "")
            lines.append("  \(flag)")
            lines.append("        \(setting.help)")
            let value = setting.describe(defaults)
            let shown = value.hasPrefix("(unset: ") ? String(value.dropFirst(8).dropLast()) : value
            lines.append("        [\(setting.key), $\(setting.environment); default \(shown)]")
        }
        return lines.joined(separator: "\n")
    }
}
