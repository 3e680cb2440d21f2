// Test support: child processes started and reaped by the test itself.
//
// Foundation's `Process` is not used for children of tests: it learns that a child exited
// from SIGCHLD through libdispatch, and the test runner's threads block signals — a thread
// that briefly unblocked them to spawn a child with a clean mask (as a service manager
// would start it) could swallow a SIGCHLD, and `waitUntilExit` then waited forever (seen:
// a whole test run wedged with both cooperative threads in `waitUntilExit` of children
// that were long gone). Here the child gets its clean signal state from `posix_spawn`
// attributes, the parent's mask is never touched, and the test reaps its own child with
// `waitpid` on that pid — with a deadline on every wait.

import ObservableKit

#if canImport(Glibc)
import Glibc
#endif

public struct SpawnFailure: Error, CustomStringConvertible {
    public let description: String
}

/// Where a child's standard input or output goes.
public enum Redirect: Sendable {
    case null
    /// A file, opened for appending (output) or reading (input).
    case file(String)
    /// A descriptor of the test process, duplicated onto the standard one.
    case descriptor(Int32)

    func apply(_ actions: inout posix_spawn_file_actions_t, _ target: Int32, flags: Int32) {
        switch self {
        case .null: posix_spawn_file_actions_addopen(&actions, target, "/dev/null", flags, 0o644)
        case .file(let path): posix_spawn_file_actions_addopen(&actions, target, path, flags, 0o644)
        case .descriptor(let fd): posix_spawn_file_actions_adddup2(&actions, fd, target)
        }
    }
}

/// A child process: spawned with every signal at its default disposition and none blocked,
/// standard input from `/dev/null` (or a file), standard output and error to files, and no
/// descriptor of the test process other than those three.
public final class ChildProcess: Sendable {
    public let pid: pid_t
    /// The raw `waitpid` status once reaped.
    private let reaped = Locked<Int32?>(nil)

