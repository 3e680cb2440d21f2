// End-to-end test support: runs the real `obsd` binary on a temporary socket.

import Foundation
import ObsProtocol
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A running `obsd` process owned by a test.
final class TestDaemon: @unchecked Sendable {
    // @unchecked: `process` is only touched by the test that owns this daemon, one call at a time.
    let directory: String
    let socketPath: String
    let logPath: String
    var arguments: [String]
    var environment: [String: String] = [:]
    /// The data directory (`<directory>/data`), or nil with `--in-memory`.
    let dataDirectory: String?
    /// The running (or last) process; nil before the first launch.
    private(set) var process: ChildProcess!

    /// Starts obsd with `arguments` added to `--socket` (and `--data-dir` unless `inMemory`),
    /// and waits until it accepts connections.
    static func start(
        _ arguments: [String] = [], directory: String? = nil, inMemory: Bool = false, environment: [String: String] = [:],
        dataDirectory: String? = nil
    ) async throws -> TestDaemon {
        let dir = directory ?? makeTemporaryDirectory()
        let data = inMemory ? nil : (dataDirectory ?? dir + "/data")
        let daemon = TestDaemon(directory: dir, arguments: arguments, dataDirectory: data)
        daemon.environment = environment
        try await daemon.launch()
        return daemon
    }

    private init(directory: String, arguments: [String], dataDirectory: String?) {
        self.directory = directory
        self.socketPath = directory + "/obsd.sock"
        self.logPath = directory + "/obsd.log"
        self.arguments = arguments
        self.dataDirectory = dataDirectory
    }

    /// The arguments obsd is started with.
    var commandLine: [String] {
        ["--socket", socketPath, "--log-level", "debug"]
            + (dataDirectory.map { ["--data-dir", $0] } ?? ["--in-memory"]) + arguments
    }

    /// Starts (or restarts) the process and waits until the socket answers.
    ///
    /// A start refused because the data directory is "in use by another obsd (pid <this test
    /// process>)" is made again, for up to 10 s: a store the test opened in process and closed
    /// a moment ago may still hold the directory's lock, because a child another test spawns
    /// shares the lock's open file between its fork and its exec (`flock` belongs to the open
    /// file; a fresh clone's run on a busy machine: `aDeletionAKillInterruptedIsMadeAtStartUp`).
    /// obsd spawns no child; this is the test process's own doing. Any other failure, or that
    /// one after 10 s, fails the test.
    func launch() async throws {
        let env = environment.isEmpty ? nil : ProcessInfo.processInfo.environment.merging(environment) { $1 }
        let deadline = ContinuousClock.now + .seconds(10)
        while true {
            let logged = log.utf8.count
            process = try ChildProcess(
                BuildProducts.path("obsd"), commandLine, environment: env, stdout: .file(logPath), stderr: .file(logPath))
            do {
                return try await waitUntilServing()
            } catch where !process.isRunning && ContinuousClock.now < deadline
                && String(decoding: log.utf8.dropFirst(logged), as: UTF8.self).contains("is in use by another obsd (pid \(getpid()))")
            {
                try await Task.sleep(for: .milliseconds(10))
            }
        }
    }

    /// Waits until the socket answers. A daemon still starting — its CPU time still growing,
    /// as it reads a large state on a loaded machine — is waited for; one that made no
    /// progress for 20 s is hung, and fails the test.
    private func waitUntilServing() async throws {
        var deadline = ContinuousClock.now + .seconds(20)
        var cpu = Self.cpuTicks(of: process.pid)
        while true {
            if !process.isRunning {
                throw TestFailure("obsd exited with status \(process.terminationStatus) before serving:\n\(log)")
            }
            if let connection = try? WireConnection(path: socketPath) {
                connection.close()
                return
            }
            // Checked once more after the deadline (a starved test must not blame the daemon).
            if ContinuousClock.now >= deadline {
                let now = Self.cpuTicks(of: process.pid)
                guard let now, let before = cpu, now > before else { break }
                (cpu, deadline) = (now, ContinuousClock.now + .seconds(20))
            }
            try await Task.sleep(for: .milliseconds(10))
        }
        throw TestFailure("obsd did not start serving \(socketPath), using no CPU for 20 s:\n\(log)")
    }

