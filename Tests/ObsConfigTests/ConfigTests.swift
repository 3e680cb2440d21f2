// Tests of the daemon's settings: the shipped file, precedence, and errors that name the key.

import Foundation
import ObsConfig
import Testing

@Suite struct ConfigTests {
    static let shipped = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../config/obsd.toml").path

    @Test func theShippedFileParsesAndDocumentsEverySetting() throws {
        let text = try String(contentsOfFile: Self.shipped, encoding: .utf8)
        let file = try ConfigFile.parse(text, path: "obsd.toml")
        #expect(file.values.isEmpty, "every setting is commented out, at its default")
        #expect(try DaemonSettings.resolve(file: file, environment: [:], flags: [:]) == DaemonSettings())
        // Uncommenting every line yields the defaults too, and covers every known key.
        let uncommented = text.split(separator: "\n", omittingEmptySubsequences: false).map { line in
            line.hasPrefix("#") && line.dropFirst().first.map { $0.isLetter } == true && line.contains(" = ") ? String(line.dropFirst()) : String(line)
        }.joined(separator: "\n")
        let full = try ConfigFile.parse(uncommented, path: "obsd.toml")
        #expect(Set(full.values.map(\.key)) == Set(Setting.all.map(\.key)))
        var expected = DaemonSettings()
        expected.socketPath = "/run/obsd/obsd.sock"
        expected.socketUser = "obsd"
        expected.socketGroup = "obsd"
        expected.dataDir = "/var/lib/obsd"
        expected.etcdEndpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
        #expect(try DaemonSettings.resolve(file: full, environment: [:], flags: [:]) == expected)
    }

    @Test func flagsBeatEnvironmentBeatsFileBeatsDefaults() throws {
        let file = try ConfigFile.parse("[log]\nlevel = \"debug\"\n[limits]\nmax-line = 100\nqueue-events = 5\n", path: "f")
        let env = ["OBSD_MAX_LINE": "200", "OBSD_QUEUE_BYTES": "8192", "OBSD_SOCKET": "/tmp/e.sock"]
        let s = try DaemonSettings.resolve(file: file, environment: env, flags: ["limits.queue-bytes": .integer(9999)])
        #expect(s.logLevel == "debug")  // file
        #expect(s.maxLine == 200)  // environment over file
        #expect(s.queueBytes == 9999)  // flag over environment
        #expect(s.queueEvents == 5)  // file
        #expect(s.socketPath == "/tmp/e.sock")  // OBSD_SOCKET, as the protocol contract says
        #expect(s.historyLimit == 10_000)  // default
        #expect(try DaemonSettings.resolve(file: nil, environment: ["OBSD_SOCKET": ""], flags: [:]).socketPath == nil)
    }

    @Test(arguments: [
        ("[limits]\nmax-lien = 5\n", "unknown key limits.max-lien (did you mean limits.max-line?)"),
        ("[limits]\nmax-line = \"big\"\n", "limits.max-line must be an integer from 64 to 1073741824, not \"big\""),
        ("[limits]\nmax-line = 10\n", "limits.max-line must be an integer from 64"),
        ("[storage]\nsync = \"sometimes\"\n", "storage.sync must be one of always, relaxed"),
        ("[socket]\nmode = \"999\"\n", "socket.mode must be an octal mode"),
        ("[socket]\nmode = 660\n", "socket.mode must be an octal mode"),
        ("[storage]\nin-memory = \"maybe\"\n", "storage.in-memory must be true or false"),
        ("[frobnicate]\nx = 1\n", "unknown key frobnicate.x"),
        ("level = \"debug\"\n", "level must be a section"),
        ("[limits]\nmax-line = [1]\n", "limits.max-line must be an integer"),
        ("[limits\nmax-line = 5\n", "f:1:8:"),
    ])
    func badFilesNameTheKey(_ text: String, _ message: String) {
        do {
            let file = try ConfigFile.parse(text, path: "f")
            _ = try DaemonSettings.resolve(file: file, environment: [:], flags: [:])
            Issue.record("accepted: \(text)")
        } catch {
            #expect(error.description.contains(message), "\(error.description)")
        }
    }

