// ObsEtcdTests: etcd's leases through the client, on a real 3-member cluster — grant,
// keys attached by a put, keep-alive, time-to-live, revoke and expiry, each end deleting the
// attached keys in one revision that a watch sees. (In EtcdClientTests, so that it runs with
// the other cluster tests, alone: Makefile `ALONE_SUITES`.)

import ObsEtcd
import Testing
import TestSupport

extension EtcdClientTests {
    @Test func aLeasesEndDeletesItsKeysInOneRevisionWhetherRevokedOrExpired() async throws {
        let cluster = try await EtcdCluster.started()
        let client = try cluster.client()
        let watcher = try cluster.client([2])
        defer { Task { await client.shutdown(); await watcher.shutdown() } }

        let revoked = try await client.leaseGrant(ttl: 30)
        #expect(revoked.id != 0 && revoked.ttl == 30)
        let start = try await client.put(bytes("/l/other"), bytes("x")).revision
        let attach = try await client.txn(success: [
            .put(key: bytes("/l/a"), value: bytes("1"), lease: revoked.id), .put(key: bytes("/l/b"), value: bytes("2"), lease: revoked.id),
        ])
        #expect(attach.succeeded)
        let read = try await client.range(bytes("/l/a"))
        #expect(read.kvs.first?.lease == revoked.id, "the key carries its lease")
        await #expect {
            _ = try await client.txn(success: [.put(key: bytes("/l/c"), value: bytes("3"), lease: 12345)])
        } throws: { ($0 as? EtcdError)?.isLeaseNotFound == true }

        #expect(try await client.leaseKeepAlive(revoked.id) == 30)
        let left = try #require(try await client.leaseTimeToLive(revoked.id))
        #expect(left.granted == 30 && left.remaining <= 30 && left.remaining >= 28)

        let recorder = WatchRecorder(watcher.watch(bytes("/l/"), rangeEnd: EtcdKey.prefixEnd(bytes("/l/")), startRevision: start + 1))
        #expect(try await client.leaseRevoke(revoked.id))
        #expect(await recorder.wait(forCount: 2), "no deletion seen: \(String(describing: recorder.error))")
        let deletion = recorder.responses[1]
        #expect(deletion.events.map(\.kind) == [.delete, .delete] && deletion.events.map { text($0.kv.key) }.sorted() == ["/l/a", "/l/b"])
        #expect(try await client.range(bytes("/l/other")).kvs.count == 1, "a key of no lease stays")
        #expect(try await client.leaseKeepAlive(revoked.id) == nil, "a revoked lease is gone")
        #expect(try await client.leaseRevoke(revoked.id) == false)
        #expect(try await client.leaseTimeToLive(revoked.id) == nil)

        // A TTL below etcd's minimum (1.5 election timeouts, rounded up: 2 s) is raised to it;
        // not kept alive, the lease expires and takes its key, never before its TTL.
        let short = try await client.leaseGrant(ttl: 1)
        let granted = ContinuousClock.now
        #expect(short.ttl == 2)
        _ = try await client.txn(success: [.put(key: bytes("/l/short"), value: bytes("s"), lease: short.id)])
        #expect(await recorder.wait(forCount: 4, timeout: .seconds(10)), "the key of an expired lease stayed")
        let elapsed = ContinuousClock.now - granted
        #expect(recorder.responses[3].events.map(\.kind) == [.delete] && elapsed >= .seconds(2), "expired after \(elapsed)")
        #expect(elapsed < .seconds(4), "etcd looks for expired leases every 500 ms: \(elapsed)")
    }
}