    /// The CPU time the running process has used so far (user and system): what a start-up
    /// cost, read right after `launch`, whatever else the machine was doing meanwhile.
    var cpuTime: Duration? {
        guard let ticks = Self.cpuTicks(of: process.pid) else { return nil }
        return .milliseconds(Int64(ticks) * 1000 / Int64(sysconf(Int32(_SC_CLK_TCK))))
    }

    /// The process's CPU time so far (user and system, in clock ticks), from /proc.
    private static func cpuTicks(of pid: pid_t) -> UInt64? {
        guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
            let end = stat.lastIndex(of: ")")
        else { return nil }
        // After "pid (comm)": state is field 3; utime and stime are fields 14 and 15.
        let fields = stat[stat.index(after: end)...].split(separator: " ")
        guard fields.count > 12, let user = UInt64(fields[11]), let system = UInt64(fields[12]) else { return nil }
        return user + system
    }

    /// Sends SIGTERM and waits for the exit status (SIGKILL after 20 s: then not 0).
    @discardableResult
    func stop() async -> Int32 {
        await process.terminate()
        return process.terminationStatus
    }

    /// Kills the process with SIGKILL.
    func kill9() { process.kill9() }

    /// Sends a signal.
    func signal(_ sig: Int32) { process.signal(sig) }

    /// Waits up to `timeout` for the process to exit by itself; its status (-1 if it still runs).
    func waitForExit(timeout: Duration = .seconds(20)) async -> Int32 {
        await process.exit(timeout: timeout)
        return process.terminationStatus
    }

    var pid: Int32 { process.pid }

    var log: String { (try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "" }

    func connect() throws -> WireConnection { try WireConnection(path: socketPath) }

    /// Runs obsd once more on the same directories and returns how it ended (for start-up errors).
    func runToCompletion() throws -> CommandResult {
        try run(BuildProducts.path("obsd"), commandLine, environment: ProcessInfo.processInfo.environment.merging(environment) { $1 })
    }

    deinit {
        process?.kill9()
        try? FileManager.default.removeItem(atPath: directory)
    }

    /// A fresh directory, removed when the tests end.
    static func makeTemporaryDirectory() -> String { TemporaryDirectory.make(prefix: "obsd-test-") }
}

/// Runs `obsctl` and returns its exit status and output.
struct CommandResult {
    let status: Int32
    let stdout: String
    let stderr: String
}

func obsctl(_ arguments: [String], socket: String) throws -> CommandResult {
    try run(BuildProducts.path("obsctl"), ["--socket", socket] + arguments)
}

func run(_ executable: String, _ arguments: [String], environment: [String: String]? = nil, timeout: Duration = .seconds(60)) throws -> CommandResult {
    // Output goes to files, read after the process exits: a pipe's end of file can be held
    // off by a process another test spawns at the same moment.
    let dir = TestDaemon.makeTemporaryDirectory()
    defer { try? FileManager.default.removeItem(atPath: dir) }
    let (outPath, errPath) = (dir + "/stdout", dir + "/stderr")
    let process = try ChildProcess(executable, arguments, environment: environment, stdout: .file(outPath), stderr: .file(errPath))
    guard process.wait(timeout: timeout) != nil else {
        process.kill9()
        throw TestFailure("\(executable) \(arguments.joined(separator: " ")) did not exit within \(timeout)")
    }
    return CommandResult(
        status: process.terminationStatus, stdout: (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? "",
        stderr: (try? String(contentsOfFile: errPath, encoding: .utf8)) ?? "")
}
