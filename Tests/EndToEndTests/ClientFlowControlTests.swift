// End-to-end tests of what a client holds of events its application has not consumed yet
// (FlowControl). Beside calls in flight on the same connection — a loop of writes, whose
// replies must get through, so the client keeps reading — a subscription left unread is cut
// off at the connection's limit, as the daemon's overflow would cut it: `overflowed` after
// the events it holds, while the connection, its calls and its other subscriptions go on;
// and a watch read that slowly resumes after the cut with no gap and no duplicate.

@testable import ObsClient
import NIOPosix
import ObsProtocol
import ObservableKit
import Testing
import TestSupport

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct ClientFlowControlTests {
    /// Small bounds, so that a test reaches them in a few hundred writes.
    static let limits = FlowControl.Limits(highWater: 64, lowWater: 16, limit: 256)
    static let writes = 1_000

    @Test func aSubscriptionLeftUnreadBesideCallsInFlightIsCutOffAtTheLimit() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let client = try await ObsConnection.connect(
            socketPath: d.socketPath, eventLoopGroup: MultiThreadedEventLoopGroup.singleton, localWrites: nil, limits: Self.limits)
        let unread = try await client.subscribe(to: "r")
        let quiet = try await client.subscribe(to: "quiet")  // holds nothing: not the one cut off
        for i in 1...Self.writes { try await client.set("k", to: .int(Int64(i)), in: "r") }  // every reply gets through
        #expect(client.bufferedEvents <= Self.limits.limit)

        var revisions: [UInt64] = []
        do {
            for try await event in unread {
                guard case .change(let change) = event else { continue }
                revisions.append(change.revision)
                if change.revision == UInt64(Self.writes) { break }
            }
            Issue.record("the unread subscription was never cut off: it held \(revisions.count) events")
        } catch let error as ObsClientError {
            guard error.code == .overflowed, let resumeAfter = error.resumeAfter else { throw error }
            #expect(resumeAfter == UInt64(Self.limits.limit), "cut off holding the limit")
            #expect(revisions == Array(1...resumeAfter), "every event it held, in order, before the error")
        }
        // The connection goes on: calls, the other subscription; the daemon dropped the cut one.
        #expect(client.isConnected)
        try await client.set("k", to: 1, in: "quiet")
        var quietEvents = quiet.makeAsyncIterator()
        guard case .change(let change) = try await quietEvents.next() else { throw TestFailure("expected the quiet change") }
        #expect(change.revision == 1)
        #expect(try await client.statistics().subscriptions == 1)
        await client.close()
    }

    @Test func aWatchLeftUnreadBesideAWriteLoopResumesWithNoGap() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(
            socketPath: d.socketPath, backoff: Backoff(), eventLoopGroup: MultiThreadedEventLoopGroup.singleton, limits: Self.limits)
        let states = StateRecorder(session)
        var events = session.watch("r", initial: true).makeAsyncIterator()
        guard case .snapshot(0, _, false) = try await events.next() else { throw TestFailure("expected the snapshot") }
        for i in 1...Self.writes { try await session.set("k", to: .int(Int64(i)), in: "r") }  // the watch reads nothing meanwhile
        #expect(try await session.connection().bufferedEvents <= Self.limits.limit, "memory bounded while nobody reads")

        for i in 1...Self.writes {
            guard case .change(let change) = try await events.next() else { throw TestFailure("expected the change at \(i)") }
            #expect(change.revision == UInt64(i) && change.changes.first?.new == .int(Int64(i)))
            if change.revision != UInt64(i) { break }
        }
        #expect(states.states.filter { $0 == .connected }.count == 1, "cut off, not disconnected")
        await session.close()
    }
}
