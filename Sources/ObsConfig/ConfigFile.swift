// ObsConfig — the configuration file: TOML, sections of known keys.
//
// Parsed with TOMLKit (toml++). A syntax error names the file, line and column; a key the
// daemon does not know is an error naming it (with the closest known key, since a typo
// that silently does nothing is the worst kind of configuration bug); a value of the
// wrong kind is an error naming the key.

import TOMLKit

/// A parsed configuration file: known keys with their raw values.
public struct ConfigFile: Sendable {
    /// The file's path, for messages.
    public let path: String
    /// `section.key` → value, for every key present.
    public let values: [(key: String, value: RawSetting)]
    /// `[[access.rule]]` tables, checked; nil when the file has none.
    public let accessRules: [AccessRuleSetting]?

    /// Reads and checks the file at `path`.
    public static func load(path: String) throws(ConfigError) -> ConfigFile {
        guard let text = readFile(path) else {
            throw ConfigError("cannot read configuration file \(path)")
        }
        return try parse(text, path: path)
    }

    /// Parses configuration text; `path` is only used in messages.
    public static func parse(_ text: String, path: String) throws(ConfigError) -> ConfigFile {
        let table: TOMLTable
        do {
            table = try TOMLTable(string: text)
        } catch let error as TOMLParseError {
            throw ConfigError("\(path):\(error.source.begin.line):\(error.source.begin.column): \(error.description)")
        } catch {
            throw ConfigError("\(path): \(error)")
        }
        var values: [(key: String, value: RawSetting)] = []
        var rules: [AccessRuleSetting]? = nil
        for section in table.keys.sorted() {
            guard let inner = table[section]?.table else {
                throw ConfigError("\(path): \(section) must be a section ([\(section)]), with keys inside; see the shipped obsd.toml")
            }
            for name in inner.keys.sorted() {
                let key = "\(section).\(name)"
                if key == "access.rule" {
                    rules = try accessRules(inner[name]!, path: path)
                    continue
                }
                guard Setting.named(key) != nil else {
                    throw ConfigError("\(path): unknown key \(key)" + suggestion(for: key))
                }
                let value = inner[name]!
                switch value.type {
                case .string: values.append((key, .string(value.string!)))
                case .int: values.append((key, .integer(value.int!)))
                case .bool: values.append((key, .boolean(value.bool!)))
                case .array:
                    guard Setting.named(key)!.takesList else {
                        throw ConfigError("\(path): \(key) must be \(Setting.named(key)!.expects), not an array")
                    }
                    var items: [String] = []
                    for item in value.array! {
                        guard let text = item.string else { throw ConfigError("\(path): \(key) must be an array of strings") }
                        items.append(text)
                    }
                    values.append((key, .list(items)))
                default:
                    throw ConfigError("\(path): \(key) must be \(Setting.named(key)!.expects), not a \(value.type)")
                }
            }
        }
        return ConfigFile(path: path, values: values, accessRules: rules)
    }

    /// `[[access.rule]]`: each with `repos`, `allow`, and at least one of `users` and `groups`.
    static func accessRules(_ value: any TOMLValueConvertible, path: String) throws(ConfigError) -> [AccessRuleSetting] {
        guard let array = value.array else {
            throw ConfigError("\(path): access.rule must be an array of tables: write each rule as [[access.rule]]")
        }
        var rules: [AccessRuleSetting] = []
        for (i, element) in array.enumerated() {
            let at = "\(path): access rule \(i + 1)"
            guard let rule = element.table else { throw ConfigError("\(at) must be a table ([[access.rule]])") }
            for key in rule.keys where !["repos", "users", "groups", "allow"].contains(key) {
                throw ConfigError("\(at): unknown key \(key) (a rule has repos, users, groups and allow)")
            }
            func strings(_ key: String) throws(ConfigError) -> [String] {
                guard let v = rule[key] else { return [] }
                if let s = v.string { return [s] }
                if let n = v.int { return [String(n)] }
                guard let items = v.array else { throw ConfigError("\(at): \(key) must be a string or an array of strings") }
                var out: [String] = []
                for item in items {
                    if let s = item.string, !s.isEmpty {
                        out.append(s)
                    } else if let n = item.int, n >= 0 {
                        out.append(String(n))
                    } else {
                        throw ConfigError("\(at): \(key) must hold names or numeric ids")
                    }
                }
                return out
            }
            let repos = try strings("repos")
            guard !repos.isEmpty else { throw ConfigError("\(at) needs repos (a pattern such as \"session.*\", or \"*\")") }
            for pattern in repos where !pattern.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || "._-*?".contains($0)) }) {
                throw ConfigError("\(at): repos pattern \"\(pattern)\" may use only A-Z a-z 0-9 . _ - and the wildcards * ?")
            }
            let users = try strings("users")
            let groups = try strings("groups")
            guard !users.isEmpty || !groups.isEmpty else { throw ConfigError("\(at) needs users or groups") }
            guard let allow = rule["allow"]?.string, allow == "read" || allow == "write" else {
                throw ConfigError("\(at): allow must be \"read\" or \"write\"")
            }
            rules.append(AccessRuleSetting(repos: repos, users: users, groups: groups, allow: allow))
        }
        return rules
    }

    /// " (did you mean x?)" for the known key closest to `key`, if close enough.
    static func suggestion(for key: String) -> String {
        let scored = Setting.all.map { ($0.key, distance(key, $0.key)) }.min { $0.1 < $1.1 }
        guard let (best, d) = scored, d <= max(2, key.count / 4) else { return "" }
        return " (did you mean \(best)?)"
    }

    /// Levenshtein distance.
    static func distance(_ a: String, _ b: String) -> Int {
        let a = Array(a), b = Array(b)
        var previous = Array(0...b.count)
        for i in 1...max(1, a.count) where !a.isEmpty {
            var current = [i] + Array(repeating: 0, count: b.count)
            for j in 1...max(1, b.count) where !b.isEmpty {
                current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1))
            }
            previous = current
        }
        return a.isEmpty ? b.count : previous[b.count]
    }

    private static func readFile(_ path: String) -> String? {
        guard let file = fopen(path, "r") else { return nil }
        defer { fclose(file) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = fread(&chunk, 1, chunk.count, file)
            if n > 0 { bytes.append(contentsOf: chunk[..<n]) }
            if n < chunk.count { break }
        }
        guard ferror(file) == 0 else { return nil }
        return String(validating: bytes, as: UTF8.self)
    }
}

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
