// Leases in process, on loops whose clock the test moves: a lease with a TTL ends at its
// deadline — never earlier, and as soon as the loop sees it due (well within the contract's
// second) — a keep-alive starts its TTL again in full, and the per-uid limit refuses `grant`
// with `overloaded` for an unprivileged peer.

import ObsProtocol
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct LeaseClockTests {
    @Test func aTTLLeaseEndsAtItsDeadlineNeverEarlierAndAKeepAliveStartsItAgain() throws {
        let server = try TestServer()
        let watcher = try TestConnection(server)
        try watcher.send(lines(#"{"id":1,"op":"subscribe","repo":"t"}"#))
        _ = try watcher.received()
        let owner = try TestConnection(server)
        try owner.send(lines(#"{"id":1,"op":"grant","ttl":2}"#))
        let lease = try #require(try owner.received().first?["lease"]?.uint64Value)
        try owner.send(lines(#"{"id":2,"op":"set","repo":"t","key":"k","value":1,"lease":\#(lease)}"#))
        #expect(try watcher.received().count == 1)

        server.advanceTime(by: .milliseconds(1500))
        try owner.send(lines(#"{"id":3,"op":"keepalive","lease":\#(lease)}"#))
        #expect(try owner.received().last?["ttl"] == 2)
        server.advanceTime(by: .milliseconds(1999))
        #expect(try watcher.received().isEmpty, "not before its TTL has passed since the keep-alive")
        server.advanceTime(by: .milliseconds(1))
        let end = try #require(try watcher.received().only)
        #expect(end["lease"] == ["id": .int(Int64(lease)), "end": "expired"])
        #expect(end["changes"] == [["key": "k", "old": 1]])
    }

    @Test func aPeerPastTheLeaseLimitIsOverloadedRootToo() throws {
        var limits = Limits.testing
        limits.maxLeasesPerUID = 2
        let server = try TestServer(limits: limits)
        let peer = Peer(uid: 4242, gid: 4242, pid: 1, daemonUID: 0)
        let client = try TestConnection(server, peer: peer)
        try client.send(lines(#"{"id":1,"op":"grant"}"#, #"{"id":2,"op":"grant","ttl":5}"#, #"{"id":3,"op":"grant"}"#))
        let replies = try client.received()
        #expect(replies.map(\.errorCode) == [nil, nil, "overloaded"])
        // Another uid's lease is forbidden to it.
        let root = try TestConnection(server)
        try root.send(lines(#"{"id":1,"op":"grant"}"#, #"{"id":2,"op":"grant"}"#, #"{"id":3,"op":"grant"}"#))
        let rootReplies = try root.received()
        #expect(rootReplies.map(\.errorCode) == [nil, nil, "overloaded"], "root's uid is bounded too")
        let rootLease = try #require(rootReplies.first?["lease"]?.uint64Value)
        let revoked = try #require(rootReplies[1]["lease"]?.uint64Value)
        // A lease that ended frees its place.
        try root.send(lines(#"{"id":4,"op":"revoke","lease":\#(revoked)}"#, #"{"id":5,"op":"grant"}"#))
        #expect(try root.received().map(\.errorCode) == [nil, nil])
        try client.send(lines(#"{"id":4,"op":"keepalive","lease":\#(rootLease)}"#, #"{"id":5,"op":"set","repo":"r","key":"k","value":1,"lease":\#(rootLease)}"#))
        #expect(try client.received().map(\.errorCode) == ["forbidden", "forbidden"])
    }
}
