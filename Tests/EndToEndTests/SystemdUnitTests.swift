// End-to-end: what the shipped units do under a service manager, checked without one (no
// systemd runs as PID 1 here): ExecReload= returns only once obsd has read its file, and
// fails when obsd keeps its settings; and the units let libdispatch set the nice values it
// asks for (SystemdIntegrationTests' traced runs).

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

@Suite(.serialized, .timeLimit(.minutes(3))) struct SystemdUnitTests {
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
