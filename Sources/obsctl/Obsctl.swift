// obsctl — the command-line client of obsd: root command, shared options, exit codes,
// and error reporting, and the threads its work runs on. Subcommands are in the other files of
// this target.

import ArgumentParser
import NIOCore
import NIOPosix
import ObsClient
import ObsProtocol

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

@main
struct Obsctl: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "obsctl",
        abstract: "Read, write and watch keys of obsd repositories.",
        discussion: """
            The socket is, in order: --socket, $OBSD_SOCKET, $XDG_RUNTIME_DIR/obsd.sock, /run/obsd/obsd.sock.

            Exit status:
              0   success
              1   not found (get of an absent key)
              2   conflict (an --if-rev condition failed)
              3   forbidden
              4   the daemon refused the request (bad request, too large, overloaded, internal; compacted only for
                  watch --since --strict), or, for reload, the configuration file (obsd kept its settings)
              64  usage error
              69  cannot connect to obsd, or the connection was lost (stats --prometheus prints obsd_up 0 and exits 0)
              70  the daemon broke the protocol
              74  cannot write to standard output, or the file given with --output
              75  watch was cut off because it read too slowly (resume with --since), or reload timed out
              124 wait timed out (--timeout)
              126, 127 hold, watch --exec: the command could not be run (127: not found)
              141 (killed by SIGPIPE) standard output was closed, e.g. piped into head
            hold with a command exits as the command did (its status, or by the same signal).
            """,
        version: ObsRelease.version,
        subcommands: [
            Set.self, Get.self, Del.self, Watch.self, List.self, Repos.self, Stats.self, Reload.self, Hold.self, Wait.self, Leases.self,
        ])

    /// Accepts the global options before the subcommand, too (`obsctl --socket P get …`).
    @OptionGroup var global: GlobalOptions

    /// Parses the command line and runs the command. A command that makes one exchange with
    /// obsd and ends (`OneExchange`) runs with Swift concurrency's jobs on the event loop
    /// threads it talks to obsd on, not on libdispatch's thread pool. On Linux the first thread
    /// of that pool to run a job starts libdispatch's manager thread at the user-interactive
    /// quality of service — nice -4 — which a process without CAP_SYS_NICE needs RLIMIT_NICE
    /// for: "Failed to set thread priority for worker thread … errno=13" (notice) was logged on
    /// every run of the metrics unit (`stats`), whose sandbox grants neither. The pool is left to
    /// the commands that follow a stream or wait (watch, hold, wait, reload, leases): their
    /// timers are libdispatch's anyway, and a watch reads events about 4 times faster on it.
    /// Installed before the first job leaves the main thread (this function's synchronous
    /// start, on the main actor); where it cannot be, the jobs run on the pool as before.
    @MainActor static func main() async {
        let command: any ParsableCommand
        do {
            command = try parseAsRoot()
        } catch {
            exit(withError: error)
        }
        if command is any OneExchange {
            NIOSingletons.unsafeTryInstallSingletonPosixEventLoopGroupAsConcurrencyGlobalExecutor()
        }
        await run(command)
    }

    /// Runs a parsed command (off the main actor, as `AsyncParsableCommand.main` does).
    private static func run(_ command: sending any ParsableCommand) async {
        do {
            if var asynchronous = command as? any AsyncParsableCommand {
                try await asynchronous.run()
            } else {
                var synchronous = command
                try synchronous.run()
            }
        } catch {
            exit(withError: error)
        }
    }
}

/// A command that makes one exchange with obsd and ends: no stream to follow, no timer (see
/// `Obsctl.main`).
protocol OneExchange: SendableMetatype {}

extension Obsctl.Set: OneExchange {}
extension Obsctl.Get: OneExchange {}
extension Obsctl.Del: OneExchange {}
extension Obsctl.List: OneExchange {}
extension Obsctl.Repos: OneExchange {}
extension Obsctl.Stats: OneExchange {}

/// Options every subcommand takes.
struct GlobalOptions: ParsableArguments {
    @Option(help: ArgumentHelp("The daemon's socket.", valueName: "path"))
    var socket: String?

    /// Connects, runs `body`, closes; turns every failure into a message and an exit code.
    func withClient(_ body: (ObsConnection) async throws -> Void) async throws {
        let client: ObsConnection
        do {
            client = try await ObsConnection.connect(socketPath: socket)
        } catch {
            throw fail(error)
        }
        do {
            try await body(client)
        } catch let error as ObsClientError {
            await client.close()
            throw fail(error)
        } catch {
            await client.close()
            throw error
        }
        await client.close()
    }
}

/// obsctl's exit statuses.
enum Exit {
    static let notFound = ExitCode(1)
    static let conflict = ExitCode(2)
    static let forbidden = ExitCode(3)
    static let refused = ExitCode(4)
    static let usage = ExitCode(64)
    static let unavailable = ExitCode(69)
    static let software = ExitCode(70)
    static let ioError = ExitCode(74)
    static let tempFail = ExitCode(75)
    /// `wait --timeout` ran out, as timeout(1) reports it.
    static let timedOut = ExitCode(124)
}

/// Prints the error for a person and returns the exit code it maps to.
func fail(_ error: ObsClientError) -> ExitCode {
    printError(error.description)
    switch error.code {
    case .cannotConnect, .connectionClosed, .sessionClosed, .cancelled: return Exit.unavailable
    case .overflowed: return Exit.tempFail
    case .protocolViolation, .undecodable, .unencodable: return Exit.software
    case .notFound: return Exit.notFound
    case .conflict: return Exit.conflict
    case .forbidden: return Exit.forbidden
    default: return Exit.refused  // every other refusal of the daemon's
    }
}

func printError(_ message: String) {
    writeLine("obsctl: \(message)", to: STDERR_FILENO)
}

/// Writes a line to standard output, unbuffered (watch output is streamed). When nobody
/// reads standard output any more (`obsctl watch … | head -1` after head exited), obsctl
/// ends as every tool in a pipeline does: by SIGPIPE (a shell reports status 141).
func emit(_ line: String) {
    guard writeLine(line, to: STDOUT_FILENO) else {
        if errno == EPIPE {
            signal(SIGPIPE, SIG_DFL)
            raise(SIGPIPE)
        }
        printError("cannot write to standard output: \(String(cString: strerror(errno)))")
        exit(74)  // EX_IOERR
    }
}

/// Whether the whole line was written.
@discardableResult
private func writeLine(_ line: String, to fd: Int32) -> Bool {
    var text = line + "\n"
    return text.withUTF8 { bytes in
        var offset = 0
        while offset < bytes.count {
            let n = write(fd, bytes.baseAddress! + offset, bytes.count - offset)
            if n < 0 {
                if errno == EINTR { continue }
                return false
            }
            offset += n
        }
        return true
    }
}
