// `progress` events in process, on a loop whose clock the test moves: sent within about a
// second of the repository moving past what the subscription was told, at most once a
// second, never when nothing moved, never to a subscription that did not ask, and never
// while a coalescing subscription lags.

import ObsProtocol
import Testing
import TestSupport

@testable import ObsServer

@Suite(.mayBlock) struct ProgressClockTests {
    @Test func aQuietSubscriptionIsToldOnceASecondWhileTheRepositoryMoves() throws {
        let server = try TestServer()
        let watcher = try TestConnection(server)
        try watcher.send(lines(#"{"id":1,"op":"subscribe","repo":"r","keys":["quiet"],"progress":true}"#, #"{"id":2,"op":"subscribe","repo":"r","keys":["quiet"]}"#))
        #expect(try watcher.received().count == 2)
        let writer = try TestConnection(server)
        for i in 1...5 { try writer.send(lines(#"{"id":\#(i),"op":"set","repo":"r","key":"noisy","value":\#(i)}"#)) }
        _ = try writer.received()
        server.advanceTime(by: .milliseconds(999))
        #expect(try watcher.received().isEmpty, "at most once a second")
        server.advanceTime(by: .milliseconds(1))
        let progress = try watcher.received()
        #expect(progress.count == 1, "only the subscription that asked: \(progress)")
        #expect(progress.first?["event"] == "progress" && progress.first?["sub"] == 1 && progress.first?["rev"] == 5)

        server.advanceTime(by: .seconds(3))
        #expect(try watcher.received().isEmpty, "nothing moved: nothing to tell")
        try writer.send(lines(#"{"id":9,"op":"set","repo":"r","key":"noisy","value":9}"#))
        server.advanceTime(by: .seconds(1))
        #expect(try watcher.received().map(\.["rev"]) == [.int(6)])
    }
}
