// `once` subscriptions against the real binary: each gets one change and ends, with and
// without `initial` and `writers`, and the daemon goes on. It runs with glibc's
// MALLOC_PERTURB_, which fills freed memory: a subscription used after it was freed (as one
// ending at its first change once was, and crashed the daemon about one time in two) crashes
// it here every time.

import ObsProtocol
import Testing
import TestSupport

@Suite(.mayBlock) struct OnceSubscriptionTests {
    @Test func onceSubscriptionsEndAtTheirFirstChangeAndTheDaemonGoesOn() async throws {
        let d = try await TestDaemon.start(inMemory: true, environment: ["MALLOC_PERTURB_": "165"])
        let writer = try d.connect()
        #expect(try writer.call(["op": "set", "repo": "r", "key": "k", "value": 0])["rev"] == 1)
        var watchers: [(connection: WireConnection, initial: Bool)] = []
        for i in 0..<12 {
            let watcher = try d.connect()
            let initial = i % 3 == 0
            let reply = try watcher.call(["op": "subscribe", "repo": "r", "once": true, "initial": .bool(initial), "writers": .bool(i % 2 == 0)])
            #expect(reply.ok && reply["rev"] == 1, "\(reply)")
            watchers.append((watcher, initial))
        }
        for value in 1...3 { _ = try writer.call(["op": "set", "repo": "r", "key": "k", "value": .int(Int64(value))]) }
        for (watcher, initial) in watchers {
            if initial { #expect(try watcher.receive()["event"] == "snapshot") }
            let change = try watcher.receive()
            #expect(change["event"] == "change" && change["rev"] == 2, "\(change)")
            // Ended, and the connection still answers.
            #expect(try watcher.call(["op": "ping"]).ok)
        }
        #expect(try writer.call(["op": "stats"])["subscriptions"] == 0)
        #expect(await d.stop() == 0, "\(d.log)")
    }
}