    @Test func badEnvironmentAndFlagsNameTheirSource() {
        #expect(throws: ConfigError("environment variable OBSD_SYNC: storage.sync must be one of always, relaxed, not \"x\"")) {
            try DaemonSettings.resolve(file: nil, environment: ["OBSD_SYNC": "x"], flags: [:])
        }
        #expect(throws: ConfigError("--threads: server.threads must be an integer from 0 to 1024, not 5000")) {
            try DaemonSettings.resolve(file: nil, environment: [:], flags: ["server.threads": .integer(5000)])
        }
    }

    @Test func etcdEndpointsAreAListInEverySource() throws {
        let file = try ConfigFile.parse("[storage]\netcd-endpoints = [\"http://a:1\", \"http://b:2\"]\netcd-prefix = \"/x/\"\n", path: "f")
        let fromFile = try DaemonSettings.resolve(file: file, environment: [:], flags: [:])
        #expect(fromFile.etcdEndpoints == ["http://a:1", "http://b:2"])
        #expect(fromFile.etcdPrefix == "/x/")
        let fromEnvironment = try DaemonSettings.resolve(file: nil, environment: ["OBSD_ETCD_ENDPOINTS": "http://a:1, http://b:2"], flags: [:])
        #expect(fromEnvironment.etcdEndpoints == ["http://a:1", "http://b:2"])
        let flags = try Setting.parseFlags(["--etcd-endpoints", "http://c:3,http://d:4"])
        #expect(try DaemonSettings.resolve(file: file, environment: [:], flags: flags).etcdEndpoints == ["http://c:3", "http://d:4"])
        #expect(DaemonSettings().etcdEndpoints.isEmpty && DaemonSettings().etcdPrefix == "/obsd/")
        #expect(throws: ConfigError("--etcd-endpoints: storage.etcd-endpoints must be a non-empty list of non-empty strings (comma-separated, or a TOML array), not \"http://a:1,\"")) {
            try DaemonSettings.resolve(file: nil, environment: [:], flags: ["storage.etcd-endpoints": .string("http://a:1,")])
        }
        #expect(throws: ConfigError("f: storage.etcd-prefix must be a non-empty string, not an array")) {
            try DaemonSettings.resolve(file: try ConfigFile.parse("[storage]\netcd-prefix = [\"a\"]\n", path: "f"), environment: [:], flags: [:])
        }
    }

    @Test func accessRulesParse() throws {
        let file = try ConfigFile.parse(
            """
            [access]
            default = "read"
            [[access.rule]]
            repos = ["session.*", "ui"]
            users = ["alice", 1001]
            allow = "write"
            [[access.rule]]
            repos = "public.*"
            groups = ["users"]
            allow = "read"
            """, path: "f")
        let s = try DaemonSettings.resolve(file: file, environment: [:], flags: [:])
        #expect(s.accessDefault == "read")
        #expect(s.accessRules == [
            AccessRuleSetting(repos: ["session.*", "ui"], users: ["alice", "1001"], groups: [], allow: "write"),
            AccessRuleSetting(repos: ["public.*"], users: [], groups: ["users"], allow: "read"),
        ])
    }

    @Test(arguments: [
        ("[[access.rule]]\nusers = [\"a\"]\nallow = \"read\"\n", "needs repos"),
        ("[[access.rule]]\nrepos = [\"x\"]\nallow = \"read\"\n", "needs users or groups"),
        ("[[access.rule]]\nrepos = [\"x\"]\nusers = [\"a\"]\nallow = \"admin\"\n", "allow must be \"read\" or \"write\""),
        ("[[access.rule]]\nrepos = [\"x y\"]\nusers = [\"a\"]\nallow = \"read\"\n", "may use only"),
        ("[[access.rule]]\nrepos = [\"x\"]\nuser = [\"a\"]\nallow = \"read\"\n", "unknown key user"),
        ("[access]\nrule = 3\n", "must be an array of tables"),
        ("[access]\ndefault = \"all\"\n", "access.default must be one of none, read, write"),
    ])
    func badAccessRulesNameTheProblem(_ text: String, _ message: String) {
        do {
            _ = try DaemonSettings.resolve(file: try ConfigFile.parse(text, path: "f"), environment: [:], flags: [:])
            Issue.record("accepted: \(text)")
        } catch {
            #expect(error.description.contains(message), "\(error.description)")
        }
    }

    @Test func missingFileIsAnError() {
        #expect(throws: ConfigError("cannot read configuration file /nonexistent/obsd.toml")) {
            try ConfigFile.load(path: "/nonexistent/obsd.toml")
        }
    }
}

