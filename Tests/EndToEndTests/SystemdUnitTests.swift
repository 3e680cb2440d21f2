// End-to-end: what the shipped units do under a service manager, checked without one (no
// systemd runs as PID 1 here): the user unit keeps its data where obsd started by hand by
// the same user does, on every systemd the README supports; ExecReload= returns only once
// obsd has read its file, and fails when obsd keeps its settings; the units let libdispatch
// set the nice values it asks for (SystemdIntegrationTests' traced runs); and the README's
// system-instance walk-through works as written.

import Foundation
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The package's root directory.
let packageRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../..").standardized.path

/// A shipped unit's settings (`systemd/…`).
func shippedUnit(_ path: String) throws -> [String: [String]] {
    unitSettings(try String(contentsOfFile: "\(packageRoot)/systemd/\(path)", encoding: .utf8))
}

/// A unit command line as words, the shipped binaries replaced by the ones under test.
func commandLine(_ line: String) -> [String] {
    line.split(separator: " ").map {
        $0 == "/usr/local/bin/obsd" ? BuildProducts.path("obsd") : $0 == "/usr/local/bin/obsctl" ? BuildProducts.path("obsctl") : String($0)
    }
}

// MARK: - RLIMIT_NICE and libdispatch

/// The RLIMIT_NICE a unit's processes get: `LimitNICE=` (a nice value with a sign, or the raw
/// limit), else the kernel's default, 0 — which lets an unprivileged process lower no nice value.
func niceLimit(of unit: [String: [String]]) -> Int {
    guard let value = unit["LimitNICE"]?.last else { return 0 }
    if value.hasPrefix("-") || value.hasPrefix("+") { return 20 - (Int(value) ?? 0) }
    return Int(value) ?? 0
}

/// The nice values a traced run asked `setpriority` for (strace: `setpriority(PRIO_PROCESS, 0, -4) = …`).
func requestedNiceValues(_ trace: [Substring]) -> [Int] {
    trace.compactMap { line in
        guard let call = line.range(of: "setpriority(PRIO_PROCESS, 0, ") else { return nil }
        return Int(line[call.upperBound...].prefix { $0 == "-" || $0.isNumber })
    }
}

/// The requested nice values a process that starts at 0 without CAP_SYS_NICE may not set under
/// `limit`: lowering the nice value to n needs RLIMIT_NICE ≥ 20 − n (setpriority(2)).
func niceValuesRefused(_ requested: [Int], limit: Int) -> [Int] {
    requested.filter { $0 < 0 && 20 - $0 > limit }
}

/// What libdispatch logged about thread priorities (with LIBDISPATCH_LOG=stderr).
func dispatchPriorityComplaints(_ output: String) -> [Substring] {
    output.split(separator: "\n").filter { $0.contains("Failed to set thread priority") }
}

/// `prlimit --nice=N:N` to run a command under a unit's RLIMIT_NICE; nil when this process may
/// not raise the hard limit that far (no CAP_SYS_RESOURCE, as in some containers).
func prlimitArguments(nice limit: Int) -> [String]? {
    guard let prlimit = which("prlimit"), (try? run(prlimit, ["--nice=\(limit):\(limit)", "true"]))?.status == 0 else { return nil }
    return [prlimit, "--nice=\(limit):\(limit)", "--"]
}

// MARK: - The user unit's data directory

/// Runs `arguments` (obsd) with `environment` as a user other than root when the tests run as
/// root (obsd's default data directory for root is /var/lib/obsd) until it serves
/// `$XDG_RUNTIME_DIR/obsd.sock`, stops it, and returns the directory it created its store in,
/// relative to `$HOME`, and that directory's mode.
func dataDirectoryChosen(by arguments: [String], environment: [String: String]) async throws -> (path: String, mode: Int) {
    let home = try #require(environment["HOME"]), runtime = try #require(environment["XDG_RUNTIME_DIR"])
    let asUser = getuid() == 0 ? [which("setpriv")!, "--reuid=nobody", "--regid=nogroup", "--clear-groups"] : []
    let command = asUser + arguments
    let process = try ChildProcess(command[0], Array(command.dropFirst()), environment: environment, stdout: .file(home + "/../log"), stderr: .file(home + "/../log"))
    let serving = await eventually { () async in (try? WireConnection(path: runtime + "/obsd.sock")) != nil || !process.isRunning }
    #expect(serving && process.isRunning, "obsd did not serve: \((try? String(contentsOfFile: home + "/../log", encoding: .utf8)) ?? "")")
    #expect(await process.terminate())
    var found: [String] = []
    let files = FileManager.default.enumerator(atPath: home)
    while let file = files?.nextObject() as? String {
        if file.hasSuffix("/obsd.lock") { found.append(String(file.dropLast("/obsd.lock".count))) }
    }
    let path = try #require(found.count == 1 ? found.first : nil, "stores under \(home): \(found)")
    let mode = try #require(try FileManager.default.attributesOfItem(atPath: home + "/" + path)[.posixPermissions] as? Int)
    return (path, mode)
}

