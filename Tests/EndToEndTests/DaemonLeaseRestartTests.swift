// End-to-end, raw wire: leases across a restart of a durable daemon (the contract's "Across a
// restart of a daemon that persists") — after SIGTERM and after kill -9: ids never reused,
// TTL leases and their keys kept with their TTL started again in full, keys of
// connection-bound leases deleted with `end: "closed"` before the first request (and that
// event replayed with `since`), an equal-value `set`'s attachment kept, a revoke's deletion
// replayed with its lease member.

import Logging
import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct DaemonLeaseRestartTests {
    /// "Lease ids are never reused by a daemon for as long as its data persists."
    @Test(arguments: [false, true]) func leaseIDsAreNotReusedAfterARestart(kill: Bool) async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let first = try #require(try c.call(["op": "grant"])["lease"]?.uint64Value)
        let timed = try #require(try c.call(["op": "grant", "ttl": 600])["lease"]?.uint64Value)
        #expect(try c.call(["op": "revoke", "lease": .int(Int64(timed))]).ok)
        try await restart(d, kill: kill)
        let after = try #require(try d.connect().call(["op": "grant"])["lease"]?.uint64Value)
        #expect(after > max(first, timed), "granted \(first) and \(timed) before the restart, \(after) after")
    }

    /// Keys of connection-bound leases are deleted "with end: "closed", in revisions made
    /// before the daemon serves its first request, so a client that resumes with `since` sees
    /// those deletions" — and the event "carries lease {id, end}; so does the same event
    /// replayed with since".
    @Test(arguments: [false, true]) func theRestartsDeletionOfConnectionBoundKeysSaysClosed(kill: Bool) async throws {
        let d = try await TestDaemon.start()
        let holder = try d.connect()
        let lease = try #require(try holder.call(["op": "grant"])["lease"])
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "up", "value": true, "lease": lease])["rev"] == 1)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "plain", "value": 1])["rev"] == 2)
        try await restart(d, kill: kill)
        let reader = try d.connect()
        // The first request served already finds the key gone.
        #expect(try reader.call(["op": "get", "repo": "svc", "key": "up"]).errorCode == "not_found")
        #expect(try reader.call(["op": "subscribe", "repo": "svc", "since": 2]).ok)
        let deletion = try reader.receive()
        #expect(deletion["rev"] == 3 && deletion["changes"] == [["key": "up", "old": true]])
        #expect(deletion["lease"] == ["id": lease, "end": "closed"])
        #expect(try d.value("svc", "plain") == 1, "a key on no lease stays")
    }

    /// "leases with a TTL, and their keys, survive, each TTL starting again in full from the
    /// moment the daemon serves again" — attachments included, the one an equal-value set moved.
    @Test(arguments: [false, true]) func aTTLLeaseAndItsKeysSurviveAndExpireAfterTheirTTLAgain(kill: Bool) async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        // 5 s: the calls before the restart, and those after it before the keep-alive, come
        // before it expires however busy the machine.
        let lease = try #require(try c.call(["op": "grant", "ttl": 5])["lease"])
        #expect(try c.call(["op": "set", "repo": "jobs", "key": "a", "value": 1, "lease": lease])["rev"] == 1)
        #expect(try c.call(["op": "set", "repo": "jobs", "key": "b", "value": 2])["rev"] == 2)
        // An equal value: no revision, but the key now follows the lease.
        let equal = try c.call(["op": "set", "repo": "jobs", "key": "b", "value": 2, "lease": lease])
        #expect(equal["changed"] == false)
        try await restart(d, kill: kill)
        let w = try d.connect()
        #expect(try w.call(["op": "get", "repo": "jobs", "key": "a"])["lease"] == lease)
        #expect(try w.call(["op": "get", "repo": "jobs", "key": "b"])["lease"] == lease)
        // Taken before the keep-alive is sent: the daemon starts the TTL again after this.
        let kept = ContinuousClock.now
        #expect(try w.call(["op": "keepalive", "lease": lease])["ttl"] == 5, "the lease lives on")
        // "Not long after its TTL", measured by the daemon's own clock rather than a wall-clock
        // bound a busy machine breaks: a lease of the same TTL granted after the keep-alive
        // ends after it — a restored lease whose TTL ran longer than 5 s would end second.
        let control = try #require(try w.call(["op": "grant", "ttl": 5])["lease"])
        #expect(try w.call(["op": "set", "repo": "jobs", "key": "control", "value": 0, "lease": control])["rev"] == 3)
        #expect(try w.call(["op": "subscribe", "repo": "jobs"]).ok)
        let end = try w.receive(timeout: .seconds(60))
        let waited = ContinuousClock.now - kept
        #expect(end["changes"] == [["key": "a", "old": 1], ["key": "b", "old": 2]])
        #expect(end["lease"] == ["id": lease, "end": "expired"])
        #expect(waited >= .seconds(5), "expired \(waited) after its keep-alive, never earlier than its TTL")
        let controlEnd = try w.receive(timeout: .seconds(60))
        #expect(controlEnd["changes"] == [["key": "control", "old": 0]] && controlEnd["lease"] == ["id": control, "end": "expired"])
    }

    /// A revoke's deletion is replayed with its lease member after a restart (the log and the
    /// snapshot keep it).
    @Test func aLeasesEndIsReplayedWithItsLeaseMemberAfterARestart() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let lease = try #require(try c.call(["op": "grant", "ttl": 60])["lease"])
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 1, "lease": lease])["rev"] == 1)
        #expect(try c.call(["op": "revoke", "lease": lease])["revs"] == ["r": 2])
        try await restart(d, kill: false)
        let reader = try d.connect()
        #expect(try reader.call(["op": "subscribe", "repo": "r", "since": 1]).ok)
        let replayed = try reader.receive()
        #expect(replayed["rev"] == 2 && replayed["lease"] == ["id": lease, "end": "revoked"])
        #expect(try reader.call(["op": "revoke", "lease": lease]).errorCode == "not_found", "an ended lease stays ended")
    }

    /// A kill right after a lease's end was durable, before its deletion was made (or before
    /// that deletion was durable — or after storage failed it, the daemon undid it, and writes
    /// went on past it): the restart makes it, with the end's reason.
    @Test(arguments: [false, true]) func aDeletionAKillInterruptedIsMadeAtStartUp(writesAfter: Bool) async throws {
        let (d, lease, epoch, storage) = try await leasedKeyThenStopped()
        // What the log holds when a kill came between the end and its durable deletion.
        let table = FrameCounter()
        #expect(storage.append(.leaseEnded(id: lease, reason: writesAfter ? .expired : .revoked, owner: Writer(uid: 0, gid: 0, pid: 1)), sequence: 1, listener: table))
        if writesAfter {
            let other = RevisionRecord(
                repo: "r", changeSet: ChangeSet(revision: 3, changes: [Change(key: "other", old: CanonicalJSON(.int(2)), new: CanonicalJSON(.int(3)))]),
                time: 1_700_000_000, writer: nil)
            let repository = FrameCounter()
            #expect(storage.append(.revision(RevisionFrame(other, epoch: epoch)), sequence: 1, listener: repository))
        }
        storage.close()
        try await expectDeletionAtStartUp(d, lease, end: writesAfter ? "expired" : "revoked", revision: writesAfter ? 4 : 3)
        #expect(try d.connect().call(["op": "keepalive", "lease": .int(Int64(lease))]).errorCode == "not_found")
    }

    /// A stopped daemon whose repository `r` holds `k` (revision 1, attached to a lease with a
    /// TTL) and `other` (revision 2), its epoch, and its store, open for the test to add to.
    private func leasedKeyThenStopped() async throws -> (TestDaemon, lease: UInt64, epoch: String, DiskStorage) {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let lease = try #require(try c.call(["op": "grant", "ttl": 600])["lease"]?.uint64Value)
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 1, "lease": .int(Int64(lease))])["rev"] == 1)
        #expect(try c.call(["op": "set", "repo": "r", "key": "other", "value": 2])["rev"] == 2)
        let epoch = try #require(try c.call(["op": "list", "repo": "r"])["epoch"]?.stringValue)
        await d.stop()
        let storage = try DiskStorage(
            options: .init(directory: try #require(d.dataDirectory), sync: .always, historyLimit: 1000, historyMaxBytes: 64 << 20, historyMaxAge: nil),
            logger: Logger(label: "test"))
        return (d, lease, epoch, storage)
    }

    /// Starts `d` again and checks that its first revision, `revision`, deletes `k`, by
    /// `lease`'s `end`.
    private func expectDeletionAtStartUp(_ d: TestDaemon, _ lease: UInt64, end: String, revision: Int64) async throws {
        try await d.launch()
        let reader = try d.connect()
        #expect(try reader.call(["op": "subscribe", "repo": "r", "since": .int(revision - 1)]).ok)
        let deletion = try reader.receive()
        #expect(deletion["rev"] == .int(revision) && deletion["changes"] == [["key": "k", "old": 1]])
        #expect(deletion["lease"] == ["id": .int(Int64(lease)), "end": .string(end)])
        #expect(try d.value("r", "other") == (revision == 4 ? 3 : 2))
    }

    /// Numbers frames appended outside a daemon (the store reports to it; nothing listens).
    private final class FrameCounter: DurabilityListener {
        func durable(through sequence: UInt64) {}
        func failed(after sequence: UInt64, error: StorageError) {}
    }

    private func restart(_ d: TestDaemon, kill: Bool) async throws {
        if kill {
            d.kill9()
            _ = await d.waitForExit()
        } else {
            await d.stop()
        }
        try await d.launch()
    }
}
