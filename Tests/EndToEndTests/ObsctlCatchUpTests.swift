// End-to-end tests of `obsctl watch --since` against scripted daemons (ScriptedServer): it
// resumes with `catchup` and never exits 4 for `compacted` — a replay prints the changes, a
// diff one line per key marked (caught up), a snapshot the current values marked (reset),
// each as JSON lines with --json, then the `synced` line and live changes; an older daemon's
// `compacted` is followed by a subscription with `initial`, shown as the same reset;
// `--strict` keeps the plain `since` and exit 4; `--once` ends after a catch-up that lists a
// key; `--exec` runs marked. Each script ends the connection after its last line, so
// obsctl exits (69: the connection was lost) with everything printed; it writes its lines at
// once, so that an obsctl that ends early cannot make a later write fail (SIGPIPE).

import Foundation
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ObsctlCatchUpTests {
    /// A daemon whose only connection gets `script` after its subscribe request (recorded).
    func daemon(_ log: ScriptLog, _ script: @escaping @Sendable (WireConnection, JSONObject) throws -> Void) throws -> (ScriptedServer, String) {
        let path = scriptedSocketPath()
        let server = try scriptedServer(path: path) { _, connection in
            let subscribe = try connection.expect("subscribe")
            log.record(subscribe)
            try script(connection, subscribe)
        }
        return (server, path)
    }

    static func diff(_ connection: WireConnection, _ subscribe: JSONObject) throws {
        try connection.reply(to: subscribe, [("sub", 1), ("rev", 97), ("epoch", "E"), ("catchup", "diff")])
        try connection.send(lines: [
            ScriptedEvent.catchUp(repo: "ui", from: 40, rev: 97, values: [("theme", "dark"), ("lang", "fr")], deleted: ["draft"]),
            ScriptedEvent.position("synced", repo: "ui", rev: 97),
            ScriptedEvent.change(repo: "ui", rev: 98, "theme", old: "dark", new: "light"),
        ])
    }

    static func reset(_ connection: WireConnection, _ subscribe: JSONObject) throws {
        try connection.reply(to: subscribe, [("sub", 1), ("rev", 3), ("epoch", "F"), ("catchup", "snapshot")])
        try connection.send(lines: [
            ScriptedEvent.snapshot(repo: "ui", rev: 3, [("lang", "de"), ("theme", "blue")]),
            ScriptedEvent.position("synced", repo: "ui", rev: 3),
            ScriptedEvent.change(repo: "ui", rev: 4, "lang", old: "de", new: nil),
        ])
    }

    /// The request obsctl resumed with: since 40 in epoch E, with catchup, without once.
    func expectCatchUpRequest(_ log: ScriptLog, sourceLocation: SourceLocation = #_sourceLocation) {
        let request = log.of("subscribe").first
        #expect(request?["since"] == 40 && request?["epoch"] == "E" && request?["catchup"] == true, sourceLocation: sourceLocation)
        #expect(request?["once"] == nil && request?["initial"] == nil, sourceLocation: sourceLocation)
    }

    @Test func aDiffIsPrintedOneLinePerKeyMarkedCaughtUpThenLive() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log, Self.diff)
        defer { server.stop() }
        let human = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E"], socket: path)
        #expect(human.stdout == """
            97  ui/draft  (deleted)  (caught up)
            97  ui/lang  = "fr"  (caught up)
            97  ui/theme  = "dark"  (caught up)
            98  ui/theme  "dark" → "light"

            """)
        #expect(human.stderr.contains("no longer holds the revisions after 40") && human.stderr.contains("caught up at revision 97 (epoch E)"), "\(human.stderr)")
        #expect(human.status == 69, "the script ended the connection")
        expectCatchUpRequest(log)
    }

    @Test func aDiffAsJSONIsOneLine() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log, Self.diff)
        defer { server.stop() }
        let json = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--json"], socket: path)
        #expect(json.stdout.split(separator: "\n") == [
            #"{"repo":"ui","rev":97,"from":40,"catchup":true,"values":{"theme":"dark","lang":"fr"},"deleted":["draft"],"epoch":"E"}"#,
            #"{"repo":"ui","rev":97,"synced":true,"epoch":"E"}"#,
            #"{"repo":"ui","key":"theme","rev":98,"old":"dark","new":"light","epoch":"E"}"#,
        ])
        #expect(!json.stderr.contains("caught up"), "with --json, standard error says nothing of it: \(json.stderr)")
        expectCatchUpRequest(log)
    }

    @Test func aSnapshotIsPrintedAsTheCurrentValuesMarkedReset() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log, Self.reset)
        defer { server.stop() }
        let human = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E"], socket: path)
        #expect(human.stdout == """
            3  ui/lang  = "de"  (reset)
            3  ui/theme  = "blue"  (reset)
            4  ui/lang  "de" → (deleted)

            """)
        #expect(human.stderr.contains("(reset)") && human.stderr.contains("caught up at revision 3 (epoch F)"), "\(human.stderr)")
        let json = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--json"], socket: path)
        #expect(json.stdout.split(separator: "\n") == [
            #"{"repo":"ui","rev":3,"reset":true,"values":{"lang":"de","theme":"blue"},"epoch":"F"}"#,
            #"{"repo":"ui","rev":3,"synced":true,"epoch":"F"}"#,
            #"{"repo":"ui","key":"lang","rev":4,"old":"de","epoch":"F"}"#,
        ])
    }

    @Test func aReplayIsPrintedAsBefore() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log) { connection, subscribe in
            try connection.reply(to: subscribe, [("sub", 1), ("rev", 42), ("epoch", "E"), ("catchup", "replay")])
            try connection.send(lines: [
                ScriptedEvent.change(repo: "ui", rev: 41, "theme", old: "a", new: "b"),
                ScriptedEvent.change(repo: "ui", rev: 42, "theme", old: "b", new: "c"),
                ScriptedEvent.position("synced", repo: "ui", rev: 42),
            ])
        }
        defer { server.stop() }
        let json = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--json"], socket: path)
        #expect(json.stdout.split(separator: "\n") == [
            #"{"repo":"ui","key":"theme","rev":41,"old":"a","new":"b","epoch":"E"}"#,
            #"{"repo":"ui","key":"theme","rev":42,"old":"b","new":"c","epoch":"E"}"#,
            #"{"repo":"ui","rev":42,"synced":true,"epoch":"E"}"#,
        ])
        expectCatchUpRequest(log)
    }

    @Test func anOlderDaemonsCompactedIsFollowedByTheCurrentValuesAsAReset() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log) { connection, subscribe in
            try connection.refuse(subscribe, .compacted, "revision 40 is no longer in the history")
            let fresh = try connection.expect("subscribe")
            log.record(fresh)
            try connection.reply(to: fresh, [("sub", 2), ("rev", 3), ("epoch", "F")])
            try connection.send(lines: [
                ScriptedEvent.snapshot(sub: 2, repo: "ui", rev: 3, [("theme", "blue")]),  // no synced: it asked for initial
                ScriptedEvent.change(sub: 2, repo: "ui", rev: 4, "theme", old: "blue", new: "red"),
            ])
        }
        defer { server.stop() }
        let json = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--json"], socket: path)
        #expect(json.stdout.split(separator: "\n") == [
            #"{"repo":"ui","rev":3,"reset":true,"values":{"theme":"blue"},"epoch":"F"}"#,
            #"{"repo":"ui","rev":3,"synced":true,"epoch":"F"}"#,
            #"{"repo":"ui","key":"theme","rev":4,"old":"blue","new":"red","epoch":"F"}"#,
        ])
        #expect(json.status == 69, "not 4: a resume never fails")
        let fresh = log.of("subscribe").last
        #expect(log.of("subscribe").count == 2 && fresh?["initial"] == true && fresh?["since"] == nil && fresh?["catchup"] == nil)
    }

    @Test func strictKeepsThePlainSinceAndExits4OnCompacted() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log) { connection, subscribe in
            try connection.refuse(subscribe, .compacted, "revision 40 is no longer in the history")
            try connection.serveUntilClosed()
        }
        defer { server.stop() }
        let strict = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--strict"], socket: path)
        #expect(strict.status == 4)
        #expect(strict.stderr.contains("compacted"), "\(strict.stderr)")
        let request = log.of("subscribe").first
        #expect(request?["since"] == 40 && request?["epoch"] == "E" && request?["catchup"] == nil)
        #expect(log.of("subscribe").count == 1)
        #expect(try obsctl(["watch", "ui", "--strict"], socket: path).status == 64, "--strict goes with --since")
        #expect(try obsctl(["watch", "--help"], socket: path).stdout.contains("--strict"))
    }

    @Test func onceEndsAfterACatchUpThatListsAKey() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log) { connection, subscribe in
            try connection.reply(to: subscribe, [("sub", 1), ("rev", 97), ("epoch", "E"), ("catchup", "diff")])
            try connection.send(lines: [
                ScriptedEvent.catchUp(repo: "ui", from: 40, rev: 97, values: [("lang", "fr")], deleted: []),
                ScriptedEvent.position("synced", repo: "ui", rev: 97),
            ])
            try connection.serveUntilClosed()  // obsctl ends it
        }
        defer { server.stop() }
        let once = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--once"], socket: path)
        #expect(once.status == 0 && once.stdout == "97  ui/lang  = \"fr\"  (caught up)\n", "\(once.stdout) \(once.stderr)")
        expectCatchUpRequest(log)
    }

    @Test func execRunsForEachKeyCaughtUpMarked() async throws {
        let log = ScriptLog()
        let (server, path) = try daemon(log, Self.diff)
        defer { server.stop() }
        let dir = TestDaemon.makeTemporaryDirectory()
        let runs = dir + "/runs"
        let script = #"echo "$OBSD_KEY $OBSD_REV ${OBSD_OLD-unset} ${OBSD_NEW-unset} ${OBSD_CATCHUP-} ${OBSD_RESET-}" >> "# + runs
        let result = try obsctl(["watch", "ui", "--since", "40", "--epoch", "E", "--exec", "sh", "-c", script], socket: path)
        #expect(result.status == 69)
        #expect(try String(contentsOfFile: runs, encoding: .utf8) == """
            draft 97 unset unset 1 
            lang 97 unset "fr" 1 
            theme 97 unset "dark" 1 
            theme 98 "dark" "light"  

            """)
    }
}
