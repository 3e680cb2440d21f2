// The daemon in etcd mode (a shared store decides revisions) without etcd: run in process on
// `FakeSharedStorage`, driven over its socket with the async client (the daemon's etcd path
// runs tasks on the cooperative pool: a blocking test client there could starve it). Defects
// found in review (issue 19): a write that changes nothing left a repository object behind
// for good, a changing write was counted twice, and a write whose outcome the store could not
// report — and that the store applied later — reached its own writer's `echo: false`
// subscription.

import ObsClient
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock) struct SharedModeTests {
    @Test func writesThatChangeNothingLeaveNoRepositoryBehind() async throws {
        let daemon = try await InProcessDaemon.start(storage: FakeSharedStorage())
        let client = try await ObsConnection.connect(socketPath: daemon.socketPath)
        for i in 0..<500 {
            #expect(try await client.delete("absent", in: "r\(i)").changed == false)
        }
        // Nor does a conflict.
        await #expect(throws: ObsClientError.self) { try await client.set("k", to: 1, in: "c", ifRevision: 3) }
        let stats = try await client.statistics()
        #expect(stats.repositories == 0)
        #expect(stats.repositoriesHeld == 0, "repository objects held after no-op writes: \(String(describing: stats.repositoriesHeld))")
        #expect(try await client.repositories().isEmpty)
        await client.close()
        try await daemon.stop()
    }

    @Test func aChangingWriteCountsOnce() async throws {
        let daemon = try await InProcessDaemon.start(storage: FakeSharedStorage())
        let client = try await ObsConnection.connect(socketPath: daemon.socketPath)
        for i in 1...3 { #expect(try await client.set("k", to: .int(Int64(i)), in: "r").revision == UInt64(i)) }
        #expect(try await client.set("k", to: 3, in: "r").changed == false)
        let stats = try await client.statistics()
        #expect(stats.writes == 3)
        #expect(stats.repositoriesHeld == 1)
        await client.close()
        try await daemon.stop()
    }

    @Test func aWriteTheStoreAppliedAfterReportingItsOutcomeUnknownIsStillItsWritersOwn() async throws {
        let store = FakeSharedStorage()
        let daemon = try await InProcessDaemon.start(storage: store)
        let writer = try await ObsConnection.connect(socketPath: daemon.socketPath)
        let other = try await ObsConnection.connect(socketPath: daemon.socketPath)
        var own = try await writer.subscribe(to: "r", options: SubscriptionOptions(echo: false)).makeAsyncIterator()
        var all = try await other.subscribe(to: "r").makeAsyncIterator()

        store.reportNextCommitAsUnknown()
        await #expect(throws: ObsClientError.self) { try await writer.set("k", to: "mine", in: "r") }
        store.deliverParked()
        // The other connection sees the write the store applied; then writes its own.
        #expect(try await all.next()?.revision == 1)
        #expect(try await other.set("k", to: "theirs", in: "r").revision == 2)
        // The writer's `echo: false` subscription skips its own revision 1 and gets revision 2.
        let first = try await own.next()
        #expect(first?.revision == 2, "the writer's echo:false subscription got \(String(describing: first))")
        await writer.close()
        await other.close()
        try await daemon.stop()
    }
}
