// End-to-end: obsd as a systemd service. Socket activation for real (systemd-socket-
// activate), sd_notify to a test-owned NOTIFY_SOCKET (READY, STATUS, WATCHDOG cadence,
// RELOADING on SIGHUP, STOPPING), journal records, the
// configuration file, and the shipped units: systemd-analyze verify, and the sandbox
// (system calls, W+X memory, the nice values libdispatch sets) checked against a traced run.

import Foundation
import ObsClient
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

func which(_ tool: String) -> String? {
    for dir in ["/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin"] where access("\(dir)/\(tool)", X_OK) == 0 {
        return "\(dir)/\(tool)"
    }
    return nil
}

/// Collects notify messages until `predicate` holds for one (or the deadline passes).
func awaitNotify(_ listener: DatagramListener, within: Duration = .seconds(20), _ predicate: (String) -> Bool) -> String? {
    let deadline = ContinuousClock.now + within
    while ContinuousClock.now < deadline {
        if let m = listener.receiveText(timeout: .milliseconds(200)), predicate(m) { return m }
    }
    return nil
}

@Suite(.mayBlock, .serialized, .timeLimit(.minutes(5))) struct SystemdIntegrationTests {
    @Test(.enabled(if: which("systemd-socket-activate") != nil, "needs systemd-socket-activate (package systemd)"))
    func socketActivationServesAClientThatConnectedBeforeTheDaemonRan() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let socketPath = dir + "/obsd.sock"
        let notify = try DatagramListener(path: dir + "/notify")
        let activator = try ChildProcess(
            which("systemd-socket-activate")!,
            ["-l", socketPath, "-E", "NOTIFY_SOCKET=\(notify.path)", BuildProducts.path("obsd"), "--data-dir", dir + "/data"])
        defer { activator.stop() }
        // The socket exists before obsd runs; a client connects and sends at once.
        let deadline = ContinuousClock.now + .seconds(20)
        var connection: WireConnection? = nil
        var lastError: (any Error)? = nil
        while connection == nil, ContinuousClock.now < deadline {
            do { connection = try WireConnection(path: socketPath) } catch { lastError = error }
            if connection == nil { usleep(5000) }
        }
        let c = try #require(connection, "could not connect: \(String(describing: lastError))")
        try c.send(#"{"id":1,"op":"set","repo":"sa","key":"k","value":"early"}"#)
        // obsd was not running when the client connected: READY comes after.
        #expect(awaitNotify(notify) { $0.hasPrefix("READY=1") } != nil)
        let reply = try c.receive()
        #expect(reply["id"] == 1 && reply.ok, "the early request was served")
        #expect(try c.call(["op": "get", "repo": "sa", "key": "k"])["value"] == "early")
        // SIGTERM to obsd (it replaced the activator's process image).
        #expect(activator.stop(), "obsd stopped on SIGTERM")
        #expect(activator.terminationStatus == 0)
    }

    @Test func notifyReadyStatusWatchdogAndStopping() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        let notify = try DatagramListener(path: dir + "/notify")
        let d = try await TestDaemon.start(directory: dir, environment: ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"])
        // READY=1 once the socket is served (TestDaemon.start already connected).
        let ready = try #require(awaitNotify(notify) { $0.hasPrefix("READY=1") })
        // The socket is served before READY is sent: the start-up probe's connection may be
        // counted in it already.
        #expect(ready.contains("STATUS=serving: ") && ready.contains(" 0 subscriptions, 0 repositories"), "\(ready)")

        // STATUS follows the server's state.
        let c = try d.connect()
        _ = try c.call(["op": "subscribe", "repo": "s"])
        _ = try c.call(["op": "set", "repo": "s", "key": "k", "value": 1])
        #expect(awaitNotify(notify) { $0.contains("STATUS=serving: 1 connection, 1 subscription, 1 repository") } != nil)

        // WATCHDOG=1 every half WATCHDOG_USEC (200 ms).
        // Timed by when the kernel queued each ping, not when this test got to read it.
        var times: [Duration] = []
        while times.count < 6, awaitNotify(notify, within: .seconds(5), { $0.hasPrefix("WATCHDOG=1") }) != nil, let queued = notify.lastQueued {
            times.append(queued)
        }
        #expect(times.count == 6)
        let gaps = zip(times, times.dropFirst()).map { ($1 - $0) }
        #expect(gaps.allSatisfy { $0 > .milliseconds(100) && $0 < .milliseconds(400) }, "gaps \(gaps)")

        // (That a wedged event loop stops the pings is HeartbeatTests' part.)

        d.signal(SIGTERM)
        #expect(awaitNotify(notify) { $0 == "STOPPING=1" } != nil)
        #expect(await d.waitForExit() == 0)
    }

    @Test func sighupReloadsLogLevelAndLimits() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        let config = dir + "/obsd.toml"
        try "[limits]\nmax-line = 4096\n[log]\nlevel = \"info\"\n".write(toFile: config, atomically: true, encoding: .utf8)
        let notify = try DatagramListener(path: dir + "/notify")
        let d = try await TestDaemon.start(["--config", config], directory: dir, environment: ["NOTIFY_SOCKET": notify.path])
        _ = awaitNotify(notify) { $0.hasPrefix("READY=1") }
        let before = try d.connect()
        #expect(try before.call(["op": "ping"]).ok)  // accepted (and so given its limits) before the reload
        let line200 = #"{"id":9,"op":"set","repo":"r","key":"k","value":""# + String(repeating: "x", count: 160) + #""}"#

        try "[limits]\nmax-line = 100\n[log]\nlevel = \"debug\"\n".write(toFile: config, atomically: true, encoding: .utf8)
        d.signal(SIGHUP)
        let reloading = try #require(awaitNotify(notify) { $0.hasPrefix("RELOADING=1") })
        #expect(reloading.contains("MONOTONIC_USEC="))
        #expect(awaitNotify(notify) { $0.hasPrefix("READY=1") } != nil)
        let after = try d.connect()
        try after.send(line200)
        #expect(try after.receive().errorCode == "too_large", "new connections get the new limit")
        try before.send(line200)
        #expect(try before.receive()["ok"] == true, "existing connections keep theirs")
        #expect(d.log.contains("configuration reloaded"))

        // A broken file on reload: an error, the running settings stay, READY again.
        try "[limits]\nmax-line = \"oops\"\n".write(toFile: config, atomically: true, encoding: .utf8)
        d.signal(SIGHUP)
        #expect(awaitNotify(notify) { $0.hasPrefix("READY=1") } != nil)
        #expect(d.log.contains("configuration not reloaded"))
        #expect(try d.connect().call(["op": "ping"]).ok)
    }

    @Test(.enabled(if: getuid() == 0 || access("/run/systemd/journal/socket", W_OK) == 0))
    func logsGoToTheJournalWithFields() async throws {
        let journal = "/run/systemd/journal/socket"
        guard access(journal, F_OK) != 0 else { return }  // a real journald: covered by SystemdTests
        mkdir("/run/systemd", 0o755)
        mkdir("/run/systemd/journal", 0o755)
        let standIn = try DatagramListener(path: journal)
        let d = try await TestDaemon.start(["--log-target", "journal"], inMemory: true)
        var records: [String] = []
        while let r = standIn.receiveText(timeout: .seconds(2)) {
            records.append(r)
            if r.contains("obsd serving") { break }
        }
        let serving = try #require(records.first { $0.contains("obsd serving") })
        #expect(serving.contains("PRIORITY=6\n") && serving.contains("SYSLOG_IDENTIFIER=obsd\n"))
        #expect(serving.contains("OBSD_LISTENER=\(d.socketPath)\n"))
        // The stand-in reads on, as journald does, until the daemon's last record: one that
        // stopped reading would fill its queue, and the daemon's logging would wait on it.
        async let status = d.stop()
        var last: String?
        while let r = standIn.receiveText(timeout: .seconds(30)) {
            last = r
            if r.contains("obsd stopped") { break }
        }
        #expect(last?.contains("obsd stopped") == true, "the shutdown is logged to the journal")
        #expect(await status == 0)
    }

    @Test func checkConfigAcceptsTheShippedFileAndRejectsBrokenOnes() throws {
        let shipped = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../config/obsd.toml").path
        let ok = try run(BuildProducts.path("obsd"), ["--check-config", shipped])
        #expect(ok.status == 0 && ok.stdout.contains("OK") && ok.stdout.contains("storage.sync = \"always\""))
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        for (text, message) in [
            ("[limits]\nqueue-bytes = 1\n", "limits.queue-bytes must be an integer from 4096"),
            ("[server]\nthread = 2\n", "unknown key server.thread (did you mean server.threads?)"),
            ("[log\n", ":1:"),
        ] {
            try text.write(toFile: dir + "/bad.toml", atomically: true, encoding: .utf8)
            let bad = try run(BuildProducts.path("obsd"), ["--check-config", dir + "/bad.toml"])
            #expect(bad.status == 78 && bad.stderr.contains(message), "\(bad.stderr)")
        }
        // The same errors stop the daemon itself, before it touches its socket.
        let start = try run(BuildProducts.path("obsd"), ["--config", dir + "/bad.toml", "--socket", dir + "/s.sock", "--in-memory"])
        #expect(start.status == 78 && !FileManager.default.fileExists(atPath: dir + "/s.sock"))
        let env = try run(BuildProducts.path("obsd"), ["--socket", dir + "/s.sock", "--in-memory"], environment: ["OBSD_QUEUE_EVENTS": "none"])
        #expect(env.status == 78 && env.stderr.contains("environment variable OBSD_QUEUE_EVENTS"))
    }

    @Test(.enabled(if: which("systemd-analyze") != nil, "needs systemd-analyze"))
    func shippedUnitsPassSystemdAnalyzeVerify() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../..").standardized.path
        for (units, user) in [("systemd", false), ("systemd/user", true)] {
            let dir = TestDaemon.makeTemporaryDirectory()
            defer { try? FileManager.default.removeItem(atPath: dir) }
            // Every unit shipped in the directory, so a new one is verified too.
            let names = try FileManager.default.contentsOfDirectory(atPath: "\(root)/\(units)")
                .filter { $0.hasSuffix(".socket") || $0.hasSuffix(".service") || $0.hasSuffix(".timer") }.sorted()
            #expect(names.contains("obsd.socket") && names.contains("obsd.service"), "\(units): \(names)")
            if !user { #expect(names.contains("obsd-metrics.service") && names.contains("obsd-metrics.timer"), "\(names)") }
            for name in names {
                // Point ExecStart at the binaries under test: verify checks that they exist.
                let text = try String(contentsOfFile: "\(root)/\(units)/\(name)", encoding: .utf8)
                try text.replacingOccurrences(of: "/usr/local/bin/obsd", with: BuildProducts.path("obsd"))
                    .replacingOccurrences(of: "/usr/local/bin/obsctl", with: BuildProducts.path("obsctl"))
                    .write(toFile: "\(dir)/\(name)", atomically: true, encoding: .utf8)
            }
            var env = ProcessInfo.processInfo.environment
            env["XDG_RUNTIME_DIR"] = dir
            let result = try run(
                which("systemd-analyze")!, (user ? ["--user"] : []) + ["verify", "--man=no"] + names.map { "\(dir)/\($0)" },
                environment: env)
            #expect(result.status == 0, "\(units): \(result.stderr)")
        }
    }

    /// The metrics unit writes where its sandbox lets it, and the timer fires every 15 s.
    @Test(.enabled(if: which("systemd-analyze") != nil, "needs systemd-analyze"))
    func metricsUnitWritesTheDirectoryItsSandboxOpensEveryFifteenSeconds() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../systemd").standardized.path
        let service = try unitSettings(String(contentsOfFile: root + "/obsd-metrics.service", encoding: .utf8))
        let exec = try #require(service["ExecStart"]?.first).split(separator: " ").map(String.init)
        #expect(exec.prefix(3) == ["/usr/local/bin/obsctl", "stats", "--prometheus"])
        // The file is world-readable and served to any scraper: the shipped unit names no repository.
        #expect(!exec.contains("--per-repository"), "per-repository series are the operator's choice (README, Metrics)")
        let output = try #require(exec.firstIndex(of: "--output").map { exec[$0 + 1] })
        let directory = URL(fileURLWithPath: output).deletingLastPathComponent().path
        #expect(output.hasSuffix(".prom"), "node_exporter reads *.prom only")
        #expect(service["ReadWritePaths"] == ["-" + directory], "the sandbox opens \(directory) and nothing else")
        #expect(service["Type"] == ["oneshot"] && service["ProtectSystem"] == ["strict"])
        #expect(service["SupplementaryGroups"] == ["obsd"], "the socket is obsd:obsd 0660")

        let timer = try unitSettings(String(contentsOfFile: root + "/obsd-metrics.timer", encoding: .utf8))
        #expect(timer["AccuracySec"] == ["1s"])
        let calendar = try #require(timer["OnCalendar"]?.first)
        let next = try run(which("systemd-analyze")!, ["calendar", "--iterations=3", calendar]).stdout
        // "Next elapse: … 12:00:15 UTC", "Iter. #2: … 12:00:30 UTC", …: 15 s apart.
        var times: [Int] = []
        for line in next.split(separator: "\n") where line.contains("elapse:") || line.contains("Iter.") {
            guard let clock = line.split(separator: " ").first(where: { $0.filter { $0 == ":" }.count == 2 }) else { continue }
            let parts = clock.split(separator: ":").compactMap { Int($0) }
            if parts.count == 3 { times.append(parts[0] * 3600 + parts[1] * 60 + parts[2]) }
        }
        #expect(times.count == 3, "\(next)")
        #expect(zip(times, times.dropFirst()).allSatisfy { ($1 - $0 + 86400) % 86400 == 15 }, "\(next)")
    }

    /// obsctl, run as the metrics unit runs it (root without any capability, the unit's
    /// RLIMIT_NICE), makes only the system calls its filter allows, never maps memory writable
    /// and executable, and libdispatch may set every nice value it asks for: nothing is logged.
    @Test(.enabled(if: which("strace") != nil && which("systemd-analyze") != nil && which("setpriv") != nil && getuid() == 0))
    func metricsUnitSandboxAllowsEverySystemCallObsctlMakes() async throws {
        let unit = try shippedUnit("obsd-metrics.service")
        let d = try await TestDaemon.start(inMemory: true)
        _ = try d.connect().call(["op": "set", "repo": "ui", "key": "k", "value": 1])
        let trace = d.directory + "/trace"
        let limit = prlimitArguments(nice: niceLimit(of: unit))
        let command = (limit ?? []) + [
            which("setpriv")!, "--inh-caps=-all", "--bounding-set=-all", which("strace")!, "-f", "-qq", "-o", trace,
            BuildProducts.path("obsctl"), "--socket", d.socketPath, "stats", "--prometheus", "--output", d.directory + "/obsd.prom",
        ]
        let result = try run(
            command[0], Array(command.dropFirst()),
            environment: ProcessInfo.processInfo.environment.merging(["LIBDISPATCH_LOG": "stderr"]) { $1 })
        #expect(result.status == 0, "\(result.stderr)")
        #expect(try String(contentsOfFile: d.directory + "/obsd.prom", encoding: .utf8).contains("obsd_up 1\n"))
        let traced = try Trace(file: trace)
        #expect(traced.calls.contains("rename") || traced.calls.contains("renameat") || traced.calls.contains("renameat2"), "the trace covers the run")
        try expectAllowed(by: unit, traced)
        // Where this process may not give the child that limit, the trace's check above stands in.
        if limit != nil || niceLimit(of: unit) == 0 {
            #expect(dispatchPriorityComplaints(result.stderr).isEmpty, "\(result.stderr)")
        }
    }

    /// The metrics unit's obsctl needs no right to raise a thread's priority: run as the unit
    /// runs it — root without any capability — under RLIMIT_NICE 0, the kernel's default,
    /// which lets a process lower no nice value (and which prlimit can always set: it only
    /// lowers the limit), with obsd up and with obsd down, it never asks setpriority for a
    /// negative nice value, and libdispatch logs nothing. (libdispatch starts its manager
    /// thread — timers, signal and I/O sources — at the user-interactive QoS, nice -4, as soon
    /// as a thread of its pool runs Swift concurrency's jobs; `LimitNICE=-4` did not keep that
    /// line, "Failed to set thread priority for worker thread … errno=13", out of the journal.)
    @Test(.enabled(if: which("strace") != nil && which("setpriv") != nil && which("prlimit") != nil && getuid() == 0))
    func metricsObsctlAsksForNoPriorityItMayNotSet() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        _ = try d.connect().call(["op": "set", "repo": "ui", "key": "k", "value": 1])
        for (socket, up) in [(d.socketPath, "obsd_up 1\n"), (d.directory + "/absent.sock", "obsd_up 0\n")] {
            let trace = d.directory + "/trace"
            let command = [
                which("prlimit")!, "--nice=0:0", "--", which("setpriv")!, "--inh-caps=-all", "--bounding-set=-all",
                which("strace")!, "-f", "-qq", "-e", "trace=setpriority", "-o", trace,
                BuildProducts.path("obsctl"), "--socket", socket, "stats", "--prometheus", "--output", d.directory + "/obsd.prom",
            ]
            let result = try run(
                command[0], Array(command.dropFirst()),
                environment: ProcessInfo.processInfo.environment.merging(["LIBDISPATCH_LOG": "stderr"]) { $1 })
            #expect(result.status == 0, "\(result.stderr)")
            #expect(try String(contentsOfFile: d.directory + "/obsd.prom", encoding: .utf8).contains(up))
            let requested = requestedNiceValues(try Trace(file: trace).lines)
            #expect(requested.allSatisfy { $0 >= 0 }, "setpriority asked for \(requested)")
            #expect(dispatchPriorityComplaints(result.stderr).isEmpty, "\(result.stderr)")
        }
    }

    @Test(.enabled(if: which("strace") != nil && which("setpriv") != nil && which("systemd-analyze") != nil && getuid() == 0))
    func sandboxAllowsEverySystemCallObsdMakesAndNoWritableExecutableMemory() async throws {
        let unit = try shippedUnit("obsd.service")
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        chmod(dir, 0o777)
        let trace = dir + "/trace"
        // As the unit runs it: a non-root user, the unit's RLIMIT_NICE, durable storage.
        let limit = prlimitArguments(nice: niceLimit(of: unit))
        let command = (limit ?? []) + [
            which("setpriv")!, "--reuid=nobody", "--regid=nogroup", "--clear-groups", which("strace")!, "-f", "-qq", "-o", trace,
            BuildProducts.path("obsd"), "--socket", dir + "/s.sock", "--data-dir", dir + "/data",
        ]
        let process = try ChildProcess(
            command[0], Array(command.dropFirst()), environment: ProcessInfo.processInfo.environment.merging(["LIBDISPATCH_LOG": "stderr"]) { $1 },
            stderr: .file(dir + "/stderr"))
        defer { process.stop(grace: .seconds(5)) }
        var c: WireConnection? = nil
        let deadline = ContinuousClock.now + .seconds(30)
        while c == nil, ContinuousClock.now < deadline {
            c = try? WireConnection(path: dir + "/s.sock")
            if c == nil { try await Task.sleep(for: .milliseconds(20)) }
        }
        let client = try #require(c)
        _ = try client.call(["op": "subscribe", "repo": "x", "initial": true])
        for i in 0..<50 { _ = try client.call(["op": "set", "repo": "x", "key": .string("k\(i % 5)"), "value": .int(Int64(i))]) }
        _ = try client.call(["op": "list", "repo": "x", "values": true])
        _ = try client.call(["op": "stats"])
        // obsd's pid starts the trace's first line (its execve).
        let first = try String(contentsOfFile: trace, encoding: .utf8).prefix { $0.isNumber }
        let pid = try #require(Int32(first))
        // ExecReload= runs in the same sandbox, as the same user.
        let reload = commandLine(try #require(unit["ExecReload"]?.last)).map { $0 == "$MAINPID" ? String(pid) : $0 }
        let reloaded = try run(
            which("setpriv")!, ["--reuid=nobody", "--regid=nogroup", "--clear-groups", which("strace")!, "-f", "-qq", "-o", dir + "/reload.trace"] + reload,
            environment: ["OBSD_SOCKET": dir + "/s.sock", "PATH": "/usr/bin:/bin"])
        #expect(reloaded.status == 0, "\(reloaded.stderr)")
        // strace blocks fatal signals (-o FILE PROG): stop obsd itself, gracefully, so the
        // trace covers shutdown too.
        kill(pid, SIGTERM)
        await process.exit(timeout: .seconds(30))

        let traced = try Trace(file: trace)
        #expect(traced.calls.count > 30, "the trace covers the run")
        try expectAllowed(by: unit, traced)
        let reloadTrace = try Trace(file: dir + "/reload.trace")
        #expect(reloadTrace.calls.contains("kill"), "the trace covers the reload")
        try expectAllowed(by: unit, reloadTrace)
        if limit != nil || niceLimit(of: unit) == 0 {
            let stderr = (try? String(contentsOfFile: dir + "/stderr", encoding: .utf8)) ?? ""
            #expect(dispatchPriorityComplaints(stderr).isEmpty, "\(stderr)")
        }
    }
}

