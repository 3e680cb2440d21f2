// End-to-end: the contract's "Catching up" and "Sync" sections against the real obsd — a
// subscription with `catchup` is replayed within the history, caught up with a diff past it
// (deletions included, after a graceful restart and after kill -9 too) or sent a snapshot when
// the diff cannot be shown, and never refused; `sync` is answered after every event of its
// subscription up to its revision, in request order, whatever the writers do meanwhile.

import Foundation
import ObsProtocol
import ObsValues
import Synchronization
import ObservableKit
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(5))) struct CatchUpTests {
    /// The history this test's daemons keep: 2 revisions, so a resume from further back
    /// needs a catch-up.
    private static let shortHistory = ["--history-limit", "2"]

    // The scenario: TestSupport's CatchUpScenario (the etcd suites write it too).

    @Test func pastTheHistoryACatchUpIsADiffThenSyncedThenLive() async throws {
        let d = try await TestDaemon.start(Self.shortHistory, inMemory: true)
        let c = try d.connect()
        let (seen, epoch) = try CatchUpScenario.write(c)
        let plain = try c.call(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch)])
        #expect(plain.errorCode == "compacted", "without catchup, as before: \(plain)")

        let id = try c.request(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true])
        let reply = try c.receive()
        #expect(reply["id"] == id && reply.ok && reply["catchup"]?.stringValue == "diff" && reply["rev"]?.int64Value == 8, "\(reply)")
        let sub = try #require(reply["sub"]?.int64Value)
        let line = try #require(try c.receiveLine())
        let text = String(decoding: line, as: UTF8.self)
        #expect(text.hasPrefix(#"{"event":"catchup","sub":\#(sub),"repo":"r","from":3,"rev":8,"values":{"#), "member order: \(text)")
        guard case .object(let event) = try JSONParser.parse(line) else { throw TestFailure("not an object: \(text)") }
        #expect(event["values"] == ["lang": "fr", "theme": "dark"], "the keys changed after 3, as they are at 8: \(text)")
        #expect(event["deleted"]?.arrayValue == ["draft", "tmp"], "deleted since 3, in byte order (tmp: created and deleted again): \(text)")
        #expect(event["by"] == nil && event["lease"] == nil)
        let synced = try c.receive()
        #expect(synced["event"]?.stringValue == "synced" && synced["rev"]?.int64Value == 8, "\(synced)")
        _ = try CatchUpScenario.set(c, "lang", "de")
        let live = try c.receive()
        #expect(live["event"]?.stringValue == "change" && live["rev"]?.int64Value == 9 && live["sub"]?.int64Value == sub, "\(live)")
    }

    @Test func withinTheHistoryACatchUpIsThePlainReplay() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        let (seen, epoch) = try CatchUpScenario.write(c)
        let reply = try c.call(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true, "writers": true])
        #expect(reply.ok && reply["catchup"]?.stringValue == "replay", "\(reply)")
        var revisions: [Int64] = []
        while true {
            let m = try c.receive()
            if m["event"]?.stringValue == "synced" { break }
            #expect(m["event"]?.stringValue == "change" && m["by"] != nil, "a replay with writers: \(m)")
            revisions.append(m["rev"]?.int64Value ?? 0)
        }
        #expect(revisions == [4, 5, 6, 7, 8])
    }

    @Test func anotherHistoryOrAFutureRevisionGetsASnapshotNeverCompacted() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        _ = try CatchUpScenario.write(c)
        for request: JSONValue in [
            ["op": "subscribe", "repo": "r", "since": 3, "epoch": "another history", "catchup": true, "keys": ["theme", "draft"]],
            ["op": "subscribe", "repo": "r", "since": 99, "catchup": true, "keys": ["theme", "draft"]],
        ] {
            let reply = try c.call(request)
            #expect(reply.ok && reply["catchup"]?.stringValue == "snapshot" && reply["rev"]?.int64Value == 8, "\(reply)")
            let snapshot = try c.receive()
            #expect(snapshot["event"]?.stringValue == "snapshot" && snapshot["values"] == ["theme": "dark"], "\(snapshot)")
            #expect(try c.receive()["event"]?.stringValue == "synced")
        }
    }

    @Test func catchupGoesOnlyWithSinceAndNeverWithOnce() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "subscribe", "repo": "r", "catchup": true]).errorCode == "bad_request")
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 0, "once": true, "catchup": true]).errorCode == "bad_request")
        #expect(try c.call(["op": "subscribe", "repo": "r", "since": 0, "catchup": "yes"]).errorCode == "bad_request")
        let off = try c.call(["op": "subscribe", "repo": "r", "since": 5, "catchup": false])
        #expect(off.errorCode == "compacted", "catchup: false is a plain since: \(off)")
    }

    @Test func aDiffHoldsTheSubscriptionsOwnWritesAndASelection() async throws {
        let d = try await TestDaemon.start(Self.shortHistory, inMemory: true)
        let c = try d.connect()
        let (seen, epoch) = try CatchUpScenario.write(c)
        let reply = try c.call([
            "op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true, "echo": false, "prefix": "t",
        ])
        #expect(reply["catchup"]?.stringValue == "diff")
        let event = try c.receive()
        #expect(event["values"] == ["theme": "dark"] && event["deleted"]?.arrayValue == ["tmp"], "state, not history: \(event)")
    }

    // MARK: Restarts

    private func catchUpAfterRestart(killed: Bool) async throws {
        let d = try await TestDaemon.start(Self.shortHistory)
        var c = try d.connect()
        let (seen, epoch) = try CatchUpScenario.write(c)
        if killed {
            d.kill9()
            _ = await d.waitForExit()
        } else {
            #expect(await d.stop() == 0)
        }
        try await d.launch()
        c = try d.connect()
        let reply = try c.call(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true])
        #expect(reply.ok && reply["catchup"]?.stringValue == "diff" && reply["epoch"]?.stringValue == epoch, "\(reply)")
        let event = try c.receive()
        #expect(event["deleted"]?.arrayValue == ["draft", "tmp"], "the deletions made before the restart: \(event)")
        #expect(event["values"] == ["lang": "fr", "theme": "dark"])
    }

    @Test func deletionsBeforeAGracefulRestartAreStillListed() async throws {
        try await catchUpAfterRestart(killed: false)
    }

    @Test func deletionsBeforeAKillAreStillListed() async throws {
        try await catchUpAfterRestart(killed: true)
    }

    // MARK: Sync

    @Test func syncIsAnsweredAfterTheEventsUpToItsRevisionInRequestOrder() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        let sub = try #require(try c.call(["op": "subscribe", "repo": "r", "keys": ["a"]])["sub"]?.int64Value)
        // Pipelined: a write, the sync, a ping. The write's event comes before the sync's reply,
        // and the sync's reply before the ping's.
        let w = try c.request(["op": "set", "repo": "r", "key": "a", "value": 1])
        let s = try c.request(["op": "sync", "sub": .int(sub)])
        let p = try c.request(["op": "ping"])
        var order: [String] = []
        var syncReply = JSONObject()
        while order.count < 4 {
            let m = try c.receive()
            if m["event"] != nil {
                order.append("event \(m["rev"]?.int64Value ?? -1)")
            } else if m["id"] == w {
                order.append("write")
            } else if m["id"] == s {
                order.append("sync")
                syncReply = m
            } else if m["id"] == p {
                order.append("ping")
            }
        }
        #expect(syncReply.ok && syncReply["rev"]?.int64Value == 1, "\(syncReply)")
        #expect(order.firstIndex(of: "event 1")! < order.firstIndex(of: "sync")!, "\(order)")
        #expect(order.firstIndex(of: "write")! < order.firstIndex(of: "sync")! && order.last == "ping", "\(order)")
    }

    /// Syncs pipelined each behind a write, in one read: answering one lets the connection's
    /// next requests run, and the next `sync` waits for its write's event in turn (found by the
    /// robustness suite: the daemon trapped — a waiting sync was added to the loop's list of
    /// them while that list was being filtered).
    @Test func pipelinedSyncsEachBehindAWriteAreAnsweredInOrder() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        let sub = try #require(try c.call(["op": "subscribe", "repo": "r", "keys": ["a"]])["sub"]?.int64Value)
        let pairs = 50
        var lines = ""
        for i in 1...pairs {
            lines += #"{"id":"w\#(i)","op":"set","repo":"r","key":"a","value":\#(i)}"# + "\n"
            lines += #"{"id":"s\#(i)","op":"sync","sub":\#(sub)}"# + "\n"
        }
        try c.sendRaw(Array(lines.utf8))
        var highest: Int64 = 0  // the newest change event seen
        var answered = 0
        while answered < pairs {
            let m = try c.receive(timeout: .seconds(30))
            if m["event"]?.stringValue == "change" {
                highest = m["rev"]?.int64Value ?? highest
                continue
            }
            guard let id = m["id"]?.stringValue, id.hasPrefix("s") else { continue }
            answered += 1
            #expect(id == "s\(answered)", "in request order: \(m)")
            #expect(m.ok && m["rev"]?.int64Value == Int64(answered) && highest >= Int64(answered), "\(m), the newest change \(highest)")
        }
        #expect(try c.call(["op": "ping"]).ok, "the daemon still serves")
    }

    @Test func syncOfAnUnknownOrEndedSubscriptionAndOfNoSubscription() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let c = try d.connect()
        #expect(try c.call(["op": "sync", "sub": 42]).errorCode == "not_found")
        #expect(try c.call(["op": "sync", "sub": -1]).errorCode == "not_found")
        #expect(try c.call(["op": "sync"]).errorCode == "bad_request")
        #expect(try c.call(["op": "sync", "sub": "1"]).errorCode == "bad_request")
        let once = try #require(try c.call(["op": "subscribe", "repo": "r", "once": true])["sub"]?.int64Value)
        _ = try CatchUpScenario.set(c, "k", 1)
        _ = try c.receive()  // its one change
        #expect(try c.call(["op": "sync", "sub": .int(once)]).errorCode == "not_found", "an ended once subscription")
    }

    @Test func syncFollowsACatchUpStillUnderWay() async throws {
        let d = try await TestDaemon.start(Self.shortHistory, inMemory: true)
        let c = try d.connect()
        let (seen, epoch) = try CatchUpScenario.write(c)
        // Pipelined: the subscribe and its sync; the sync's reply follows `synced`.
        _ = try c.request(["op": "subscribe", "repo": "r", "since": .int(Int64(seen)), "epoch": .string(epoch), "catchup": true])
        let s = try c.request(["op": "sync", "sub": 1])
        var kinds: [String] = []
        while !kinds.contains("sync") {
            let m = try c.receive()
            kinds.append(m["event"]?.stringValue ?? (m["id"] == s ? "sync" : "reply"))
            if m["id"] == s { #expect(m["rev"]?.int64Value == 8) }
        }
        #expect(kinds == ["reply", "catchup", "synced", "sync"], "\(kinds)")
    }

    /// Under a storm of writes from other connections, every `sync` reply comes after every
    /// event of its subscription up to its `rev`, and its `rev` is at least the revision of
    /// every write acknowledged before it was sent.
    @Test func syncUnderAWriteStormCoversEveryAcknowledgedWrite() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let writers = 3
        let stop = Flag()
        let acknowledged = Highest()
        var tasks: [Task<Void, any Error>] = []
        for w in 0..<writers {
            let connection = try d.connect()
            tasks.append(
                Task {
                    try await onOwnThread {  // (a blocking loop: never on the shared pool)
                        var i: Int64 = 0
                        while !stop.isSet {
                            i += 1
                            let reply = try connection.call(["op": "set", "repo": "storm", "key": .string("w\(w)"), "value": .int(i)])
                            if let rev = reply["rev"]?.int64Value { acknowledged.raise(rev) }
                        }
                    }
                })
        }
        defer { stop.set() }
        let c = try d.connect()
        let subscribed = try c.call(["op": "subscribe", "repo": "storm"])
        let sub = try #require(subscribed["sub"]?.int64Value)
        // The newest revision this connection knows: the one it subscribed at (the writers may
        // have begun already), then each change event's.
        let start = try #require(subscribed["rev"]?.int64Value)
        var highest = start
        var syncs = 0
        // Syncs while the storm goes on: at least 100 of them, and through 2,000 revisions.
        while syncs < 100 || highest < 2_000 {
            syncs += 1
            let floor = acknowledged.value
            let id = try c.request(["op": "sync", "sub": .int(sub)])
            while true {
                let m = try c.receive(timeout: .seconds(30))
                if m["event"]?.stringValue == "change" {
                    let rev = m["rev"]?.int64Value ?? 0
                    #expect(rev == highest + 1, "no revision skipped: \(highest) then \(rev)")
                    highest = rev
                    continue
                }
                #expect(m["id"] == id, "\(m)")
                let rev = try #require(m["rev"]?.int64Value)
                #expect(rev >= floor, "the sync's rev \(rev) covers the write acknowledged at \(floor)")
                #expect(highest >= rev, "every change up to \(rev) came before the reply (the newest seen: \(highest))")
                break
            }
        }
        stop.set()
        for task in tasks { try await task.value }
        #expect(highest > start)
    }
}

/// A flag set once, read from any task.
private final class Flag: Sendable {
    private let value = Atomic<Bool>(false)
    var isSet: Bool { value.load(ordering: .acquiring) }
    func set() { value.store(true, ordering: .releasing) }
}

/// The highest number raised to, from any task.
private final class Highest: Sendable {
    private let current = Atomic<Int64>(0)
    var value: Int64 { current.load(ordering: .acquiring) }
    func raise(_ n: Int64) { _ = current.max(n, ordering: .acquiringAndReleasing) }
}
