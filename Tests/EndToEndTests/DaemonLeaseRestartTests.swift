// End-to-end, raw wire: two rules of the contract's leases across a restart of a durable
// daemon that obsd 0.3.0 (this branch's daemon) breaks. Found while testing the client's
// holds; the daemon is not this branch's to change, so each test states the rule and is
// wrapped in `withKnownIssue`: it passes while the daemon is wrong and fails — telling
// whoever fixes it to unwrap it — once the daemon is right.

import ObsProtocol
import Testing
import TestSupport

@Suite(.timeLimit(.minutes(3))) struct DaemonLeaseRestartTests {
    /// "Lease ids are never reused by a daemon for as long as its data persists."
    @Test func leaseIDsAreNotReusedAfterARestart() async throws {
        let d = try await TestDaemon.start()
        let c = try d.connect()
        let first = try #require(try c.call(["op": "grant"])["lease"]?.uint64Value)
        let timed = try #require(try c.call(["op": "grant", "ttl": 600])["lease"]?.uint64Value)
        c.close()
        await d.stop()
        try await d.launch()
        let after = try #require(try d.connect().call(["op": "grant"])["lease"]?.uint64Value)
        withKnownIssue("obsd reuses lease ids after a restart (the first grant answers 1 again)") {
            #expect(after > max(first, timed), "granted \(first) and \(timed) before the restart, \(after) after")
        }
    }

    /// "keys attached to connection-bound leases are deleted … with end: "closed", in revisions
    /// made before the daemon serves its first request, so a client that resumes with `since`
    /// sees those deletions" — and the event "carries lease {id, end}; so does the same event
    /// replayed with since".
    @Test func theRestartsDeletionOfConnectionBoundKeysSaysClosed() async throws {
        let d = try await TestDaemon.start()
        let holder = try d.connect()
        let lease = try #require(try holder.call(["op": "grant"])["lease"])
        #expect(try holder.call(["op": "set", "repo": "svc", "key": "up", "value": true, "lease": lease])["rev"] == 1)
        await d.stop()
        try await d.launch()
        let reader = try d.connect()
        #expect(try reader.call(["op": "subscribe", "repo": "svc", "since": 1]).ok)
        let deletion = try reader.receive()
        #expect(deletion["rev"] == 2 && deletion["changes"] == [["key": "up", "old": true]])
        withKnownIssue("the restart's deletion revision carries no \"lease\" member") {
            #expect(deletion["lease"] == ["id": lease, "end": "closed"])
        }
    }
}