/// An strace log (`strace -f -qq -o FILE`): its lines, and the names of the system calls made.
struct Trace {
    let lines: [Substring]
    let calls: Set<String>

    init(file: String) throws {
        lines = try String(contentsOfFile: file, encoding: .utf8).split(separator: "\n")
        var calls = Set<String>()
        for line in lines {
            // "<pid> <spaces> name(args) = result"
            let call = line.drop { $0.isNumber }.drop { $0 == " " }
            guard let paren = call.firstIndex(of: "(") else { continue }
            let name = String(call[..<paren])
            if !name.isEmpty, name.allSatisfy({ $0.isLowercase || $0.isNumber || $0 == "_" }) { calls.insert(name) }
        }
        self.calls = calls
    }
}

/// Checks a traced run against a unit's sandbox: every system call its filter allows
/// (`SystemCallFilter=@system-service` and `~@privileged`), no memory mapped writable and
/// executable (`MemoryDenyWriteExecute=yes` would kill the process), and every nice value
/// libdispatch asked for allowed by the unit's RLIMIT_NICE (`LimitNICE=`; else setpriority
/// fails with EACCES and libdispatch logs it, each time a worker thread starts).
func expectAllowed(by unit: [String: [String]], _ trace: Trace, sourceLocation: SourceLocation = #_sourceLocation) throws {
    let writableExecutable = trace.lines.filter {
        ($0.contains("mmap(") || $0.contains("mprotect(")) && $0.contains("PROT_WRITE") && $0.contains("PROT_EXEC")
    }
    #expect(writableExecutable.isEmpty, "MemoryDenyWriteExecute=yes would kill: \(writableExecutable.prefix(3))", sourceLocation: sourceLocation)
    let allowed = try syscallGroup("@system-service")
    let denied = try syscallGroup("@privileged")
    #expect(unit["SystemCallFilter"] == ["@system-service", "~@privileged"], sourceLocation: sourceLocation)
    #expect(trace.calls.subtracting(allowed).isEmpty, "not in @system-service: \(trace.calls.subtracting(allowed).sorted())", sourceLocation: sourceLocation)
    #expect(trace.calls.intersection(denied).isEmpty, "in ~@privileged: \(trace.calls.intersection(denied).sorted())", sourceLocation: sourceLocation)
    let requested = requestedNiceValues(trace.lines)
    let refused = niceValuesRefused(requested, limit: niceLimit(of: unit))
    #expect(refused.isEmpty, "RLIMIT_NICE \(niceLimit(of: unit)) refuses nice \(Set(refused).sorted()): raise LimitNICE=", sourceLocation: sourceLocation)
}

/// A unit file's settings: each key's values, in order (comments and section headers left out).
func unitSettings(_ text: String) -> [String: [String]] {
    var settings: [String: [String]] = [:]
    for line in text.split(separator: "\n") where !line.hasPrefix("#") && !line.hasPrefix("[") {
        guard let eq = line.firstIndex(of: "=") else { continue }
        settings[String(line[..<eq]), default: []].append(String(line[line.index(after: eq)...]))
    }
    return settings
}

/// The system calls of a `SystemCallFilter=` group, nested groups included.
func syscallGroup(_ name: String) throws -> Set<String> {
    let out = try run(which("systemd-analyze")!, ["syscall-filter", name]).stdout
    var names = Set<String>()
    for line in out.split(separator: "\n").dropFirst() {
        let item = line.trimmingCharacters(in: .whitespaces)
        if item.isEmpty || item.hasPrefix("#") { continue }
        if item.hasPrefix("@") { names.formUnion(try syscallGroup(item)) } else { names.insert(item) }
    }
    return names
}