    /// Starts `executable` with `arguments`.
    ///
    /// - Parameters:
    ///   - environment: the whole environment (nil: the test process's).
    ///   - stdin: a file to read standard input from (nil: `/dev/null`), or a descriptor.
    ///   - stdout, stderr: files to append to (nil: `/dev/null`), or descriptors.
    ///   - keep: descriptors of the test process the child inherits under the same numbers
    ///     (e.g. a notify socket); everything else above 2 is closed in the child.
    public init(
        _ executable: String, _ arguments: [String], environment: [String: String]? = nil, stdin: Redirect = .null,
        stdout: Redirect = .null, stderr: Redirect = .null, keep: [Int32] = []
    ) throws {
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        stdin.apply(&actions, 0, flags: O_RDONLY)
        stdout.apply(&actions, 1, flags: O_WRONLY | O_CREAT | O_APPEND)
        stderr.apply(&actions, 2, flags: O_WRONLY | O_CREAT | O_APPEND)
        if keep.isEmpty {
            Self.closeFrom(&actions, 3)
        } else {
            // Close everything but the kept descriptors: up to the highest kept one by hand,
            // the rest in one step.
            let highest = keep.max()!
            for fd in 3...highest where !keep.contains(fd) { posix_spawn_file_actions_addclose(&actions, fd) }
            Self.closeFrom(&actions, highest + 1)
        }

        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var none = sigset_t()
        sigemptyset(&none)
        var all = sigset_t()
        sigfillset(&all)
        posix_spawnattr_setsigmask(&attributes, &none)
        posix_spawnattr_setsigdefault(&attributes, &all)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))

        let env = (environment ?? Self.currentEnvironment).map { "\($0.key)=\($0.value)" }
        let argv = ([executable] + arguments).map { strdup($0) } + [nil]
        let envp = env.map { strdup($0) } + [nil]
        defer {
            for p in argv { free(p) }
            for p in envp { free(p) }
        }
        var pid: pid_t = 0
        let rc = posix_spawn(&pid, executable, &actions, &attributes, argv, envp)
        guard rc == 0 else { throw SpawnFailure(description: "cannot start \(executable): \(String(cString: strerror(rc)))") }
        self.pid = pid
    }

    deinit {
        if reaped.withLock({ $0 }) == nil {
            kill(pid, SIGKILL)
            _ = wait(timeout: .seconds(10))
        }
    }

    /// Whether the child is still running (reaping it if it has exited).
    public var isRunning: Bool { poll() == nil }

    /// Sends a signal.
    public func signal(_ sig: Int32) {
        if reaped.withLock({ $0 }) == nil { kill(pid, sig) }
    }

    /// Waits up to `timeout` for the child to exit; its status, or nil if it still runs.
    @discardableResult
    public func wait(timeout: Duration) -> Int32? {
        let deadline = ContinuousClock.now + timeout
        while true {
            if let status = poll() { return status }
            if ContinuousClock.now >= deadline { return nil }
            usleep(2_000)
        }
    }

    /// Waits up to `timeout` for the child to exit without blocking a thread.
    @discardableResult
    public func exit(timeout: Duration) async -> Int32? {
        let deadline = ContinuousClock.now + timeout
        while true {
            if let status = poll() { return status }
            if ContinuousClock.now >= deadline { return nil }
            try? await Task.sleep(for: .milliseconds(5))
        }
    }

    /// SIGTERM, then up to `grace` for the child to exit, then SIGKILL. Whether it exited by itself.
    @discardableResult
    public func stop(grace: Duration = .seconds(20)) -> Bool {
        guard isRunning else { return true }
        kill(pid, SIGTERM)
        if wait(timeout: grace) != nil { return true }
        kill(pid, SIGKILL)
        wait(timeout: .seconds(10))
        return false
    }

    /// SIGTERM, then up to `grace` for the child to exit, then SIGKILL — without blocking a
    /// thread of the cooperative pool (which other tests share). Whether it exited by itself.
    @discardableResult
    public func terminate(grace: Duration = .seconds(20)) async -> Bool {
        guard isRunning else { return true }
        kill(pid, SIGTERM)
        if await exit(timeout: grace) != nil { return true }
        kill(pid, SIGKILL)
        await exit(timeout: .seconds(10))
        return false
    }

    /// SIGKILL, and wait for it.
    public func kill9() {
        guard isRunning else { return }
        kill(pid, SIGKILL)
        wait(timeout: .seconds(10))
    }

    /// The exit code (0–255) if the child exited; nil while it runs or if a signal ended it.
    public var exitCode: Int32? {
        guard let status = poll(), status & 0x7F == 0 else { return nil }
        return (status >> 8) & 0xFF
    }

    /// The signal that ended the child, if one did.
    public var terminatingSignal: Int32? {
        guard let status = poll(), status & 0x7F != 0, status & 0x7F != 0x7F else { return nil }
        return status & 0x7F
    }

    /// The exit code, or 128 + the signal that ended the child (as a shell reports it);
    /// -1 while it runs.
    public var terminationStatus: Int32 {
        if let code = exitCode { return code }
        if let signal = terminatingSignal { return 128 + signal }
        return -1
    }

    /// Reaps the child if it has exited; its raw status.
    private func poll() -> Int32? {
        reaped.withLock { status in
            if let status { return status }
            var raw: Int32 = 0
            let r = waitpid(pid, &raw, WNOHANG)
            if r == pid {
                status = raw
            } else if r < 0, errno == ECHILD {
                status = 0x7F00  // not ours to reap any more: report it as gone
            }
            return status
        }
    }

    private static var currentEnvironment: [String: String] {
        var result: [String: String] = [:]
        var p = environ
        while let entry = p.pointee {
            let text = String(cString: entry)
            if let eq = text.firstIndex(of: "=") { result[String(text[..<eq])] = String(text[text.index(after: eq)...]) }
            p += 1
        }
        return result
    }

    /// `posix_spawn_file_actions_addclosefrom_np` (glibc 2.34+), which Swift's Glibc module
    /// does not export; without it, descriptors are expected to be close-on-exec.
    private static func closeFrom(_ actions: inout posix_spawn_file_actions_t, _ fd: Int32) {
        typealias CloseFrom = @convention(c) (UnsafeMutablePointer<posix_spawn_file_actions_t>, Int32) -> Int32
        guard let symbol = dlsym(UnsafeMutableRawPointer(bitPattern: 0), "posix_spawn_file_actions_addclosefrom_np") else { return }
        _ = unsafeBitCast(symbol, to: CloseFrom.self)(&actions, fd)
    }
}
