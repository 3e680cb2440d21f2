// End-to-end: `obsctl watch --exec` against the real binaries — a command run per changed
// key, one run at a time, with the change in its environment; and `--coalesce` under a burst
// of 10,000 writes: far fewer runs, the last of which sees the final value.

import Foundation
import ObsProtocol
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct WatchExecTests {
    @Test func theCommandRunsForEachChangedKeyOneAtATimeWithTheChangeInItsEnvironment() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let log = d.directory + "/runs"
        // Each run appends its variables, then a line of its own after a pause: runs that
        // overlapped would interleave them.
        let script = """
            printf '%s|%s|%s|%s|%s|%s|%s|%s|%s\\n' "$OBSD_REPO" "$OBSD_KEY" "$OBSD_REV" "${OBSD_OLD-unset}" "${OBSD_NEW-unset}" \
              "${OBSD_BY_UID-unset}" "${OBSD_BY_PID-unset}" "${OBSD_LEASE_END-unset}" "${OBSD_FROM-unset}" >> \(log)
            sleep 0.02; echo end >> \(log)
            """
        let watch = try BackgroundObsctl(
            ["watch", "svc", "--writers", "--exec", "sh", "-c", script], socket: d.socketPath, directory: d.directory, name: "watch")
        try d.waitForSubscriptions(1)
        let writer = try d.connect()
        #expect(try writer.call(["op": "batch", "repo": "svc", "ops": [["op": "set", "key": "a", "value": ["x": 1]], ["op": "set", "key": "b", "value": "s"]]]).ok)
        let lease = try #require(try writer.call(["op": "grant"])["lease"])
        #expect(try writer.call(["op": "set", "repo": "svc", "key": "a", "value": ["x": 2], "lease": lease]).ok)
        #expect(try writer.call(["op": "revoke", "lease": lease]).ok)
        #expect(eventually { ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").components(separatedBy: "end\n").count > 4 }, "\(watch.stderr)")
        let pid = try #require(try writer.call(["op": "stats"])["peer"]?.objectValue?["pid"]).int64Value ?? 0
        let uid = getuid()
        #expect(try String(contentsOfFile: log, encoding: .utf8) == """
            svc|a|1|unset|{"x":1}|\(uid)|\(pid)|unset|unset
            end
            svc|b|1|unset|"s"|\(uid)|\(pid)|unset|unset
            end
            svc|a|2|{"x":1}|{"x":2}|\(uid)|\(pid)|unset|unset
            end
            svc|a|3|{"x":2}|unset|\(uid)|\(pid)|revoked|unset
            end

            """)
        watch.process.kill9()
        try d.waitForSubscriptions(0)
        let missing = try obsctl(["watch", "svc", "--exec", "/nonexistent/cmd"], socket: d.socketPath, after: {
            try d.waitForSubscriptions(1)
            _ = try d.connect().call(["op": "set", "repo": "svc", "key": "c", "value": 1])
        })
        #expect(missing.status == 127)
    }

    @Test func coalesceFoldsABurstIntoFewRunsAndTheLastSeesTheFinalValue() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let log = d.directory + "/runs"
        let released = d.directory + "/released"
        // The burst comes while a run is still going, held until the test says so — not while
        // runs merely happen to be slower than writes (on a busy machine they may not be).
        let script = "echo \"$OBSD_REV $OBSD_NEW\" >> \(log); while [ ! -e \(released) ]; do sleep 0.01; done"
        let watch = try BackgroundObsctl(
            ["watch", "burst", "--coalesce", "--exec", "sh", "-c", script], socket: d.socketPath, directory: d.directory, name: "watch")
        try d.waitForSubscriptions(1)
        let writer = try d.connect()
        let lines = { ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").split(separator: "\n") }
        #expect(try writer.call(["op": "set", "repo": "burst", "key": "k", "value": 1]).ok)
        #expect(eventually(timeout: .seconds(30)) { lines() == ["1 1"] }, "the first run is going: \(lines())")
        for i in 2...10_000 { try writer.request(["op": "set", "repo": "burst", "key": "k", "value": .int(Int64(i))]) }
        for _ in 2...10_000 { #expect(try writer.receive(timeout: .seconds(30)).ok) }
        #expect(FileManager.default.createFile(atPath: released, contents: nil))
        #expect(eventually(timeout: .seconds(60)) { lines().last == "10000 10000" }, "the last run sees the final value: \(lines().suffix(3))")
        let runs = lines().count
        print("watch --exec --coalesce: 10000 writes, \(runs) runs")
        // One run while the whole burst arrives, then one per batch of what was still on its way
        // to obsctl when it ended (2 or 3 runs in all, 20 times over on a loaded machine).
        #expect(runs < 20, "\(runs) runs for 10,000 writes")
        let revisions = lines().compactMap { UInt64($0.split(separator: " ")[0]) }
        #expect(revisions == revisions.sorted() && Set(revisions).count == revisions.count, "in order, each revision at most once")
        watch.process.kill9()
    }
}

/// Runs obsctl, doing `after` once it started (for a command that waits for something to happen).
func obsctl(_ arguments: [String], socket: String, after: () throws -> Void) throws -> CommandResult {
    let dir = TestDaemon.makeTemporaryDirectory()
    defer { try? FileManager.default.removeItem(atPath: dir) }
    let child = try BackgroundObsctl(arguments, socket: socket, directory: dir, name: "obsctl")
    try after()
    let status = try child.status()
    return CommandResult(status: status, stdout: child.stdout, stderr: child.stderr)
}
