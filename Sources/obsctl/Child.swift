// obsctl — the commands obsctl runs (`hold -- COMMAND`, `watch --exec`): started through
// swift-subprocess with obsctl's standard descriptors and every signal at its default; for
// `hold`, the signals obsctl receives relayed to the command; and a command's end passed on
// as obsctl's own (its exit status, or death by the same signal).
//
// Relaying: obsctl's handler (sigaction, SA_SIGINFO) sends the signal on with
// pidfd_send_signal on the command's pidfd. swift-subprocess reaps the command only once its
// monitor saw it exit, and closes the pidfd after that: until then the pidfd names the
// command (or its zombie); afterwards a stale number is no pidfd (EBADF) — a signal can never
// reach a process that reused the command's pid. (Without pidfds — Linux before 5.3 — the
// handler falls back to kill(2) on the pid.) A signal the kernel sent to the terminal's
// foreground process group (Ctrl-C, a hangup: si_code SI_KERNEL) is not relayed: the command,
// in that group too, got its own. A signal that arrives before the command runs is relayed
// once it does.

import Subprocess
import Synchronization
import SystemPackage

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

/// Runs a command to completion.
enum ChildCommand {
    /// The signals `hold` relays to its command: those a service manager, a shell or a user
    /// sends to ask a program to stop, reload or report (SIGKILL and SIGSTOP cannot be caught).
    static let relayedSignals: [Int32] = [SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH, SIGCONT]

    /// Runs `arguments[0]` (looked up in `PATH` unless it contains a slash) with the rest as its
    /// arguments; standard input, output and error are obsctl's (`input: false`: /dev/null).
    ///
    /// - Returns: how it ended.
    /// - Throws: `CommandFailure` when it could not be started (exit status 127 when there is no
    ///   such command, else 126, as a shell reports them).
    static func run(
        _ arguments: [String], environment: Environment = .inherit, input: Bool = true, relayingSignals relay: Bool = false
    ) async throws(CommandFailure) -> TerminationStatus {
        guard let name = arguments.first, !name.isEmpty else { throw CommandFailure(status: 127, message: "no command given") }
        let executable: Executable = name.contains("/") ? .path(FilePath(name)) : .name(name)
        do {
            let result: ExecutionResult<Void, FileDescriptorOutput, FileDescriptorOutput>
            if input {
                result = try await Subprocess.run(
                    executable, arguments: Arguments(Array(arguments.dropFirst())), environment: environment,
                    input: .fileDescriptor(.standardInput, closeAfterSpawningProcess: false), output: .currentStandardOutput,
                    error: .currentStandardError
                ) { execution in
                    if relay { SignalRelay.target(execution.processIdentifier) }
                }
            } else {
                result = try await Subprocess.run(
                    executable, arguments: Arguments(Array(arguments.dropFirst())), environment: environment, input: .none,
                    output: .currentStandardOutput, error: .currentStandardError
                ) { execution in
                    if relay { SignalRelay.target(execution.processIdentifier) }
                }
            }
            if relay { SignalRelay.clearTarget() }
            return result.terminationStatus
        } catch let error as SubprocessError {
            if relay { SignalRelay.clearTarget() }
            let status: UInt8 = error.code == .executableNotFound ? 127 : 126
            throw CommandFailure(status: status, message: "cannot run \(name): \(error)")
        } catch {
            if relay { SignalRelay.clearTarget() }
            throw CommandFailure(status: 126, message: "cannot run \(name): \(error)")
        }
    }

