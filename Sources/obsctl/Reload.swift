// obsctl — `reload`: has obsd re-read its configuration file (SIGHUP) and waits until it
// has. It is the units' ExecReload=: `systemctl reload` waits for ExecReload= to exit, and
// systemd before 253 has no Type=notify-reload, so a bare `kill -HUP` made it return before
// obsd had read the file (and needed procps' /bin/kill, which a minimal system may lack).

import ArgumentParser
import ObsClient
import ObsProtocol

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

extension Obsctl {
    struct Reload: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Have obsd re-read its configuration file, and wait until it has.",
            discussion: """
                Sends SIGHUP to the obsd serving the socket, then waits until its stats count the reload as ended: \
                exit 0 once the new settings apply, 4 if obsd kept its running settings (the file is invalid: the reason \
                is printed). Needs obsd's full stats and the right to signal it, so run it as root or as obsd's user — \
                as the units' ExecReload= does, with --pid $MAINPID.
                """)

        @OptionGroup var global: GlobalOptions
        @Option(help: ArgumentHelp("The pid obsd must have (a unit's $MAINPID); another process is not signalled.", valueName: "pid"))
        var pid: Int32?
        @Option(help: ArgumentHelp("How long to wait for the reload to end, in seconds.", valueName: "seconds"))
        var timeout: Int = 60

        func validate() throws {
            if let pid, pid <= 0 { throw ValidationError("--pid must be a process id above 0, not \(pid)") }
            if timeout <= 0 { throw ValidationError("--timeout must be a number of seconds above 0, not \(timeout)") }
        }

        func run() async throws {
            try await global.withClient { client in
                let before = try ReloadCounters(try await client.statistics(), socket: client.socketPath)
                if let pid, pid != before.pid {
                    printError("the obsd at \(client.socketPath) is pid \(before.pid), not \(pid); nothing was signalled (is --socket right?)")
                    throw Exit.refused
                }
                guard kill(before.pid, SIGHUP) == 0 else {
                    printError("cannot signal obsd (pid \(before.pid)): \(String(cString: strerror(errno)))")
                    throw errno == EPERM ? Exit.forbidden : Exit.refused
                }
                let deadline = ContinuousClock.now + .seconds(timeout)
                while true {
                    let now = try ReloadCounters(try await client.statistics(), socket: client.socketPath)
                    if now.ended > before.ended {
                        guard now.failed == before.failed else {
                            printError("obsd kept its running settings: \(now.error ?? "see its log")")
                            throw Exit.refused
                        }
                        return
                    }
                    guard ContinuousClock.now < deadline else {
                        printError("obsd (pid \(before.pid)) did not finish reloading within \(timeout) s")
                        throw Exit.tempFail
                    }
                    try await Task.sleep(for: .milliseconds(20))
                }
            }
        }
    }
}

/// What `stats` says about reloads, for a privileged caller.
struct ReloadCounters {
    let pid: Int32
    let ended: UInt64
    let failed: UInt64
    let error: String?

    /// Throws, having said why, if the reply lacks the fields (a caller that is not
    /// privileged, or an obsd older than this obsctl).
    init(_ stats: Stats, socket: String) throws {
        guard let pid = stats.pid, let ended = stats.reloads, let failed = stats.reloadFailures, let id = Int32(exactly: pid) else {
            if stats.peer?.privileged == false {
                printError("obsd at \(socket) shows its reloads only to root and its own user; run obsctl reload as one of them")
                throw Exit.forbidden
            }
            printError("obsd at \(socket) (\(stats.server ?? "unknown version")) does not report its reloads; it is older than this obsctl")
            throw Exit.refused
        }
        (self.pid, self.ended, self.failed, self.error) = (id, ended, failed, stats.reloadError)
    }
}
