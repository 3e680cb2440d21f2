// End-to-end: epochs — a `since` resumes only within the history it was seen in. An
// in-memory daemon that restarts, a data directory that is new or replaced by a restored
// backup, an unclean stop under relaxed sync followed by a reboot: each is another
// history, and a resume that names the old epoch gets `compacted` instead of revisions
// that only share numbers with the ones the client saw. The client library and obsctl
// carry the epoch for their users (obsctl's `--strict` exits 4 there; without it, the other
// history's values come as a reset).

import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct EpochTests {
    /// Writes `values` to `key`, one revision each.
    private func write(_ c: WireConnection, _ repo: String, _ key: String, _ values: ClosedRange<Int>) throws {
        for v in values { #expect(try c.call(["op": "set", "repo": .string(repo), "key": .string(key), "value": .int(Int64(v))]).ok) }
    }

    private func epoch(_ c: WireConnection, _ repo: String) throws -> String {
        try #require(c.call(["op": "list", "repo": .string(repo)])["epoch"]?.stringValue)
    }

    @Test func everyReplyThatReportsARevisionCarriesTheEpoch() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        let before = try epoch(c, "ui")  // a repository that does not exist yet has one too
        try write(c, "ui", "k", 1...2)
        let subscribed = try c.call(["op": "subscribe", "repo": "ui"])
        let repos = try c.call(["op": "repos"])["repos"]?.arrayValue?.first?.objectValue
        let listed = try epoch(c, "ui")
        #expect(subscribed["epoch"]?.stringValue == listed && repos?["epoch"]?.stringValue == listed)
        #expect(listed == before, "creating the repository keeps the epoch it was reported with at revision 0")
        #expect(listed.utf8.count >= 1 && listed.utf8.count <= 64)
    }

    @Test func anInMemoryDaemonThatRestartedIsAnotherHistory() async throws {
        // The case from the review: rev 5 of one history, rev 7 of the next.
        let d = try await TestDaemon.start(inMemory: true)
        var c = try d.connect()
        try write(c, "r", "k", 1...5)
        let seen = try epoch(c, "r")
        #expect(await d.stop() == 0)
        try await d.launch()
        c = try d.connect()
        try write(c, "r", "other", 1...7)
        let resumed = try c.call(["op": "subscribe", "repo": "r", "since": 5, "epoch": .string(seen)])
        #expect(resumed.errorCode == "compacted", "\(resumed)")
        #expect(resumed["error"]?.objectValue?["message"]?.stringValue?.contains("initial: true") == true)
        // The new history's own epoch resumes as usual.
        let current = try epoch(c, "r")
        #expect(current != seen)
        let ok = try c.call(["op": "subscribe", "repo": "r", "since": 5, "epoch": .string(current)])
        #expect(ok.ok && ok["epoch"]?.stringValue == current)
        #expect(try c.receive()["rev"] == 6)
        #expect(try c.receive()["rev"] == 7)
        #expect(try c.receive()["event"] == "synced")
    }

    @Test func aDurableDaemonKeepsItsEpochAcrossRestartsAndKills() async throws {
        let d = try await TestDaemon.start()
        var c = try d.connect()
        try write(c, "r", "k", 1...3)
        let seen = try epoch(c, "r")
        #expect(await d.stop() == 0)
        try await d.launch()
        c = try d.connect()
        #expect(try epoch(c, "r") == seen, "a graceful restart keeps the history")
        try write(c, "r", "k", 4...4)
        d.kill9()
        try await d.launch()
        c = try d.connect()
        #expect(try epoch(c, "r") == seen, "sync = always: a crash loses nothing acknowledged")
        let resumed = try c.call(["op": "subscribe", "repo": "r", "since": 2, "epoch": .string(seen)])
        #expect(resumed.ok)
        #expect(try c.receive()["rev"] == 3)
        #expect(try c.receive()["rev"] == 4)
        #expect(try c.receive()["event"] == "synced")
    }

    @Test func aRestoredBackupOrANewDataDirectoryIsAnotherHistoryButAMovedOneIsNot() async throws {
        let d = try await TestDaemon.start()
        let data = try #require(d.dataDirectory)
        let backup = d.directory + "/backup"
        var c = try d.connect()
        try write(c, "r", "k", 1...5)
        #expect(await d.stop() == 0)
        #expect(try run("/bin/cp", ["-a", data, backup]).status == 0)  // a backup at revision 5
        try await d.launch()
        c = try d.connect()
        try write(c, "r", "k", 6...8)
        let seen = try epoch(c, "r")  // a client saw revision 8 of this history

        // The backup is restored; the daemon goes on writing revisions 6–8 of another history.
        #expect(await d.stop() == 0)
        #expect(try run("/bin/rm", ["-rf", data]).status == 0)
        #expect(try run("/bin/cp", ["-a", backup, data]).status == 0)
        try await d.launch()
        c = try d.connect()
        try write(c, "r", "k", 60...62)
        let restored = try epoch(c, "r")
        #expect(restored != seen)
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 8, "epoch": .string(seen)]).errorCode == "compacted")
        #expect(d.log.contains("every repository starts a new epoch") && d.log.contains("a restored backup"))

        // Moving the directory (a rename keeps the file) is the same history.
        #expect(await d.stop() == 0)
        #expect(rename(data, data + ".moved") == 0 && rename(data + ".moved", data) == 0)
        try await d.launch()
        #expect(try epoch(try d.connect(), "r") == restored)

        // An empty data directory is a new history of every repository.
        #expect(await d.stop() == 0)
        #expect(try run("/bin/rm", ["-rf", data]).status == 0)
        try await d.launch()
        c = try d.connect()
        try write(c, "r", "k", 1...8)
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 8, "epoch": .string(restored)]).errorCode == "compacted")
    }

    @Test func anUncleanStopUnderRelaxedSyncKeepsTheEpochUntilTheMachineRestarted() async throws {
        let d = try await TestDaemon.start(["--sync", "relaxed"])
        var c = try d.connect()
        try write(c, "r", "k", 1...3)
        let seen = try epoch(c, "r")
        d.kill9()
        try await d.launch()
        c = try d.connect()
        #expect(try epoch(c, "r") == seen, "the same boot: the page cache kept every write(2)")
        d.kill9()
        // As the next boot finds it: the marker names a boot that is over.
        let marker = try #require(d.dataDirectory) + "/obsd.run"
        #expect(try String(contentsOfFile: marker, encoding: .utf8).hasPrefix("running "), "a daemon killed leaves its marker")
        try "running 00000000-dead-beef relaxed\n".write(toFile: marker, atomically: false, encoding: .utf8)
        try await d.launch()
        c = try d.connect()
        #expect(try epoch(c, "r") != seen, "writes of the last sync interval may be gone: another history")
        #expect(d.log.contains("stopped uncleanly under sync = relaxed"))
        #expect(try c.call(["op": "get", "repo": "r", "key": "k"])["value"] == 3, "the data itself is kept")
    }

    @Test func aBogusOrIllTypedEpoch() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        try write(c, "r", "k", 1...2)
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 1, "epoch": "no-such-epoch"]).errorCode == "compacted")
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 1, "epoch": ""]).errorCode == "compacted")
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 1, "epoch": 7]).errorCode == "bad_request")
        // Without since, epoch means nothing and is not read.
        let plain = try c.call(["op": "subscribe", "repo": "r", "epoch": 7])
        #expect(plain.ok && plain["rev"] == 2)
        // Without epoch, since keeps its version-1 meaning.
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 1]).ok)
    }

    @Test func aVersionOneDatabaseGetsEpochsAndKeepsItsData() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        let data = dir + "/data"
        mkdir(data, 0o700)
        let script = """
            import sqlite3,sys
            c=sqlite3.connect(sys.argv[1])
            c.executescript('''
            PRAGMA application_id = 1868723044; PRAGMA user_version = 1;
            CREATE TABLE repos (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, rev INTEGER NOT NULL);
            CREATE TABLE entries (repo INTEGER NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL, rev INTEGER NOT NULL, PRIMARY KEY (repo, key)) WITHOUT ROWID;
            CREATE TABLE history (repo INTEGER NOT NULL, rev INTEGER NOT NULL, time INTEGER NOT NULL, changes BLOB NOT NULL, PRIMARY KEY (repo, rev)) WITHOUT ROWID;
            CREATE INDEX history_time ON history (time);
            INSERT INTO repos VALUES (1, 'old', 1);
            INSERT INTO entries VALUES (1, CAST('k' AS BLOB), CAST('"kept"' AS BLOB), 1);
            INSERT INTO history VALUES (1, 1, 1700000000, CAST('[{"key":"k","new":"kept"}]' AS BLOB));
            ''')
            c.commit()
            """
        #expect(try run("/usr/bin/env", ["python3", "-c", script, data + "/obsd.db"]).status == 0)
        let d = try await TestDaemon.start(directory: dir, dataDirectory: data)
        let c = try d.connect()
        #expect(try c.call(["op": "get", "repo": "old", "key": "k"])["value"] == "kept")
        let listed = try epoch(c, "old")
        #expect(!listed.isEmpty)
        let replay = try c.call(["op": "subscribe", "repo": "old", "since": 0, "epoch": .string(listed)])
        #expect(replay.ok)
        #expect(try c.receive()["changes"]?.arrayValue?.first?.objectValue?["new"] == "kept")
        #expect(d.log.contains("did not keep epochs"))
    }

    @Test func aVersionTwoDatabaseKeepsItsHistoryAndLearnsWriters() async throws {
        let dir = TestDaemon.makeTemporaryDirectory()
        let data = dir + "/data"
        mkdir(data, 0o700)
        let script = """
            import sqlite3,sys
            c=sqlite3.connect(sys.argv[1])
            c.executescript('''
            PRAGMA application_id = 1868723044; PRAGMA user_version = 2;
            CREATE TABLE repos (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, rev INTEGER NOT NULL, epoch TEXT NOT NULL);
            CREATE TABLE entries (repo INTEGER NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL, rev INTEGER NOT NULL, PRIMARY KEY (repo, key)) WITHOUT ROWID;
            CREATE TABLE history (repo INTEGER NOT NULL, rev INTEGER NOT NULL, time INTEGER NOT NULL, changes BLOB NOT NULL, PRIMARY KEY (repo, rev)) WITHOUT ROWID;
            CREATE INDEX history_time ON history (time);
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
            INSERT INTO repos VALUES (1, 'v2', 1, '0123456789abcdef0123456789abcdef');
            INSERT INTO entries VALUES (1, CAST('k' AS BLOB), CAST('"kept"' AS BLOB), 1);
            INSERT INTO history VALUES (1, 1, 1700000000, CAST('[{"key":"k","new":"kept"}]' AS BLOB));
            ''')
            c.commit()
            """
        #expect(try run("/usr/bin/env", ["python3", "-c", script, data + "/obsd.db"]).status == 0)
        let d = try await TestDaemon.start(directory: dir, dataDirectory: data)
        let c = try d.connect()
        #expect(try c.call(["op": "get", "repo": "v2", "key": "k"])["value"] == "kept")
        let listed = try epoch(c, "v2")
        #expect(try c.call(["op": "subscribe", "repo": "v2", "since": 0, "epoch": .string(listed), "writers": true]).ok)
        let replayed = try c.receive()
        #expect(replayed["rev"] == 1 && replayed["by"] == nil, "a revision stored without its writer has no by: \(replayed)")
        #expect(try c.receive()["event"] == "synced")
        _ = try d.connect().call(["op": "set", "repo": "v2", "key": "k", "value": "new"])
        #expect(try c.receive()["by"] != nil, "new revisions name their writer")
    }

    @Test func aWatchOfTheClientLibraryResyncsWhenTheHistoryWasReplaced() async throws {
        let d = try await TestDaemon.start()
        let data = try #require(d.dataDirectory)
        try await writeNumbered("r", 1...3, socket: d.socketPath)
        #expect(await d.stop() == 0)
        #expect(try run("/bin/cp", ["-a", data, d.directory + "/backup"]).status == 0)
        try await d.launch()
        let session = ObsSession(socketPath: d.socketPath, backoff: Backoff(initial: .milliseconds(100), maximum: .milliseconds(200)))
        var events = session.watch("r", since: 3).makeAsyncIterator()
        try await writeNumbered("r", 4...6, socket: d.socketPath)
        try await expectChanges(&events, 4...6)
        let seen = try #require(events.epoch)

        // The backup comes back and is written past revision 6: same numbers, other values.
        #expect(await d.stop() == 0)
        #expect(try run("/bin/rm", ["-rf", data]).status == 0)
        #expect(try run("/bin/cp", ["-a", d.directory + "/backup", data]).status == 0)
        try await d.launch()
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in
            for i in 1...4 { _ = try await client.set("n", to: .int(Int64(100 + i)), in: "r") }
        }
        guard case .snapshot(var revision, var values, resync: true) = try await events.next() else {
            throw TestFailure("expected a resync snapshot, not a replay of another history")
        }
        while revision < 7 {  // resynced before every write landed: the rest follow as changes
            guard case .change(let changes) = try await events.next() else { throw TestFailure("expected a change") }
            for change in changes.changes { values[change.key] = change.new }
            revision = changes.revision
        }
        // The restored history: revisions 1–3 (k1–k3) and the four writes of n; nothing of 4–6.
        #expect(values == ["k1": 1, "k2": 2, "k3": 3, "n": 104], "the replaced history's keys, not a mix of both")
        #expect(events.epoch != nil && events.epoch != seen)
        await session.close()
    }

    @Test func obsctlWatchResumesWithTheEpochItPrinted() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let s = d.socketPath
        _ = try obsctl(["set", "ui", "a", "1"], socket: s)
        _ = try obsctl(["set", "ui", "a", "2"], socket: s)
        let json = try obsctl(["watch", "ui", "--since", "0", "--json"], socket: s, stopAfterLines: 3)
        let lines = json.stdout.split(separator: "\n").map { try? JSONParser.parse(String($0)).objectValue }
        let epoch = try #require(lines.last??["epoch"]?.stringValue)
        #expect(lines.count == 3 && lines.allSatisfy { $0?["epoch"]?.stringValue == epoch })

        let resumed = try obsctl(["watch", "ui", "--since", "1", "--epoch", epoch, "--json"], socket: s, stopAfterLines: 2)
        #expect(resumed.stdout.split(separator: "\n").first?.contains(#""rev":2"#) == true)

        #expect(await d.stop() == 0)
        try await d.launch()
        _ = try obsctl(["set", "ui", "a", "3"], socket: s)
        _ = try obsctl(["set", "ui", "a", "4"], socket: s)
        let stale = try obsctl(["watch", "ui", "--since", "1", "--epoch", epoch, "--strict"], socket: s)
        #expect(stale.status == 4)
        #expect(stale.stderr.contains("compacted") || stale.stderr.contains("initial"), "\(stale.stderr)")
        // Without --strict a resume never fails: another history's values come as a reset.
        let reset = try obsctl(["watch", "ui", "--since", "1", "--epoch", epoch, "--json"], socket: s, stopAfterLines: 2)
        let resetLines = reset.stdout.split(separator: "\n").map { try? JSONParser.parse(String($0)).objectValue }
        let current = try #require(resetLines.first??["epoch"]?.stringValue)
        #expect(current != epoch)
        #expect(reset.stdout == #"{"repo":"ui","rev":2,"reset":true,"values":{"a":4},"epoch":"\#(current)"}"# + "\n"
            + #"{"repo":"ui","rev":2,"synced":true,"epoch":"\#(current)"}"# + "\n")
        #expect(try obsctl(["watch", "ui", "--epoch", epoch], socket: s).status == 64, "--epoch without --since")
    }
}
