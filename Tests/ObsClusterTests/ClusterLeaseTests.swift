// ObsClusterTests, leases across daemons (issue 21 item 2): two real obsd daemons on a real
// 3-member etcd cluster, driven over raw sockets (the events' `lease` member is the point).
// A connection-bound lease on A ends with its connection, when A stops, and — within the
// documented bound, the liveness TTL (5 s) plus about a second — when A is killed; a lease
// with a TTL is the cluster's: kept alive from B, honoured after A is gone; revoke and writes
// work from any daemon; every end is one revision per repository, whichever daemons race to
// make it, seen by every daemon's subscribers with `lease: {id, end}` and the grantor as `by`.
//
// Each test starts its own cluster and daemons (ClusterPair) and stops them by PID. Waits
// have deadlines; the only pauses are the keep-alives' own spacing in time.

import Foundation
import ObsEtcd
import ObsProtocol
import Testing
import TestSupport

/// The bound for a killed daemon's connection-bound leases (docs/PROTOCOL.md, README "Several
/// hosts"): its liveness lease's TTL, plus etcd's half-second expiry check and a commit — with
/// room for this busy 2-core machine.
private let killBound: Duration = .seconds(5) + .milliseconds(1500)

/// In ClusterTests: one test at a time, alone (their bounds are etcd's and obsd's).
extension ClusterTests {

