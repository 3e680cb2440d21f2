// ObsClusterTests, history: a daemon whose etcd watch resumes behind a compaction catches up
// from obsd's change log (or stops when the log no longer reaches back), and a wiped prefix
// stops every daemon, which restarted serve a new epoch.

import Foundation
import ObsClient
import ObsEtcd
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

extension ClusterTests {
    /// B talks to member 2 only. Cuts B off (member 2 stopped, then B frozen), has A write
    /// `writes` more revisions of `repo`, compacts etcd, brings member 2 back until it has
    /// applied the compaction, then lets B go on: its watch resumes behind the compaction.
    private func cutOffCompactAndReconnect(
        _ etcd: EtcdCluster, a: ObsConnection, b: ClusterDaemon, repo: String, writes: ClosedRange<Int>
    ) async throws {
        try await cutOffCompactAndReconnect(etcd, b: b) {
            for i in writes { try await a.set("n", to: int(i), in: repo) }
        }
    }

    /// The same, with what happens while B is cut off in `meanwhile`.
    func cutOffCompactAndReconnect(_ etcd: EtcdCluster, b: ClusterDaemon, meanwhile: () async throws -> Void) async throws {
        let client = try ClusterPair.etcdClient(etcd)
        defer { Task { await client.shutdown() } }
        etcd.stop(2)
        b.signal(SIGSTOP)
        try await meanwhile()
        let at = try await client.range(Array("/obsd-test/epoch".utf8)).revision
        _ = try await client.compact(at, physical: true)
        try etcd.restart(2)
        #expect(await etcd.waitHealthy(timeout: .seconds(30)), "\(etcd.diagnostics())")
        let caughtUp = await eventually(timeout: .seconds(20), every: .milliseconds(20)) { () async -> Bool in
            ((try? await client.status(endpoint: 2, timeout: .seconds(2)))?.revision ?? 0) >= at
        }
        #expect(caughtUp, "member 2 did not catch up with the compaction")
        b.signal(SIGCONT)
    }

    @Test func aWatchResumedBehindAnEtcdCompactionCatchesUpFromTheChangeLog() async throws {
        let pair = try await ClusterPair.start(bOnItsOwnMember: true)
        defer { pair.stop() }
        let (etcd, a, b) = (pair.etcd, pair.a, pair.b)
        let clientA = try await a.client()
        let clientB = try await b.client()
        let log = EventLog(try await clientB.subscribe(to: "c"))
        for i in 1...3 { try await clientA.set("n", to: int(i), in: "c") }
        #expect(await log.wait(forRevision: 3), "\(b.log.suffix(3000))")

        try await cutOffCompactAndReconnect(etcd, a: clientA, b: b, repo: "c", writes: 4...9)

        #expect(await log.wait(forRevision: 9, timeout: .seconds(30)), "\(b.log.suffix(3000))")
        #expect(b.log.contains("catching up from the change log"), "the watch did not resume behind the compaction")
        #expect(log.failure == nil)
        #expect(log.changes.map(\.revision) == Array(1...9))
        #expect(log.changes.map { $0.changes.first?.new } == (1...9).map { int($0) })
        #expect(try await clientB.set("n", to: int(10), in: "c").revision == 10)
    }

    @Test func aWatchResumedBehindACompactionAndBeyondTheChangeLogStopsTheDaemon() async throws {
        let pair = try await ClusterPair.start(extra: ["--history-limit", "3"], bOnItsOwnMember: true)
        defer { pair.stop() }
        let (etcd, a, b) = (pair.etcd, pair.a, pair.b)
        let clientA = try await a.client()
        let clientB = try await b.client()
        let log = EventLog(try await clientB.subscribe(to: "c"))
        try await clientA.set("n", to: int(1), in: "c")
        #expect(await log.wait(forRevision: 1))

        // Six revisions missed, three kept in the change log.
        try await cutOffCompactAndReconnect(etcd, a: clientA, b: b, repo: "c", writes: 2...7)

        let stopped = await eventually(timeout: .seconds(30)) { () async -> Bool in !b.isRunning }
        #expect(stopped, "\(b.log.suffix(3000))")
        #expect(b.exitCode.map { $0 != 0 } ?? false, "B's exit status: \(String(describing: b.exitCode))")
        #expect(b.log.contains("no longer holds them all"), "\(b.log.suffix(3000))")
        // Restarted, it reads the current state, in the same epoch.
        try await b.launch()
        let listing = try await b.client().list("c", includingValues: true)
        #expect(listing.revision == 7 && listing.values == ["n": int(7)])
        let epochA = try await clientA.list("c").epoch
        #expect(listing.epoch == epochA)
    }

    @Test func aWipedPrefixStopsEveryDaemonAndRestartedTheyServeANewEpoch() async throws {
        let pair = try await ClusterPair.start()
        defer { pair.stop() }
        let a = try await pair.a.client()
        for i in 1...2 { try await a.set("n", to: int(i), in: "w") }
        let epoch = try await a.list("w").epoch

        let client = try pair.etcdClient()
        defer { Task { await client.shutdown() } }
        let prefix = Array(pair.prefix.utf8)
        _ = try await client.delete(prefix, rangeEnd: EtcdKey.prefixEnd(prefix))

        for daemon in [pair.a, pair.b] {
            let stopped = await eventually(timeout: .seconds(20)) { () async -> Bool in !daemon.isRunning }
            #expect(stopped, "obsd \(daemon.name) still runs after the prefix was wiped:\n\(daemon.log.suffix(3000))")
            #expect(daemon.exitCode.map { $0 != 0 } ?? false)
            #expect(daemon.log.contains("was deleted or replaced"), "\(daemon.log.suffix(3000))")
        }
        try await pair.a.launch()
        try await pair.b.launch()
        let (newA, newB) = (try await pair.a.client(), try await pair.b.client())
        #expect(try await newA.repositories().isEmpty)
        #expect(try await newB.set("n", to: int(1), in: "w").revision == 1)
        let newEpoch = try await newA.list("w").epoch
        let newEpochB = try await newB.list("w").epoch
        #expect(newEpoch != epoch && newEpoch == newEpochB)
        let resume = await refusal { () async throws(ObsClientError) in try await newA.subscribe(to: "w", since: 1, epoch: epoch) }
        #expect(resume?.code == .compacted)
    }
}
