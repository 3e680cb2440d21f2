// End-to-end: keys with a lifetime (the contract's leases), against the real obsd binary over
// raw sockets — grant, keepalive, revoke, writes that name a lease, a lease's end as one
// revision per repository carrying `lease: {id, end}`, `by` and `echo` for it, replay with
// `since`, and the per-uid limit. Waits for events have deadlines; TTL bounds are checked
// against the clock, with the contract's slack (never earlier, at most a second later).

import Foundation
import ObsProtocol
import TestSupport
import Testing

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct LeaseTests {
    @Test func aConnectionBoundLeaseEndsWithItsConnectionAndItsKeysGoInOneRevision() async throws {
        let d = try await TestDaemon.start()
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "svc", "writers": true]).ok)
        let holder = try d.connect()
        let grant = try holder.call(["op": "grant"])
        let lease = try #require(grant["lease"]?.uint64Value)
        #expect(lease >= 1 && grant["ttl"] == nil, "no ttl requested, none reported")
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "web/ready", "value": true, "lease": .int(Int64(lease))])["rev"] == 1)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "api/ready", "value": true, "lease": .int(Int64(lease))])["rev"] == 2)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "other", "value": 1])["rev"] == 3)
        let get = try holder.call(["op": "get", "repo": "svc", "key": "web/ready"])
        #expect(get["lease"]?.uint64Value == lease)
        #expect(try holder.call(["op": "get", "repo": "svc", "key": "other"])["lease"] == nil)
        for rev in 1...3 { #expect(try watcher.receive()["rev"] == .int(Int64(rev))) }

        holder.close()
        let end = try watcher.receive()
        #expect(end["event"] == "change" && end["rev"] == 4)
        #expect(end["changes"] == [["key": "api/ready", "old": true], ["key": "web/ready", "old": true]], "deletions in byte order of the keys")
        #expect(end["lease"] == ["id": .int(Int64(lease)), "end": "closed"])
        #expect(end["by"]?.objectValue?["pid"] != nil, "with writers: the grantor's credentials")
        let reader = try d.connect()
        #expect(try reader.call(["op": "get", "repo": "svc", "key": "web/ready"]).errorCode == "not_found")
        #expect(try reader.call(["op": "get", "repo": "svc", "key": "other"])["value"] == 1)
    }

    /// The real daemon's timer ends a lease with a TTL; the exact bounds (never earlier, at
    /// most a second later) and keep-alives are checked in process, with a clock the test
    /// moves (ObsServerTests' LeaseClockTests): here the timing would be the test machine's.
    @Test func aTTLLeaseExpiresUnlessKeptAlive() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "t"]).ok)
        let c = try d.connect()
        // 3 s: the three calls after the grant must come before it expires, however busy the
        // machine.
        let grant = try c.call(["op": "grant", "ttl": 3])
        let granted = ContinuousClock.now
        let lease = try #require(grant["lease"]?.uint64Value)
        #expect(grant["ttl"] == 3)
        #expect(try c.call(["op": "keepalive", "lease": .int(Int64(lease))])["ttl"] == 3)
        #expect(try c.call(["op": "set", "repo": "t", "key": "k", "value": 1, "lease": .int(Int64(lease))]).ok)
        #expect(try watcher.receive()["rev"] == 1)
        let end = try watcher.receive(timeout: .seconds(10))
        #expect(end["lease"] == ["id": .int(Int64(lease)), "end": "expired"])
        #expect(ContinuousClock.now - granted >= .milliseconds(2950), "not before its TTL")
        #expect(try c.call(["op": "keepalive", "lease": .int(Int64(lease))]).errorCode == "not_found")
        let untimed = try #require(try c.call(["op": "grant"])["lease"]?.uint64Value)
        let kept = try c.call(["op": "keepalive", "lease": .int(Int64(untimed))])
        #expect(kept.ok && kept["ttl"] == nil, "no ttl: none reported")
    }

    @Test func revokeEndsALeaseAtOnceAndReportsTheRevisionPerRepository() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let lease = try #require(try c.call(["op": "grant", "ttl": 60])["lease"]?.uint64Value)
        let l = JSONValue.int(Int64(lease))
        #expect(try c.call(["op": "set", "repo": "a", "key": "x", "value": 1, "lease": l]).ok)
        #expect(try c.call(["op": "set", "repo": "b", "key": "y", "value": 1, "lease": l]).ok)
        #expect(try c.call(["op": "set", "repo": "b", "key": "z", "value": 1]).ok)
        let revoked = try c.call(["op": "revoke", "lease": l])
        #expect(revoked["revs"] == ["a": 2, "b": 3])
        #expect(try c.call(["op": "list", "repo": "b"])["keys"] == ["z"])
        #expect(try c.call(["op": "revoke", "lease": l]).errorCode == "not_found")
        #expect(try c.call(["op": "keepalive", "lease": l]).errorCode == "not_found")
        #expect(try c.call(["op": "set", "repo": "a", "key": "x", "value": 2, "lease": l]).errorCode == "not_found")
        let empty = try #require(try c.call(["op": "grant"])["lease"])
        #expect(try c.call(["op": "revoke", "lease": empty])["revs"] == [:], "a lease that held nothing")
        // The deletion's event is in the history, with its lease member.
        let replay = try d.connect()
        #expect(try replay.call(["op": "subscribe", "repo": "a", "since": 1]).ok)
        let replayed = try replay.receive()
        #expect(replayed["rev"] == 2 && replayed["lease"] == ["id": l, "end": "revoked"])
        #expect(try replay.receive()["event"] == "synced")
    }

    @Test func theLastSetOfAKeyDecidesItsLeaseEvenWithAnEqualValueAndDeleteDetaches() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let owner = try d.connect()
        let lease = JSONValue.int(Int64(try #require(try owner.call(["op": "grant"])["lease"]?.uint64Value)))
        #expect(try owner.call(["op": "set", "repo": "r", "key": "kept", "value": 1, "lease": lease]).ok)
        #expect(try owner.call(["op": "set", "repo": "r", "key": "gone", "value": 1, "lease": lease]).ok)
        let again = try owner.call(["op": "set", "repo": "r", "key": "kept", "value": 1])
        #expect(again["changed"] == false && again["rev"] == 2, "an equal value: no revision, but the attachment follows")
        #expect(try owner.call(["op": "get", "repo": "r", "key": "kept"])["lease"] == nil)
        #expect(try owner.call(["op": "set", "repo": "r", "key": "deleted", "value": 1, "lease": lease]).ok)
        #expect(try owner.call(["op": "delete", "repo": "r", "key": "deleted"]).ok)
        #expect(try owner.call(["op": "set", "repo": "r", "key": "deleted", "value": 2]).ok)
        // A batch naming a lease that does not exist is refused whole.
        let refused = try owner.call(["op": "batch", "repo": "r", "ops": [
            ["op": "set", "key": "n1", "value": 1], ["op": "set", "key": "n2", "value": 1, "lease": 999_999],
        ]])
        #expect(refused.errorCode == "not_found")
        #expect(try owner.call(["op": "get", "repo": "r", "key": "n1"]).errorCode == "not_found")
        owner.close()
        let reader = try d.connect()
        // Wait for the lease's end (a revision), then look. The close may not have ended the
        // lease yet when the subscription starts: then `synced` comes first, the end after it.
        #expect(try reader.call(["op": "subscribe", "repo": "r", "since": 5]).ok)
        var end = try reader.receive()
        if end["event"] == "synced" { end = try reader.receive() }
        #expect(end["changes"] == [["key": "gone", "old": 1]])
        #expect(try reader.call(["op": "list", "repo": "r"])["keys"] == ["deleted", "kept"])
    }

    @Test func aLeasesEndIsWrittenByNoConnectionEchoFalseDoesNotSkipIt() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "subscribe", "repo": "r", "echo": false]).ok)
        let lease = JSONValue.int(Int64(try #require(try c.call(["op": "grant", "ttl": 30])["lease"]?.uint64Value)))
        #expect(try c.call(["op": "set", "repo": "r", "key": "k", "value": 1, "lease": lease]).ok)
        #expect(try c.call(["op": "revoke", "lease": lease]).ok)
        let end = try c.receive()
        #expect(end["rev"] == 2 && end["lease"] == ["id": lease, "end": "revoked"], "its own write (rev 1) skipped, the lease's end not")
    }

    /// An overflow cuts the connection off: its connection-bound leases end then, not when
    /// the client finally reads its last message or the grace period (an hour here) runs out.
    @Test func anOverflowEndsTheConnectionsLeasesAtOnce() async throws {
        let d = try await TestDaemon.start(["--queue-events", "100", "--queue-bytes", "65536", "--overflow-grace", "3600"], inMemory: true)
        let watcher = try d.connect()
        #expect(try watcher.call(["op": "subscribe", "repo": "svc"]).ok)
        let holder = try d.connect()
        let lease = JSONValue.int(Int64(try #require(try holder.call(["op": "grant"])["lease"]?.uint64Value)))
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "up", "value": true, "lease": lease]).ok)
        #expect(try watcher.receive()["rev"] == 1)
        #expect(try holder.call(["op": "subscribe", "repo": "flood"]).ok)
        // The holder reads nothing more: its socket buffer, then its queue, fill up.
        let writer = try d.connect()
        let big = JSONValue.string(String(repeating: "x", count: 4096))
        for i in 0..<1000 { #expect(try writer.call(["op": "set", "repo": "flood", "key": .string("k\(i)"), "value": big]).ok) }
        let end = try watcher.receive(timeout: .seconds(20))
        #expect(end["changes"] == [["key": "up", "old": true]])
        #expect(end["lease"] == ["id": lease, "end": "closed"])
        holder.close()
    }
}

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ProgressTests {
    @Test func aQuietSubscriptionIsToldTheRevisionItCanResumeFrom() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let watcher = try d.connect()
        let sub = try watcher.call(["op": "subscribe", "repo": "busy", "keys": ["quiet"], "progress": true, "since": 0])
        #expect(sub.ok)
        #expect(try watcher.receive()["event"] == "synced", "no progress before synced")
        let writer = try d.connect()
        for i in 1...20 { #expect(try writer.call(["op": "set", "repo": "busy", "key": "noisy", "value": .int(Int64(i))]).ok) }
        // Progress events come once a second while the repository moves: the last of them says
        // 20, and none says more than the repository's revision or less than an earlier one.
        var told: UInt64 = 0
        while told < 20 {
            let progress = try watcher.receive(timeout: .seconds(5))
            #expect(progress["event"] == "progress" && progress["sub"] == sub["sub"] && progress["repo"] == "busy")
            let rev = try #require(progress["rev"]?.uint64Value)
            #expect(rev > told && rev <= 20)
            told = rev
        }
        #expect(try writer.call(["op": "set", "repo": "busy", "key": "quiet", "value": 1])["rev"] == 21)
        let change = try watcher.receive()
        #expect(change["event"] == "change" && change["rev"] == 21, "nothing between: told 20, and 21 is its own change")
        // At most one a second, and none without the option: in process, with a clock the
        // test moves (ObsServerTests' ProgressClockTests).
    }
}