    @Test func aConnectionBoundLeaseOnAEndsWithItsConnectionInOneRevisionSeenOnBothDaemons() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let watchers = try [pair.a, pair.b].map { try WireConnection(path: $0.socketPath) }
        for w in watchers { #expect(try w.call(["op": "subscribe", "repo": "svc", "writers": true]).ok) }
        let holder = try WireConnection(path: pair.a.socketPath)
        let grant = try holder.call(["op": "grant"])
        let lease = try #require(grant["lease"]?.uint64Value, "\(grant)\n\(pair.diagnostics)")
        #expect(lease == 1 && grant["ttl"] == nil, "ids are small and start at 1; no ttl asked, none given")
        let l = JSONValue.int(Int64(lease))
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "web/ready", "value": true, "lease": l])["rev"] == 1)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "api/ready", "value": true, "lease": l])["rev"] == 2)
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "other", "value": 1])["rev"] == 3)
        let onB = try WireConnection(path: pair.b.socketPath)
        #expect(try onB.call(["op": "get", "repo": "svc", "key": "web/ready"])["lease"] == l, "B knows A's attachment")
        #expect(try onB.call(["op": "get", "repo": "svc", "key": "other"])["lease"] == nil)
        #expect(try onB.call(["op": "stats"])["leases"] == 1, "stats counts every daemon's leases")
        for w in watchers { for rev in 1...3 { #expect(try w.receive()["rev"] == .int(Int64(rev))) } }

        holder.close()
        for (name, w) in zip(["A", "B"], watchers) {
            let end = try w.receive(timeout: .seconds(10))
            #expect(end["rev"] == 4 && end["lease"] == ["id": l, "end": "closed"], "\(name): \(end)")
            #expect(end["changes"] == [["key": "api/ready", "old": true], ["key": "web/ready", "old": true]], "one revision, keys in byte order")
            #expect(end["by"]?.objectValue?["pid"] == .int(Int64(getpid())), "\(name): the grantor's credentials")
        }
        // Ended everywhere: naming it is not_found on both daemons.
        let onA = try WireConnection(path: pair.a.socketPath)
        for c in [onA, onB] {
            #expect(try c.call(["op": "keepalive", "lease": l]).errorCode == "not_found")
            #expect(try c.call(["op": "revoke", "lease": l]).errorCode == "not_found")
            #expect(try c.call(["op": "set", "repo": "svc", "key": "x", "value": 1, "lease": l]).errorCode == "not_found")
        }
        // Both daemons set out to delete the keys; one revision did it: the next is a plain write.
        #expect(try onB.call(["op": "set", "repo": "svc", "key": "marker", "value": 1])["rev"] == 5)
        for w in watchers {
            let next = try w.receive()
            #expect(next["rev"] == 5 && next["lease"] == nil, "\(next)")
        }
        #expect(try onA.call(["op": "stats"])["leases"] == 0)
    }

    @Test func twoDaemonsRacingToDeleteTheKeysOfManyLeasesMakeOneRevisionPerLeaseAndRepository() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let repos = ["r1", "r2", "r3"]
        let watcher = try WireConnection(path: pair.b.socketPath)
        for repo in repos { #expect(try watcher.call(["op": "subscribe", "repo": .string(repo)]).ok) }
        // Ten holders, half on each daemon, each with a key in every repository.
        var holders: [WireConnection] = []
        for i in 0..<10 {
            let holder = try WireConnection(path: (i.isMultiple(of: 2) ? pair.a : pair.b).socketPath)
            let lease = try #require(try holder.call(["op": "grant"])["lease"], "\(pair.diagnostics)")
            for repo in repos { #expect(try holder.call(["op": "set", "repo": .string(repo), "key": .string("k\(i)"), "value": 1, "lease": lease]).ok) }
            holders.append(holder)
        }
        for _ in 0..<30 { #expect(try watcher.receive()["lease"] == nil) }
        for holder in holders { holder.close() }
        var ends: [String: [UInt64]] = [:]
        for _ in 0..<30 {
            let event = try watcher.receive(timeout: .seconds(10))
            #expect(event["changes"]?.arrayValue?.count == 1 && event["lease"]?.objectValue?["end"] == "closed", "\(event)")
            ends[event["repo"]?.stringValue ?? "", default: []].append(event["lease"]?.objectValue?["id"]?.uint64Value ?? 0)
        }
        for repo in repos { #expect(Set(ends[repo] ?? []).count == 10 && ends[repo]?.count == 10, "\(repo): \(ends[repo] ?? [])") }
        // Nothing more: every repository is at 10 writes + 10 deletions, on both daemons.
        for daemon in [pair.a, pair.b] {
            let c = try WireConnection(path: daemon.socketPath)
            #expect(try c.call(["op": "repos"])["repos"]?.arrayValue?.map { $0.objectValue?["rev"] } == [20, 20, 20])
        }
    }

    @Test func aDaemonKilledWithSigkillLosesItsConnectionBoundKeysOnTheOtherDaemonWithinTheBound() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let (watcher, holder, bound) = try holdOnA(pair)
        let timed = try #require(try holder.call(["op": "grant", "ttl": 60])["lease"])
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "a/job", "value": 1, "lease": timed])["rev"] == 2)
        #expect(try watcher.receive()["rev"] == 2)

        let killed = ContinuousClock.now
        pair.a.kill9()
        let end = try watcher.receive(timeout: .seconds(20))
        let elapsed = ContinuousClock.now - killed
        #expect(end["rev"] == 3 && end["lease"] == ["id": bound, "end": "closed"] && end["changes"] == [["key": "a/up", "old": true]], "\(end)")
        #expect(elapsed <= killBound, "A's keys went \(elapsed) after its SIGKILL; the documented bound is 5 s + about 1 s")
        print("ClusterTests: A's connection-bound keys deleted on B \(elapsed) after A's SIGKILL")
        // The lease with a TTL is the cluster's, not A's: it lives on, and B may keep it alive.
        let onB = try WireConnection(path: pair.b.socketPath)
        #expect(try onB.call(["op": "keepalive", "lease": timed])["ttl"] == 60)
        #expect(try onB.call(["op": "get", "repo": "svc", "key": "a/job"])["lease"] == timed)
        #expect(try onB.call(["op": "set", "repo": "svc", "key": "b/x", "value": 1, "lease": bound]).errorCode == "not_found")
    }

    @Test func aDaemonStoppedGracefullyEndsItsConnectionBoundLeasesAtOnce() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let (watcher, _, bound) = try holdOnA(pair)
        let stopping = ContinuousClock.now
        pair.a.stop()
        let end = try watcher.receive(timeout: .seconds(10))
        #expect(end["lease"] == ["id": bound, "end": "closed"], "\(end)")
        #expect(ContinuousClock.now - stopping < .seconds(3), "a stopping daemon revokes its liveness lease: no TTL to wait out")
    }

    @Test func aDaemonCutOffFromEtcdStopsVouchingForItsConnectionBoundLeasesAndTheirKeysGoOnceEtcdIsBack() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let (_, holder, bound) = try holdOnA(pair)

        // No quorum: neither the daemon nor etcd can end the lease, and the daemon no longer
        // knows what etcd will do — within its liveness TTL it stops serving the lease as live:
        // the connection holding it closes, and the lease is not_found on that daemon.
        pair.etcd.stop(1)
        pair.etcd.stop(2)
        let cut = ContinuousClock.now
        #expect(try holder.receiveLine(timeout: .seconds(15)) == nil, "the holder's connection closes")
        let closedAfter = ContinuousClock.now - cut
        // etcd's leader answers keep-alives alone until it notices it lost its quorum (one
        // election timeout, 1 s): the TTL counts from the last answer.
        #expect(closedAfter <= killBound + .seconds(1), "closed \(closedAfter) after the quorum went")
        print("ClusterTests: without etcd, A closed the connection holding a connection-bound lease after \(closedAfter)")
        let onA = try WireConnection(path: pair.a.socketPath)
        #expect(try onA.call(["op": "keepalive", "lease": bound]).errorCode == "not_found")

        // Back: etcd ends it too (the daemon revokes the liveness lease it lost), and the key goes.
        try pair.etcd.restart(1)
        try pair.etcd.restart(2)
        #expect(await pair.etcd.waitHealthy(timeout: .seconds(30)), "\(pair.etcd.diagnostics())")
        let watcher = try WireConnection(path: pair.b.socketPath)
        #expect(try watcher.call(["op": "subscribe", "repo": "svc", "since": 1], timeout: .seconds(20)).ok)
        var end = try watcher.receive(timeout: .seconds(20))
        if end["event"] == "synced" { end = try watcher.receive(timeout: .seconds(20)) }
        #expect(end["rev"] == 2 && end["lease"] == ["id": bound, "end": "closed"], "\(end)\n\(pair.diagnostics)")
    }

    @Test func aTTLLeaseGrantedOnAIsKeptAliveFromBAndExpiresOnTheClusterAfterADies() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let watcher = try WireConnection(path: pair.b.socketPath)
        #expect(try watcher.call(["op": "subscribe", "repo": "jobs", "writers": true]).ok)
        let granter = try WireConnection(path: pair.a.socketPath)
        let grant = try granter.call(["op": "grant", "ttl": 3])
        let lease = try #require(grant["lease"], "\(grant)\n\(pair.diagnostics)")
        #expect(grant["ttl"] == 3)
        #expect(try granter.call(["op": "set", "repo": "jobs", "key": "j1", "value": "running", "lease": lease])["rev"] == 1)
        #expect(try watcher.receive()["rev"] == 1)
        pair.a.kill9()

        // Kept alive from B, it outlives A and its own TTL (six keep-alives over five seconds).
        let keeper = try WireConnection(path: pair.b.socketPath)
        var lastSent = ContinuousClock.now
        var lastAnswered = ContinuousClock.now
        for i in 0..<6 {
            if i > 0 { try await Task.sleep(for: .seconds(1)) }
            lastSent = .now
            #expect(try keeper.call(["op": "keepalive", "lease": lease])["ttl"] == 3)
            lastAnswered = .now
        }
        #expect(try keeper.call(["op": "get", "repo": "jobs", "key": "j1"])["value"] == "running", "kept alive from B")
        // Left alone, the cluster ends it, never before its TTL. (How soon after is printed, not
        // bounded: a wall-clock upper bound measures the machine's load, not the daemon.)
        let end = try watcher.receive(timeout: .seconds(15))
        let ended = ContinuousClock.now
        #expect(end["rev"] == 2 && end["lease"] == ["id": lease, "end": "expired"] && end["by"]?.objectValue?["pid"] == .int(Int64(getpid())), "\(end)")
        #expect(ended - lastSent >= .seconds(3), "ended \(ended - lastSent) after its last keep-alive")
        print("ClusterTests: TTL 3 s lease ended \(ended - lastAnswered) after its last keep-alive's answer")
        #expect(try keeper.call(["op": "keepalive", "lease": lease]).errorCode == "not_found")
        #expect(try keeper.call(["op": "set", "repo": "jobs", "key": "j2", "value": 1, "lease": lease]).errorCode == "not_found")
    }

    @Test func aLeaseThatExpiredWhileNoDaemonRanHasItsKeysDeletedByTheNextDaemonToStart() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let etcd = try pair.etcdClient()
        defer { Task { await etcd.shutdown() } }
        let c = try WireConnection(path: pair.a.socketPath)
        let lease = try #require(try c.call(["op": "grant", "ttl": 2])["lease"], "\(pair.diagnostics)")
        #expect(try c.call(["op": "set", "repo": "jobs", "key": "j", "value": 1, "lease": lease])["rev"] == 1)
        pair.a.kill9()
        pair.b.kill9()
        // etcd ends the lease with no daemon to see it: its alive key goes, its record stays.
        func keys(_ section: String) async -> Int? {
            let prefix = Array((pair.prefix + section).utf8)
            return try? await etcd.range(prefix, rangeEnd: EtcdKey.prefixEnd(prefix)).kvs.count
        }
        #expect(await eventually(timeout: .seconds(15)) { () async -> Bool in await keys("alive/") == 0 })
        #expect(await keys("lease/") == 1)

        try await pair.a.launch()
        let watcher = try WireConnection(path: pair.a.socketPath)
        #expect(try watcher.call(["op": "subscribe", "repo": "jobs", "since": 1]).ok)
        var end = try watcher.receive()
        if end["event"] == "synced" { end = try watcher.receive() }
        #expect(end["rev"] == 2 && end["lease"] == ["id": lease, "end": "expired"], "\(end)\n\(pair.diagnostics)")
        // Its keys deleted, the lease is forgotten.
        #expect(await eventually(timeout: .seconds(10)) { () async -> Bool in await keys("lease/") == 0 })
        #expect(try watcher.call(["op": "keepalive", "lease": lease]).errorCode == "not_found")
    }

    @Test func revokeFromBOfALeaseGrantedOnAEndsItAtOnceAndAnEqualSetOnBMovedAnAttachment() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let onA = try WireConnection(path: pair.a.socketPath)
        let onB = try WireConnection(path: pair.b.socketPath)
        #expect(try onA.call(["op": "subscribe", "repo": "b", "writers": true]).ok)
        let lease = try #require(try onA.call(["op": "grant", "ttl": 60])["lease"], "\(pair.diagnostics)")
        // B names it at once (it may not have seen the grant yet: then it asks etcd).
        #expect(try onB.call(["op": "set", "repo": "a", "key": "x", "value": 1, "lease": lease])["rev"] == 1)
        #expect(try onA.call(["op": "set", "repo": "b", "key": "y", "value": 1, "lease": lease])["rev"] == 1)
        #expect(try onA.call(["op": "set", "repo": "b", "key": "z", "value": 1])["rev"] == 2)
        #expect(try onA.call(["op": "set", "repo": "b", "key": "kept", "value": true, "lease": lease])["rev"] == 3)
        // An equal value without a lease: no revision, but the key no longer belongs to the lease.
        let again = try onB.call(["op": "set", "repo": "b", "key": "kept", "value": true])
        #expect(again["changed"] == false && again["rev"] == 3, "\(again)")
        #expect(try onA.call(["op": "get", "repo": "b", "key": "kept"])["lease"] == nil, "A sees the attachment B moved")
        for rev in 1...3 { #expect(try onA.receive()["rev"] == .int(Int64(rev))) }

        #expect(try onB.call(["op": "revoke", "lease": lease])["revs"] == ["a": 2, "b": 4])
        let end = try onA.receive()
        #expect(end["rev"] == 4 && end["changes"] == [["key": "y", "old": 1]] && end["lease"] == ["id": lease, "end": "revoked"], "\(end)")
        #expect(end["by"]?.objectValue?["pid"] == .int(Int64(getpid())))
        #expect(try onA.call(["op": "list", "repo": "b"])["keys"] == ["kept", "z"])
        for c in [onA, onB] {
            #expect(try c.call(["op": "keepalive", "lease": lease]).errorCode == "not_found")
            #expect(try c.call(["op": "revoke", "lease": lease]).errorCode == "not_found")
            #expect(try c.call(["op": "set", "repo": "b", "key": "y", "value": 2, "lease": lease]).errorCode == "not_found")
        }
        // A revoke of a lease that held nothing answers at once, with no revision.
        let empty = try #require(try onB.call(["op": "grant"])["lease"])
        #expect(try onA.call(["op": "revoke", "lease": empty])["revs"] == [:])
    }

    @Test func thePerUIDLeaseLimitCountsEveryDaemonsLeases() async throws {
        let pair = try await ClusterPair.start(extra: ["--max-leases-per-uid", "2"])
        defer { pair.stop() }
        let onA = try WireConnection(path: pair.a.socketPath)
        let onB = try WireConnection(path: pair.b.socketPath)
        let bound = try #require(try onA.call(["op": "grant"])["lease"], "\(pair.diagnostics)")
        let timed = try #require(try onB.call(["op": "grant", "ttl": 60])["lease"])
        // One lease on each daemon: this uid is at its limit on both.
        for c in [onA, onB] {
            let refused = try c.call(["op": "grant", "ttl": 60])
            #expect(refused.errorCode == "overloaded", "\(refused)")
        }
        // A revoke on A of B's lease frees a place, on either daemon.
        #expect(try onA.call(["op": "revoke", "lease": timed]).ok)
        let again = try #require(try onB.call(["op": "grant", "ttl": 60])["lease"], "\(pair.diagnostics)")
        #expect(try onA.call(["op": "grant"]).errorCode == "overloaded")
        // So does a connection-bound lease's end with its connection.
        onA.close()
        let onA2 = try WireConnection(path: pair.a.socketPath)
        #expect(await eventually(timeout: .seconds(10)) { () async -> Bool in
            (try? onA2.call(["op": "keepalive", "lease": bound]).errorCode) == "not_found"
        })
        #expect(try onA2.call(["op": "grant", "ttl": 60])["lease"] != nil)
        #expect(try onB.call(["op": "revoke", "lease": again]).ok)
    }
}

/// A subscriber to `svc` on B, and a connection on A holding `svc/a/up` on a connection-bound
/// lease (revision 1, which the subscriber has seen).
private func holdOnA(_ pair: ClusterPair) throws -> (watcher: WireConnection, holder: WireConnection, lease: JSONValue) {
    let watcher = try WireConnection(path: pair.b.socketPath)
    #expect(try watcher.call(["op": "subscribe", "repo": "svc"]).ok)
    let holder = try WireConnection(path: pair.a.socketPath)
    guard let lease = try holder.call(["op": "grant"])["lease"] else { throw TestFailure("no lease granted:\n\(pair.diagnostics)") }
    #expect(try holder.call(["op": "set", "repo": "svc", "key": "a/up", "value": true, "lease": lease])["rev"] == 1)
    #expect(try watcher.receive()["rev"] == 1)
    return (watcher, holder, lease)
}