/// A home directory and a runtime directory the user obsd runs as owns, in a fresh directory.
func makeHome() -> (root: String, environment: [String: String]) {
    let root = TestDaemon.makeTemporaryDirectory()
    chmod(root, 0o755)
    let (home, runtime) = (root + "/home", root + "/run")
    for dir in [home, runtime] {
        mkdir(dir, 0o700)
        if getuid() == 0 { chown(dir, 65534, 65534) }
    }
    return (root, ["HOME": home, "XDG_RUNTIME_DIR": runtime, "PATH": "/usr/bin:/bin"])
}

@Suite(.mayBlock, .serialized, .timeLimit(.minutes(3))) struct SystemdUnitTests {
    /// What a user manager gives a user unit's command (systemd.exec(5), "Environment
    /// variables in spawned processes"): the manager's own environment (HOME, XDG_RUNTIME_DIR,
    /// what environment.d adds), the unit's Environment=, and for StateDirectory=NAME,
    /// STATE_DIRECTORY — under $XDG_CONFIG_HOME (~/.config) before systemd 254, under
    /// $XDG_STATE_HOME (~/.local/state) from 254 — which is created first, with
    /// StateDirectoryMode= (0755 by default). Specifiers in ExecStart=: %h, %t, %S, %%.
    static func userUnitCommand(
        _ unit: [String: [String]], manager: [String: String], systemd version: Int
    ) throws -> (arguments: [String], environment: [String: String]) {
        let home = try #require(manager["HOME"])
        let stateRoot = version >= 254 ? manager["XDG_STATE_HOME"] ?? home + "/.local/state" : manager["XDG_CONFIG_HOME"] ?? home + "/.config"
        var environment = manager
        for assignment in (unit["Environment"] ?? []).flatMap({ $0.split(separator: " ") }) {
            let parts = assignment.split(separator: "=", maxSplits: 1).map(String.init)
            environment[parts[0]] = parts.count > 1 ? parts[1] : ""
        }
        if let names = unit["StateDirectory"]?.flatMap({ $0.split(separator: " ") }), !names.isEmpty {
            let directories = names.map { stateRoot + "/" + $0 }
            environment["STATE_DIRECTORY"] = directories.joined(separator: ":")
            let mode = mode_t(unit["StateDirectoryMode"]?.last.flatMap { Int($0, radix: 8) } ?? 0o755)
            for directory in directories {
                try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
                chmod(directory, mode)
                if getuid() == 0 {
                    var path = directory
                    while path.count > home.count { chown(path, 65534, 65534); path = (path as NSString).deletingLastPathComponent }
                }
            }
        }
        let specifiers = ["%h": home, "%t": try #require(manager["XDG_RUNTIME_DIR"]), "%S": stateRoot, "%%": "%"]
        let arguments = try commandLine(try #require(unit["ExecStart"]?.last)).map { word in
            var expanded = word
            for (specifier, value) in specifiers { expanded = expanded.replacingOccurrences(of: specifier, with: value) }
            guard !expanded.contains("%") else { throw TestFailure("a specifier this test does not know in ExecStart=: \(word)") }
            return expanded
        }
        return (arguments, environment)
    }

    @Test(.enabled(if: getuid() != 0 || canSwitchUsers, "as root, needs setpriv to run obsd as another user"))
    func theUserUnitKeepsItsDataWhereObsdStartedByHandDoesOnSystemd252AndLater() async throws {
        let unit = try shippedUnit("user/obsd.service")
        // With XDG_STATE_HOME unset, and set (in environment.d, so the manager has it too).
        for stateHome in [nil, "/elsewhere/state"] {
            let byHand = makeHome()
            defer { try? FileManager.default.removeItem(atPath: byHand.root) }
            var shell = byHand.environment
            if let stateHome { shell["XDG_STATE_HOME"] = shell["HOME"]! + stateHome }
            let expected = try await dataDirectoryChosen(by: [BuildProducts.path("obsd")], environment: shell)
            #expect(expected.path == (stateHome.map { String($0.dropFirst()) + "/obsd" } ?? ".local/state/obsd"))
            #expect(expected.mode == 0o700)
            for version in [252, 254] {
                let asUnit = makeHome()
                defer { try? FileManager.default.removeItem(atPath: asUnit.root) }
                var manager = asUnit.environment
                if let stateHome { manager["XDG_STATE_HOME"] = manager["HOME"]! + stateHome }
                let (arguments, environment) = try Self.userUnitCommand(unit, manager: manager, systemd: version)
                let chosen = try await dataDirectoryChosen(by: arguments, environment: environment)
                #expect(chosen.path == expected.path, "systemd \(version), XDG_STATE_HOME \(stateHome ?? "unset")")
                #expect(chosen.mode == 0o700, "systemd \(version): mode \(String(chosen.mode, radix: 8))")
            }
        }
    }

    // MARK: ExecReload=

    @Test func execReloadUsesNoToolOutsideThePackage() throws {
        for path in ["obsd.service", "user/obsd.service"] {
            let reload = try #require(try shippedUnit(path)["ExecReload"]?.last, "\(path) has ExecReload=")
            #expect(reload.hasPrefix("/usr/local/bin/obsctl reload "), "\(path): \(reload)")
            #expect(reload.hasSuffix(" --pid $MAINPID"), "\(path): signals the unit's main process only")
        }
    }

    /// The system unit's ExecReload= against a daemon whose configuration file is a FIFO at
    /// reload time: obsd's reload lasts until the test writes the file, and the command must
    /// still be waiting (connected, polling) all that time, then exit 0 with the new settings
    /// applied. With a file obsd refuses, the command fails and says why.
    @Test func execReloadReturnsOnlyOnceObsdHasReadTheFileAndFailsWhenItKeepsItsSettings() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        let config = dir + "/obsd.toml"
        try "[limits]\nmax-line = 4096\n".write(toFile: config, atomically: true, encoding: .utf8)
        let d = try await TestDaemon.start(["--config", config], directory: dir)
        let line200 = #"{"id":9,"op":"set","repo":"r","key":"k","value":""# + String(repeating: "x", count: 160) + #""}"#
        let words = commandLine(try #require(try shippedUnit("obsd.service")["ExecReload"]?.last))
            .map { $0 == "$MAINPID" ? String(d.pid) : $0 }
        var environment = ProcessInfo.processInfo.environment
        environment["OBSD_SOCKET"] = d.socketPath

        unlink(config)
        #expect(mkfifo(config, 0o600) == 0)
        let reload = try ChildProcess(words[0], Array(words.dropFirst()), environment: environment, stderr: .file(dir + "/reload.err"))
        defer { reload.kill9() }
        // obsd opens the file for reading once the signal came: the reload has begun, and
        // cannot end before the file is written.
        var writer: Int32 = -1
        #expect(await eventually { () async in
            writer = open(config, O_WRONLY | O_NONBLOCK)
            return writer >= 0
        }, "obsd never read its configuration file")
        #expect(reload.isRunning, "ExecReload= returned while obsd was still reading its file")
        let clients = try d.connect().call(["op": "stats"])["clients"]?.arrayValue ?? []
        #expect(clients.contains { $0.objectValue?["pid"]?.doubleValue == Double(reload.pid) }, "ExecReload= is connected, waiting")
        let text = Array("[limits]\nmax-line = 100\n".utf8)
        #expect(write(writer, text, text.count) == text.count)
        close(writer)
        #expect(await reload.exit(timeout: .seconds(20)) == 0)
        #expect(reload.terminationStatus == 0, "\((try? String(contentsOfFile: dir + "/reload.err", encoding: .utf8)) ?? "")")
        // The new limit applies by the time it returned.
        let after = try d.connect()
        try after.send(line200)
        #expect(try after.receive().errorCode == "too_large")

        // A file obsd refuses: it keeps its settings, and the reload fails with the reason.
        unlink(config)
        try "[limits]\nmax-lien = 100\n".write(toFile: config, atomically: true, encoding: .utf8)
        let refused = try run(words[0], Array(words.dropFirst()), environment: environment)
        #expect(refused.status == 4)
        #expect(refused.stderr.hasPrefix("obsctl: obsd kept its running settings: ") && refused.stderr.contains("limits.max-lien"), "\(refused.stderr)")
        let stats = try d.connect().call(["op": "stats"])
        #expect(stats["reloads"] == 2 && stats["reloadFailures"] == 1, "\(stats)")

        // Another process than the unit's main one is not signalled.
        let wrong = try run(words[0], ["reload", "--pid", String(d.pid + 100_000)], environment: environment)
        #expect(wrong.status == 4 && wrong.stderr.contains("nothing was signalled"), "\(wrong.stderr)")
        #expect(try d.connect().call(["op": "stats"])["reloads"] == 2)
    }
}