/// The settings table is the one place a setting is named: its flag, variable, default and
/// help text must agree wherever they appear.
@Suite struct SettingsTableTests {
    @Test func everySettingsFlagVariableDefaultAndHelpAgree() throws {
        let defaults = DaemonSettings()
        let help = Setting.helpText
        let shipped = try String(contentsOfFile: ConfigTests.shipped, encoding: .utf8)
        #expect(Set(Setting.all.map(\.flag)).count == Setting.all.count, "flags are unique")
        #expect(Set(Setting.all.map(\.environment)).count == Setting.all.count, "variables are unique")
        for setting in Setting.all {
            // The flag sets exactly this setting, to what the same text in the file or the
            // environment would.
            let sample = setting.describe(defaults).hasPrefix("(unset") ? "x" : setting.describe(defaults).trimmingCharacters(in: ["\""])
            let parsed = try Setting.parseFlags(setting.valueName == nil ? ["--\(setting.flag)"] : ["--\(setting.flag)", sample])
            #expect(parsed.keys.sorted() == [setting.key])
            let viaFlag = try DaemonSettings.resolve(file: nil, environment: [:], flags: parsed)
            let viaEnvironment = try DaemonSettings.resolve(
                file: nil, environment: [setting.environment: setting.valueName == nil ? "true" : sample], flags: [:])
            #expect(viaFlag == viaEnvironment, "--\(setting.flag) and $\(setting.environment) agree")
            // --help names the flag, the key, the variable and the default.
            let value = setting.describe(defaults)
            let shown = value.hasPrefix("(unset: ") ? String(value.dropFirst(8).dropLast()) : value
            #expect(help.contains("--\(setting.flag)"), "--help offers --\(setting.flag)")
            #expect(help.contains("[\(setting.key), $\(setting.environment); default \(shown)]"), "--help: \(setting.key)")
            #expect(!setting.help.isEmpty)
            // The shipped file documents the variable and, for settings with a value, the default.
            let name = setting.key.split(separator: ".").last!
            #expect(shipped.contains(setting.environment), "obsd.toml names $\(setting.environment)")
            if !value.hasPrefix("(unset") {
                #expect(shipped.contains("#\(name) = \(value)\n"), "obsd.toml shows \(setting.key) = \(value)")
            }
        }
    }

    @Test func flagsAreParsedAgainstTheTable() throws {
        #expect(try Setting.parseFlags(["--max-line=100", "--in-memory", "--socket", "/s"])
            == ["limits.max-line": .string("100"), "storage.in-memory": .string("true"), "socket.path": .string("/s")])
        #expect(throws: UsageError("unknown option --max-lien (did you mean --max-line?)")) { try Setting.parseFlags(["--max-lien", "5"]) }
        #expect(throws: UsageError("--socket needs a value (a non-empty string)")) { try Setting.parseFlags(["--socket"]) }
        #expect(throws: UsageError("unexpected argument \"stray\"; settings are given as --flag value (see obsd --help)")) {
            try Setting.parseFlags(["stray"])
        }
    }
}

@Suite struct ReadmeTableTests {
    @Test func theReadmeTableShowsEverySettingAsTheTableDoes() throws {
        let readme = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../README.md").path
        let text = try String(contentsOfFile: readme, encoding: .utf8)
        let defaults = DaemonSettings()
        for setting in Setting.all {
            let value = setting.describe(defaults)
            let shown = value.hasPrefix("(unset: ") ? String(value.dropFirst(8).dropLast()) : "`\(value)`"
            let row = "| `\(setting.key)` | `--\(setting.flag)` | `\(setting.environment)` | \(shown) |"
            #expect(text.contains(row), "README.md lacks: \(row)")
        }
    }
}
