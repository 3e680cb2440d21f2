// End-to-end tests of the client side of the subscribe options `coalesce`, `writers`,
// `echo`: through ObsClient, watches, the Observation mirrors and obsctl, against the real
// daemon.

#if canImport(Glibc)
import Glibc
#endif
import Foundation
import ObsClient
import ObsProtocol
import ObservableKit
import Observation
import Testing
import TestSupport

/// This test process as the daemon sees it (SO_PEERCRED of its connections).
let thisProcess = Writer(uid: getuid(), gid: getgid(), pid: getpid())

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct SubscribeOptionsClientTests {
    @Test func coalesceWithOnceIsRefusedBeforeAnythingIsSent() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        try await ObsConnection.withConnection(socketPath: d.socketPath) { client in
            do throws(ObsClientError) {
                _ = try await client.subscribe(to: "ui", once: true, options: SubscriptionOptions(coalesce: true))
                Issue.record("expected bad_request")
            } catch {
                #expect(error.code == .badRequest)
                #expect(error.description.contains("coalesce") && error.description.contains("once"))
            }
            try await client.ping()
            #expect(try await client.statistics().subscriptions == 0, "the daemon was never asked")
        }
        let usage = try obsctl(["watch", "ui", "--coalesce", "--once"], socket: d.socketPath)
        #expect(usage.status == 64, "a usage error, like every other pair of flags that cannot go together")
        #expect(usage.stderr.contains("--coalesce") && usage.stderr.contains("--once"))
        let help = try obsctl(["watch", "--help"], socket: d.socketPath)
        #expect(help.stdout.contains("--coalesce") && help.stdout.contains("--writers") && help.stdout.contains("--no-echo"))
    }

    /// The mirrors watch without echo by default, and they share the session's connection:
    /// a write made through one of them, or through the session, must still reach all.
    @Test @MainActor func everyMirrorOfASessionShowsEveryWriteMadeThroughIt() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        let all = RemoteRepository("ui", session: session)
        let windows = RemoteRepository("ui", selection: .prefix("win/"), session: session)
        let theme = RemoteValue("theme", in: "ui", as: String.self, session: session)
        #expect(all.options == .mirror && theme.options == .mirror)
        try await until("the mirrors are loaded") { all.contents.isLoaded && windows.contents.isLoaded && theme.current.isLoaded }

        #expect(try await theme.set("dark") == .applied(revision: 1))
        #expect(all.values == ["theme": "dark"], "a write through one mirror is shown by the others at once")
        #expect(try await all.set("win/1", to: "open") == .applied(revision: 2))
        #expect(windows.values == ["win/1": "open"] && theme.value == "dark")
        try await session.apply([.set("win/2", "open"), .delete("win/1"), .set("theme", "light")], in: "ui")
        #expect(try await windows.set("win/3", to: "open") == .applied(revision: 4))
        #expect(windows.values == ["win/2": "open", "win/3": "open"] && windows.revision == 4)
        #expect(theme.value == "light" && theme.current.revision == 3)

        try await ObsConnection.withConnection(socketPath: d.socketPath) { other in  // another connection: events
            _ = try await other.set("theme", to: "blue", in: "ui")
        }
        try await until("another connection's write arrives") { theme.value == "blue" && all.revision == 5 }
        let listing = try await session.connection().list("ui", includingValues: true)
        #expect(all.values == listing.values && all.revision == listing.revision)

        let echoing = RemoteRepository("ui", options: .default, session: session)  // the opt-out
        try await until("loaded") { echoing.contents.isLoaded }
        #expect(try await echoing.set("win/4", to: "open") == .applied(revision: 6))
        #expect(all.values == echoing.values && windows.values["win/4"] == "open")
        await session.close()
    }

    @Test func writersTellWhoWroteEachRevisionLiveInReplaysAndThroughObsctl() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let reader = try await ObsConnection.connect(socketPath: d.socketPath)
        let live = try await reader.subscribe(to: "w", options: SubscriptionOptions(writers: true))
        let plain = try await reader.subscribe(to: "w")
        let writer = try await ObsConnection.connect(socketPath: d.socketPath)
        try await writer.set("k", to: 1, in: "w")
        var events = live.makeAsyncIterator()
        guard case .change(let first) = try await events.next() else { throw TestFailure("expected a change") }
        #expect(first.revision == 1 && first.by == thisProcess)
        var plainEvents = plain.makeAsyncIterator()
        guard case .change(let unasked) = try await plainEvents.next() else { throw TestFailure("expected a change") }
        #expect(unasked.by == nil, "no by without writers")

        let replay = try await reader.subscribe(to: "w", since: 0, options: SubscriptionOptions(writers: true))
        var replayed = replay.makeAsyncIterator()
        guard case .change(let again) = try await replayed.next() else { throw TestFailure("expected the replay") }
        #expect(again.revision == 1 && again.by == thisProcess, "by in replayed events too")

        let session = ObsSession(socketPath: d.socketPath)
        var typed = session.watch("k", in: "w", as: Int.self, options: SubscriptionOptions(writers: true)).makeAsyncIterator()
        let snapshot = try await typed.next()
        #expect(snapshot?.isSnapshot == true && snapshot?.by == nil && snapshot?.new == 1)
        try await writer.set("k", to: 2, in: "w")
        let typedChange = try await typed.next()
        #expect(typedChange?.new == 2 && typedChange?.old == 1 && typedChange?.by == thisProcess)

        let json = try obsctl(["watch", "w", "--since", "0", "--once", "--writers", "--json"], socket: d.socketPath)
        #expect(json.status == 0)
        let line = try JSONParser.parse(json.stdout.split(separator: "\n").first.map(String.init) ?? "")
        #expect(line.objectValue?["by"] == thisProcess.jsonValue, "the JSON lines carry by as given")
        let human = try obsctl(["watch", "w", "--since", "0", "--once", "--writers", "--no-echo"], socket: d.socketPath)
        #expect(human.status == 0)
        #expect(human.stdout.contains("by uid \(getuid()) pid \(getpid())"), "\(human.stdout)")
        await session.close()
        await reader.close()
        await writer.close()
    }

    @Test func echoOffHidesThisConnectionsWritesButNotOthers() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let a = try await ObsConnection.connect(socketPath: d.socketPath)
        let quiet = try await a.subscribe(to: "e", options: SubscriptionOptions(echo: false))
        let echoing = try await a.subscribe(to: "e")
        let b = try await ObsConnection.connect(socketPath: d.socketPath)
        try await a.set("k", to: 1, in: "e")
        try await b.set("k", to: 2, in: "e")
        try await a.apply([.set("k", 3), .set("j", 3)], in: "e")
        try await b.delete("j", in: "e")
        var quietEvents = quiet.makeAsyncIterator()
        var seen: [UInt64] = []
        while seen.last != 4 {
            guard case .change(let c) = try await quietEvents.next() else { continue }
            seen.append(c.revision)
        }
        #expect(seen == [2, 4], "only the other connection's revisions")
        var echoed: [UInt64] = []
        var echoingEvents = echoing.makeAsyncIterator()
        while echoed.last != 4 {
            guard case .change(let c) = try await echoingEvents.next() else { continue }
            echoed.append(c.revision)
        }
        #expect(echoed == [1, 2, 3, 4], "a subscription without the option on the same connection gets all")
        await a.close()
        await b.close()
    }

    /// A watch that does not read while a writer pushes far past
    /// the client's buffer and the daemon's queue: never cut off, strictly increasing
    /// revisions, coalesced events, fewer events than writes, and the repository's state.
    @Test func aLaggingCoalescingWatchCatchesUpWithTheStateWithoutBeingCutOff() async throws {
        let d = try await TestDaemon.start(["--queue-events", "100", "--queue-bytes", "65536"], inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        var watch = session.watch("c", initial: true, options: SubscriptionOptions(coalesce: true)).makeAsyncIterator()
        guard case .snapshot(0, let initial, false) = try await watch.next() else { throw TestFailure("expected a snapshot") }
        let writer = try await ObsConnection.connect(socketPath: d.socketPath)
        let writes = 15_000  // past the client's 8192 buffered events, the socket buffers and the queue
        for i in 0..<writes {
            try await writer.set(Key("k\(i % 40)"), to: .number(UInt64(i)), in: "c")
        }
        let final = try await writer.list("c", includingValues: true)
        var state = initial
        var (last, events, coalesced): (UInt64, Int, Int) = (0, 0, 0)
        while last < final.revision {
            guard case .change(let event) = try await watch.next() else { continue }
            #expect(event.revision > last, "strictly increasing")
            #expect(watch.position == event.revision, "a resumed watch would start after this event")
            if let from = event.from {
                coalesced += 1
                #expect(from > last && from <= event.revision)
                #expect(event.changes.map(\.key) == event.changes.map(\.key).sorted(), "byte order of keys")
            }
            for change in event.changes { state[change.key] = change.new }
            (last, events) = (event.revision, events + 1)
        }
        #expect(state == final.values, "exactly the repository's state")
        #expect(coalesced > 0 && events < writes)
        #expect(session.connectionState == .connected, "never cut off")
        let connection = try await session.connection()
        #expect(connection.isConnected)
        #expect(try await writer.statistics().overflows == 0)
        await writer.close()
        await session.close()
    }

    /// A mirror whose main actor is busy while another
    /// connection storms: its connection is never cut off, it is notified far fewer times
    /// than there were writes, and it ends with the daemon's state — including a key it
    /// wrote itself (no echo) that the other writer then put back to the value the mirror's
    /// subscription last received.
    @Test @MainActor func aMirrorUnderAWriteStormIsNeverCutOffAndEndsWithTheDaemonsState() async throws {
        let d = try await TestDaemon.start(["--queue-events", "100", "--queue-bytes", "65536"], inMemory: true)
        let session = ObsSession(socketPath: d.socketPath)
        let mirror = RemoteRepository("storm", session: session)
        try await until("loaded") { mirror.contents.isLoaded }
        let log = StateLog()
        let stateUpdates = session.connectionStates()
        let recorder = Task { @MainActor in for await s in stateUpdates { log.states.append(s) } }
        #expect(try await mirror.set("mine", to: 3) == .applied(revision: 1))  // not echoed
        let notifications = NotificationCounter { _ = mirror.contents }

        // Synchronous writes: the main actor, where the mirror applies events, is blocked.
        // Every other main-actor test of the process is blocked with it (ObservationMirrorTests'
        // mirrors among them), so the writes are pipelined, `window` in flight: the main actor
        // is held for as long as the daemon takes to apply them, not for 30,000 round trips —
        // which on a loaded machine took minutes and ran other tests past their time limit.
        let writer = try d.connect()
        // Until the mirror's connection backs up, events still arrive one by one: up to the
        // client's 8192 buffered events, plus what the socket and the channel hold (a few
        // thousand small events). Past that, everything coalesces.
        let writes = 30_000
        let window = 256
        for start in stride(from: 0, to: writes, by: window) {
            let ids = try (start..<min(start + window, writes)).map { i in
                try writer.request(["op": "set", "repo": "storm", "key": .string("k\(i % 50)"), "value": .number(UInt64(i))])
            }
            for id in ids {
                let reply = try writer.receive()
                guard reply["id"] == id, reply["ok"] == true else { throw TestFailure("write \(id): \(JSONValue.object(reply).jsonText)") }
            }
        }
        _ = try writer.call(["op": "delete", "repo": "storm", "key": "mine"])  // back to absent, as first received
        let end = try writer.call(["op": "set", "repo": "storm", "key": "end", "value": true])
        let final = try writer.call(["op": "list", "repo": "storm", "values": true])
        let endRevision = try #require(end["rev"]?.uint64Value)

        do {
            try await until("the mirror reaches the last write", timeout: .seconds(60)) { mirror.revision >= endRevision }
        } catch {
            throw TestFailure("\(error): the mirror is at \(mirror.revision) of \(endRevision); connection states \(log.states)")
        }
        let values = try #require(final["values"]?.objectValue)
        #expect(mirror.values == Dictionary(uniqueKeysWithValues: values.members.map { (Key($0.name), $0.value) }))
        #expect(mirror.values["mine"] == nil, "the other writer's deletion reached the mirror")
        #expect(notifications.count < writes / 2, "coalesced: \(notifications.count) notifications for \(writes) writes")
        #expect(try writer.call(["op": "stats"])["overflows"] == 0, "never cut off")
        #expect(!log.states.contains { if case .waiting = $0 { true } else { false } }, "never disconnected: \(log.states)")
        recorder.cancel()
        writer.close()
        await session.close()
    }
}

@MainActor final class StateLog {
    var states: [ConnectionState] = []
}
