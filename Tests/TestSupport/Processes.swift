// Test support: starting and stopping child processes as a service manager would.
//
// Foundation's `Process` starts children with posix_spawn, which copies the calling
// thread's signal mask — and the test runner's worker threads block most signals, so a
// child would ignore SIGTERM. `startCleanly` clears the mask for the spawn.

import Foundation

#if canImport(Glibc)
import Glibc
#endif

extension Process {
    /// Runs the process with no signals blocked, as systemd would start it.
    public func startCleanly() throws {
        var empty = sigset_t()
        var saved = sigset_t()
        sigemptyset(&empty)
        pthread_sigmask(SIG_SETMASK, &empty, &saved)
        defer { pthread_sigmask(SIG_SETMASK, &saved, nil) }
        try run()
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit, then SIGKILLs it.
    /// Returns whether it exited on its own.
    @discardableResult
    public func stop(grace: Duration = .seconds(20)) -> Bool {
        guard isRunning else { return true }
        terminate()
        let deadline = ContinuousClock.now + grace
        while isRunning, ContinuousClock.now < deadline { usleep(10_000) }
        if isRunning {
            kill(processIdentifier, SIGKILL)
            waitUntilExit()
            return false
        }
        waitUntilExit()
        return true
    }
}