/// The README's system-instance walk-through, as a member of the group it names (`nobody`,
/// whose group `nogroup` stands in for `obsd`): forbidden until its `[[access.rule]]` is in
/// the file and reloaded, then allowed; and from a login session (`XDG_RUNTIME_DIR` set)
/// obsctl tries that directory's socket, not the system one, until `OBSD_SOCKET` names it.
@Suite(.mayBlock, .timeLimit(.minutes(2)), .enabled(if: canSwitchUsers, "needs root and setpriv to act as nobody"))
struct ReadmeSystemInstanceTests {
    /// The TOML block after "In `/etc/obsd/obsd.toml`:" in the README's systemd section.
    static func accessRule() throws -> String {
        let readme = try String(contentsOfFile: packageRoot + "/README.md", encoding: .utf8)
        guard let intro = readme.range(of: "In `/etc/obsd/obsd.toml`:\n\n```toml\n"),
            let end = readme.range(of: "```", range: intro.upperBound..<readme.endIndex)
        else { throw TestFailure("the README shows no access rule for the system instance") }
        return String(readme[intro.upperBound..<end.lowerBound])
    }

    @Test func aGroupMemberMayWriteOnceTheRuleIsReloadedAndReachesTheSystemSocketThroughOBSDSocket() async throws {
        let rule = try Self.accessRule()
        #expect(rule.contains("groups = [\"obsd\"]"), "\(rule)")
        let d = try await daemonForTwoUsers("")
        let s = d.socketPath
        #expect(try obsctlAsNobody(["set", "ui", "theme", "dark"], socket: s).status == 3, "forbidden without the rule")

        let config = d.directory + "/obsd.toml"
        let text = try String(contentsOfFile: config, encoding: .utf8) + rule.replacingOccurrences(of: "\"obsd\"", with: "\"nogroup\"")
        try text.write(toFile: config, atomically: true, encoding: .utf8)
        #expect(try run(BuildProducts.path("obsctl"), ["--socket", s, "reload", "--pid", String(d.pid)]).status == 0)

        // A login session: XDG_RUNTIME_DIR is set, and is where obsctl looks.
        let session = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: session) }
        let asAlice = [which("setpriv")!, "--reuid=nobody", "--regid=nogroup", "--clear-groups", BuildProducts.path("obsctl")]
        let login = ["PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": session]
        let own = try run(asAlice[0], Array(asAlice.dropFirst()) + ["set", "ui", "theme", "dark"], environment: login)
        #expect(own.status == 69 && own.stderr.contains("cannot connect to obsd at \(session)/obsd.sock"), "\(own.stderr)")
        let system = try run(
            asAlice[0], Array(asAlice.dropFirst()) + ["set", "ui", "theme", "dark"], environment: login.merging(["OBSD_SOCKET": s]) { $1 })
        #expect(system.status == 0 && system.stdout == "rev 1\n", "\(system.stderr)")
        #expect(try obsctlAsNobody(["set", "other", "k", "1"], socket: s).status == 3, "the rule names ui only")
    }
}
