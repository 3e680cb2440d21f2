// End-to-end tests of the daemon process and of obsctl: start-up, socket file handling,
// graceful SIGTERM, and the CLI's output and exit codes.

import Foundation
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct DaemonLifecycleTests {
    @Test func sigtermShutsDownGracefullyWithExitZeroAndRemovesTheSocket() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        _ = try c.call(["op": "subscribe", "repo": "x"])
        #expect(await d.stop() == 0)
        #expect(!FileManager.default.fileExists(atPath: d.socketPath))
        #expect(try c.receiveLine() == nil, "clients see the connection close")
        #expect(d.log.contains("obsd stopped"))
    }

    @Test func sigintAlsoExitsZero() async throws {
        let d = try await TestDaemon.start()
        d.signal(SIGINT)
        #expect(await d.waitForExit() == 0)
    }

    @Test func staleSocketIsReplacedButALiveDaemonIsNot() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        // A stale socket: bound, then abandoned.
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        _ = withUnixAddress(dir + "/obsd.sock", fd) { bind($0, $1, $2) }
        close(fd)
        let d = try await TestDaemon.start(directory: dir)
        #expect(try d.connect().call(["op": "ping"]).ok)

        let second = try run(BuildProducts.path("obsd"), ["--socket", d.socketPath, "--in-memory"])
        #expect(second.status != 0)
        #expect(second.stderr.contains("another obsd is already serving \(d.socketPath)"))
        #expect(try d.connect().call(["op": "ping"]).ok, "the first daemon keeps its socket")
    }

    @Test func refusesToReplaceAFileThatIsNotASocket() throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = dir + "/not-a-socket"
        _ = FileManager.default.createFile(atPath: path, contents: Data("precious".utf8))
        let result = try run(BuildProducts.path("obsd"), ["--socket", path, "--in-memory"])
        #expect(result.status != 0)
        #expect(result.stderr.contains("exists and is not a socket"))
        #expect(try String(contentsOfFile: path, encoding: .utf8) == "precious")
    }

    @Test func createsTheSocketDirectoryAndSetsTheMode() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let nested = dir + "/a/b/obsd.sock"
        let process = try ChildProcess(BuildProducts.path("obsd"), ["--socket", nested, "--in-memory"])
        defer { process.stop() }
        let deadline = ContinuousClock.now + .seconds(20)
        while !FileManager.default.fileExists(atPath: nested), ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(10))
        }
        var st = stat()
        #expect(lstat(nested, &st) == 0)
        #expect(st.st_mode & 0o777 == 0o660)
    }

    @Test func aDataDirectoryServesOneDaemonOnly() async throws {
        let d = try await TestDaemon.start()
        let other = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: other) }
        let second = try run(BuildProducts.path("obsd"), ["--socket", other + "/obsd.sock", "--data-dir", d.directory + "/data"])
        #expect(second.status != 0)
        #expect(second.stderr.contains("data directory \(d.directory)/data is in use by another obsd (pid \(d.pid))"))
    }

    @Test func everySettingHasTheFlagItsTableEntryNames() throws {
        let help = try run(BuildProducts.path("obsd"), ["--help"]).stdout
        let settings = try run(BuildProducts.path("obsd"), ["--check-config", "/dev/null"]).stdout
        var checked = 0
        for line in settings.split(separator: "\n") {
            // key = value    # --flag, $VARIABLE
            guard let hash = line.range(of: "    # --") else { continue }
            let key = line.prefix { $0 != " " }
            let flag = line[hash.upperBound...].prefix { $0 != "," }
            #expect(help.contains("--\(flag) ") || help.contains("--\(flag)\n"), "obsd --help offers --\(flag)")
            #expect(help.contains("[\(key)"), "obsd --help names \(key)")
            checked += 1
        }
        #expect(checked >= 25)
    }

    @Test func badFlagsAreUsageErrors() throws {
        // Values that fail the settings' checks are configuration errors (78) naming the flag.
        let result = try run(BuildProducts.path("obsd"), ["--log-level", "loud"])
        #expect(result.status == 78)
        #expect(result.stderr.contains("--log-level: log.level must be one of trace, debug, info, notice, warning, error, critical, not \"loud\""))
        let sync = try run(BuildProducts.path("obsd"), ["--sync", "sometimes"])
        #expect(sync.status == 78 && sync.stderr.contains("--sync: storage.sync must be one of always, relaxed"))
        // Contradictory or malformed flags are usage errors (64).
        let both = try run(BuildProducts.path("obsd"), ["--in-memory", "--data-dir", "/tmp/x"])
        #expect(both.status == 64 && both.stderr.contains("use one of --data-dir and --in-memory"))
        let unknown = try run(BuildProducts.path("obsd"), ["--max-lien", "100"])
        #expect(unknown.status == 64 && unknown.stderr.contains("unknown option --max-lien (did you mean --max-line?)"))
        let missing = try run(BuildProducts.path("obsd"), ["--in-memory", "--socket"])
        #expect(missing.status == 64 && missing.stderr.contains("--socket needs a value"))
        // A value the setting cannot take is a configuration error, wherever it comes from.
        let notANumber = try run(BuildProducts.path("obsd"), ["--max-line", "lots"])
        #expect(notANumber.status == 78 && notANumber.stderr.contains("--max-line: limits.max-line must be an integer"))
    }

    @Test func oneReleaseNumberEverywhere() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        #expect(try d.connect().call(["op": "hello"])["server"] == .string("obsd/\(ObsRelease.version)"))
        #expect(try run(BuildProducts.path("obsd"), ["--version"]).stdout == "\(ObsRelease.version)\n")
        #expect(try run(BuildProducts.path("obsctl"), ["--version"]).stdout == "\(ObsRelease.version)\n")
    }

    @Test func anUnknownSocketOwnerOrAnImpossiblePathIsAConfigurationError() throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let user = try run(BuildProducts.path("obsd"), ["--socket", dir + "/s.sock", "--in-memory", "--socket-user", "no-such-user-here"])
        #expect(user.status == 78 && user.stderr.contains("socket.user: no user named no-such-user-here"), "\(user.status) \(user.stderr)")
        let group = try run(BuildProducts.path("obsd"), ["--socket", dir + "/s.sock", "--in-memory", "--socket-group", "no-such-group-here"])
        #expect(group.status == 78 && group.stderr.contains("socket.group: no group named no-such-group-here"))
        let long = try run(BuildProducts.path("obsd"), ["--socket", dir + "/" + String(repeating: "s", count: 120), "--in-memory"])
        #expect(long.status == 78 && long.stderr.contains("Unix sockets allow at most 107"))
        // --check-config finds the same mistake in a file.
        try "[socket]\nuser = \"no-such-user-here\"\n".write(toFile: dir + "/obsd.toml", atomically: true, encoding: .utf8)
        let checked = try run(BuildProducts.path("obsd"), ["--check-config", dir + "/obsd.toml"])
        #expect(checked.status == 78 && checked.stderr.contains("no user named no-such-user-here"))
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ObsctlTests {
    @Test func setGetDelAndExitCodes() async throws {
        let d = try await TestDaemon.start()
        let s = d.socketPath
        #expect(try obsctl(["set", "ui", "theme", "dark"], socket: s).stdout == "rev 1\n")
        #expect(try obsctl(["set", "ui", "theme", "dark"], socket: s).stdout == "rev 1 (unchanged)\n")
        #expect(try obsctl(["get", "ui", "theme"], socket: s).stdout == "\"dark\"\n")
        #expect(try obsctl(["get", "ui", "theme", "--raw"], socket: s).stdout == "dark\n")
        #expect(try obsctl(["get", "ui", "theme", "--json"], socket: s).stdout == "{\"value\":\"dark\",\"rev\":1}\n")
        // VALUE is JSON when it parses, else a string; --string and --json force either.
        _ = try obsctl(["set", "ui", "n", "42"], socket: s)
        #expect(try obsctl(["get", "ui", "n"], socket: s).stdout == "42\n")
        _ = try obsctl(["set", "ui", "n", "42", "--string"], socket: s)
        #expect(try obsctl(["get", "ui", "n"], socket: s).stdout == "\"42\"\n")
        _ = try obsctl(["set", "ui", "o", "{\"a\": [1, true]}"], socket: s)
        #expect(try obsctl(["get", "ui", "o"], socket: s).stdout == "{\"a\":[1,true]}\n")
        let badJSON = try obsctl(["set", "ui", "o", "{oops", "--json"], socket: s)
        #expect(badJSON.status == 64 && badJSON.stderr.contains("not valid JSON"))

        let absent = try obsctl(["get", "ui", "nope"], socket: s)
        #expect(absent.status == 1 && absent.stdout.isEmpty && absent.stderr.contains("does not exist"))
        let conflict = try obsctl(["set", "ui", "theme", "x", "--if-rev", "7"], socket: s)
        #expect(conflict.status == 2 && conflict.stderr.contains("conflict"))
        let badName = try obsctl(["set", "bad name", "k", "v"], socket: s)
        #expect(badName.status == 4 && badName.stderr.contains("invalid repository name"))
        #expect(try obsctl(["del", "ui", "theme"], socket: s).stdout.hasPrefix("rev "))
        #expect(try obsctl(["del", "ui", "theme"], socket: s).stdout.hasSuffix("(absent)\n"))
        let usage = try obsctl(["set", "ui"], socket: s)
        #expect(usage.status == 64)
        let down = try run(BuildProducts.path("obsctl"), ["--socket", "/tmp/obsd-test-none/obsd.sock", "get", "a", "b"])
        #expect(down.status == 69)
        #expect(down.stderr == "obsctl: cannot connect to obsd at /tmp/obsd-test-none/obsd.sock: no such file — is obsd running?\n")
        // The socket also comes from OBSD_SOCKET.
        var env = ProcessInfo.processInfo.environment
        env["OBSD_SOCKET"] = s
        #expect(try run(BuildProducts.path("obsctl"), ["get", "ui", "n"], environment: env).stdout == "\"42\"\n")
    }

    @Test func aNegativeNumberIsAValueAndOtherDashedValuesFollowTheTerminator() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let s = d.socketPath
        let negative = try obsctl(["set", "ui", "n", "-5"], socket: s)
        #expect(negative.status == 0 && negative.stdout == "rev 1\n", "\(negative.stderr)")
        #expect(try obsctl(["get", "ui", "n"], socket: s).stdout == "-5\n")
        #expect(try obsctl(["set", "ui", "n", "-0.25"], socket: s).stdout == "rev 2\n")
        #expect(try obsctl(["set", "ui", "n", "-0.25", "--force"], socket: s).stdout == "rev 3\n", "a flag after it is still a flag")
        #expect(try obsctl(["get", "ui", "n"], socket: s).stdout == "-0.25\n")
        #expect(try obsctl(["set", "ui", "text", "--", "--force"], socket: s).stdout == "rev 4\n")
        #expect(try obsctl(["get", "ui", "text"], socket: s).stdout == "\"--force\"\n")
        let typo = try obsctl(["set", "ui", "n", "--forse"], socket: s)
        #expect(typo.status == 64 && typo.stderr.contains("Unknown option '--forse'"), "a mistyped flag is not a value")
        let dashed = try obsctl(["set", "ui", "n", "-x"], socket: s)
        #expect(dashed.status == 64 && dashed.stderr.contains("obsctl set ui n -- -x"))
        #expect(try obsctl(["set", "ui", "n", "1", "2"], socket: s).status == 64)
        #expect(try obsctl(["get", "ui", "n"], socket: s).stdout == "-0.25\n", "nothing else was written")
    }

    @Test func listReposStats() async throws {
        let d = try await TestDaemon.start()
        let s = d.socketPath
        _ = try obsctl(["set", "ui", "b", "2"], socket: s)
        _ = try obsctl(["set", "ui", "a", "\"x\""], socket: s)
        _ = try obsctl(["set", "cfg", "k", "true"], socket: s)
        #expect(try obsctl(["list", "ui"], socket: s).stdout == "a\nb\n")
        #expect(try obsctl(["list", "ui", "--values"], socket: s).stdout == "a\t\"x\"\nb\t2\n")
        let epoch = try #require(JSONParser.parse(obsctl(["list", "ui", "--json"], socket: s).stdout).objectValue?["epoch"]?.stringValue)
        #expect(try obsctl(["list", "ui", "--prefix", "b", "--json"], socket: s).stdout == "{\"rev\":2,\"epoch\":\"\(epoch)\",\"keys\":[\"b\"]}\n")
        #expect(try obsctl(["repos"], socket: s).stdout == "NAME  REV         KEYS\ncfg   1           1\nui    2           2\n")
        #expect(
            try obsctl(["repos", "--json"], socket: s).stdout
                == "[{\"name\":\"cfg\",\"rev\":1,\"keys\":1,\"epoch\":\"\(epoch)\"},{\"name\":\"ui\",\"rev\":2,\"keys\":2,\"epoch\":\"\(epoch)\"}]\n")
        let stats = try obsctl(["stats"], socket: s).stdout
        #expect(stats.contains("connections: 1\n") && stats.contains("repos: 2\n"))
    }

    @Test func watchShowsOldAndNewValues() async throws {
        let d = try await TestDaemon.start()
        let s = d.socketPath
        _ = try obsctl(["set", "ui", "theme", "light"], socket: s)
        // A watch that stops after its first change; started before the write it reports.
        let outPath = d.directory + "/watch.out"
        let watch = try ChildProcess(BuildProducts.path("obsctl"), ["--socket", s, "watch", "ui", "theme", "--once"], stdout: .file(outPath))
        // Wait until the watch's subscription is live (the daemon counts it), then write.
        let probe = try d.connect()
        #expect(try await eventually { () async throws in try probe.call(["op": "stats"])["subscriptions"] == 1 })
        _ = try obsctl(["set", "ui", "theme", "dark"], socket: s)
        await watch.exit(timeout: .seconds(20))
        let text = try String(contentsOfFile: outPath, encoding: .utf8)
        #expect(watch.terminationStatus == 0)
        #expect(text == "2  ui/theme  \"light\" → \"dark\"\n")

        _ = try obsctl(["del", "ui", "theme"], socket: s)
        let json = try obsctl(["watch", "ui", "--since", "0", "--json"], socket: s, stopAfterLines: 4)
        let epoch = try #require(JSONParser.parse(obsctl(["list", "ui", "--json"], socket: s).stdout).objectValue?["epoch"]?.stringValue)
        #expect(json.stdout.split(separator: "\n") == [
            #"{"repo":"ui","key":"theme","rev":1,"new":"light","epoch":"\#(epoch)"}"#,
            #"{"repo":"ui","key":"theme","rev":2,"old":"light","new":"dark","epoch":"\#(epoch)"}"#,
            #"{"repo":"ui","key":"theme","rev":3,"old":"dark","epoch":"\#(epoch)"}"#,
            #"{"repo":"ui","rev":3,"synced":true,"epoch":"\#(epoch)"}"#,
        ])
        _ = try obsctl(["set", "ui", "theme", "blue"], socket: s)
        let initial = try obsctl(["watch", "ui", "--initial"], socket: s, stopAfterLines: 1)
        #expect(initial.stdout == "4  ui/theme  = \"blue\"\n")
        let bad = try obsctl(["watch", "ui", "k", "--prefix", "p"], socket: s)
        #expect(bad.status == 64)
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ObsctlPipelineTests {
    @Test func watchIntoAPipeThatClosesEndsLikeAnyToolInAPipeline() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        var ends: [Int32] = [0, 0]
        #expect(pipe(&ends) == 0)
        for fd in ends { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
        let watch = try ChildProcess(BuildProducts.path("obsctl"), ["--socket", d.socketPath, "watch", "ui"], stdout: .descriptor(ends[1]))
        close(ends[1])
        let probe = try d.connect()
        #expect(try eventually { try probe.call(["op": "stats"])["subscriptions"] == 1 })
        _ = try probe.call(["op": "set", "repo": "ui", "key": "k", "value": 1])
        // `head -1`: read one line, then go away.
        var byte: UInt8 = 0
        var line: [UInt8] = []
        while read(ends[0], &byte, 1) == 1, byte != 10 { line.append(byte) }
        close(ends[0])
        #expect(String(decoding: line, as: UTF8.self).contains("ui/k"))
        // The next event finds standard output closed: obsctl ends (by SIGPIPE, as etcdctl would).
        var exited = false
        for i in 2...100 where !exited {
            _ = try probe.call(["op": "set", "repo": "ui", "key": "k", "value": .int(Int64(i))])
            exited = await watch.exit(timeout: .milliseconds(100)) != nil
        }
        #expect(exited, "obsctl watch kept running after its reader went away")
        #expect(watch.terminatingSignal == SIGPIPE)
    }

    @Test func aValueThatStartsLikeJSONButIsNotIsRefusedNotStoredAsAString() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let s = d.socketPath
        for typo in [#"{"a":"#, "[1, 2", #""unterminated"#, "  {oops}"] {
            let result = try obsctl(["set", "ui", "k", typo], socket: s)
            #expect(result.status == 64, "\(typo): \(result.status)")
            #expect(result.stderr.contains("--string"), "\(result.stderr)")
        }
        #expect(try obsctl(["get", "ui", "k"], socket: s).status == 1, "nothing was stored")
        #expect(try obsctl(["set", "ui", "k", #"{"a":"#, "--string"], socket: s).status == 0)
        #expect(try obsctl(["get", "ui", "k"], socket: s).stdout == #""{\"a\":""# + "\n")
        #expect(try obsctl(["set", "ui", "n", "plain text"], socket: s).status == 0, "text that does not look like JSON is a string")
    }
}

/// Runs `obsctl` until it has printed `stopAfterLines` lines (or 20 s passed), then stops it.
func obsctl(_ arguments: [String], socket: String, stopAfterLines: Int) throws -> CommandResult {
    let dir = TestDaemon.makeTemporaryDirectory()
    defer { try? FileManager.default.removeItem(atPath: dir) }
    let outPath = dir + "/stdout"
    let process = try ChildProcess(BuildProducts.path("obsctl"), ["--socket", socket] + arguments, stdout: .file(outPath))
    let deadline = ContinuousClock.now + .seconds(20)
    var text = ""
    while ContinuousClock.now < deadline {
        text = (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? ""
        if text.filter({ $0 == "\n" }).count >= stopAfterLines || !process.isRunning { break }
        usleep(10_000)
    }
    process.stop()
    text = (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? text
    return CommandResult(status: process.terminationStatus, stdout: text, stderr: "")
}