    /// Ends obsctl as `status` ended the command: with its exit status, or — killed by a
    /// signal — by the same signal (without a core dump of obsctl's own), so that a shell
    /// reports 128+N and systemd sees the signal.
    static func exit(like status: TerminationStatus) -> Never {
        switch status {
        case .exited(let code):
            Glibc.exit(code)
        case .signaled(let sig):
            var none = rlimit(rlim_cur: 0, rlim_max: 0)
            setrlimit(__rlimit_resource_t(RLIMIT_CORE.rawValue), &none)
            signal(sig, SIG_DFL)
            var set = sigset_t()
            sigemptyset(&set)
            sigaddset(&set, sig)
            pthread_sigmask(SIG_UNBLOCK, &set, nil)
            raise(sig)
            Glibc.exit(128 + sig)  // a signal whose default is not to terminate
        }
    }
}

/// A command that could not be started: the exit status obsctl reports, and why.
struct CommandFailure: Error, CustomStringConvertible {
    let status: UInt8
    let message: String
    var description: String { message }
}

/// Relays the signals obsctl receives to the command `hold` runs (see the file header).
enum SignalRelay {
    /// The command's pidfd, -1 when it has none (or none runs).
    private static let pidfd = Atomic<Int32>(-1)
    /// The command's pid, 0 when none runs.
    private static let pid = Atomic<Int32>(0)
    /// A signal that arrived while no command ran yet (0: none).
    private static let pending = Atomic<Int32>(0)

    /// `pidfd_send_signal(2)` (glibc 2.36), which Swift's Glibc module does not export; nil
    /// where the C library lacks it.
    private typealias PidfdSendSignal = @convention(c) (Int32, Int32, UnsafeMutableRawPointer?, UInt32) -> Int32
    // Written once, by `install()`, before any handler that reads it is installed; a handler
    // only reads it. (`nonisolated(unsafe)`: a C function pointer is not `Sendable`.)
    private nonisolated(unsafe) static var sendSignal: PidfdSendSignal?

    /// Installs the handlers for `ChildCommand.relayedSignals` (once, before the command starts).
    static func install() {
        if let symbol = dlsym(UnsafeMutableRawPointer(bitPattern: 0), "pidfd_send_signal") {
            sendSignal = unsafeBitCast(symbol, to: PidfdSendSignal.self)
        }
        // Touch the atomics, so that no handler is the first to initialise them.
        _ = (pidfd.load(ordering: .relaxed), pid.load(ordering: .relaxed), pending.load(ordering: .relaxed))
        for sig in ChildCommand.relayedSignals {
            var action = sigaction()
            action.__sigaction_handler.sa_sigaction = { sig, info, _ in SignalRelay.handle(sig, info) }
            action.sa_flags = SA_SIGINFO | SA_RESTART
            sigemptyset(&action.sa_mask)
            sigaction(sig, &action, nil)
        }
    }

    /// The command runs: relay to it from now on, and what arrived before.
    static func target(_ process: ProcessIdentifier) {
        pidfd.store(process.processDescriptor, ordering: .sequentiallyConsistent)
        pid.store(process.value, ordering: .sequentiallyConsistent)
        let early = pending.exchange(0, ordering: .sequentiallyConsistent)
        if early != 0 { deliver(early) }
    }

    /// The command has ended (and was reaped): relay nothing more.
    static func clearTarget() {
        pid.store(0, ordering: .sequentiallyConsistent)
        pidfd.store(-1, ordering: .sequentiallyConsistent)
    }

    /// The handler: async-signal-safe (atomics and system calls only).
    private static func handle(_ sig: Int32, _ info: UnsafeMutablePointer<siginfo_t>?) {
        if let info, info.pointee.si_code == 0x80 { return }  // SI_KERNEL: the terminal's group got it
        if pid.load(ordering: .sequentiallyConsistent) == 0 {
            pending.store(sig, ordering: .sequentiallyConsistent)
            return
        }
        deliver(sig)
    }

    private static func deliver(_ sig: Int32) {
        let fd = pidfd.load(ordering: .sequentiallyConsistent)
        if fd >= 0, let sendSignal {
            _ = sendSignal(fd, sig, nil, 0)
        } else {
            let target = pid.load(ordering: .sequentiallyConsistent)
            if target > 0 { kill(target, sig) }
        }
    }
}
