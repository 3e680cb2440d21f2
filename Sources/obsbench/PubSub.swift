// obsbench — `pubsub`: keyed fan-out against obsd (`set` + keyed `subscribe`) or Redis
// (`PUBLISH` + `SUBSCRIBE`), the same load for both, on the raw engine (Raw/Engine.swift):
// - fanout: one key (k0), N subscribers, one publisher keeping `--inflight` writes in flight;
// - keyed: N subscribers each on its own key (k0 … k<N-1>), writes round-robin over the keys.
// Latency is measured on every run (send → receipt of each event, and each write's reply);
// `--inflight 1` is the latency scenario. Every event is checked: each subscriber must see
// its key's values 1, 2, 3, … — no loss, no duplicate, no reordering, no overflow — and
// every Redis PUBLISH must report the expected number of receivers.

import ArgumentParser

#if canImport(Glibc)
import Glibc
#endif

struct PubSub: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "pubsub",
        abstract: "Keyed fan-out against obsd or Redis; prints events/s and latency percentiles.")

    @OptionGroup var server: ServerOptions
    @Option(help: "fanout (every subscriber on one key) or keyed (each on its own key).") var mode: String = "fanout"
    @Option(help: "Subscriber connections.") var subscribers: Int = 100
    @Option(help: "Writes in flight (1: the latency scenario).") var inflight: Int = 64
    @Option(help: "Seconds of writing.") var seconds: Double = 3
    @Option(help: "Repository (obsd).") var repo: String = "ps"
    @Option(help: "Seconds without any byte received, once writing stopped, before the run fails.") var grace: Double = 10

    func validate() throws {
        guard mode == "fanout" || mode == "keyed" else { throw ValidationError("--mode must be fanout or keyed") }
        guard subscribers > 0, inflight > 0, seconds > 0 else { throw ValidationError("counts and seconds must be positive") }
        try validateRepository(repo)
    }

    func run() throws {
        raiseDescriptorLimit()
        let keyed = mode == "keyed"
        let keyCount = keyed ? subscribers : 1
        let keys = (0..<keyCount).map { "k\($0)" }
        let dialect = server.dialect
        var engine = try Engine(
            dialect: dialect, connections: subscribers + 1,
            requests: RequestTable(dialect: dialect, verb: .publish, repo: repo, keys: keys), publishedKeys: keyCount)
        // In steps of 100, each confirmed before the next: a burst of a thousand connects
        // would overflow a listen backlog.
        for i in 0..<subscribers {
            let key = keyed ? i : 0
            try engine.addSubscriber(socket: server.socket, key: key, request: RequestTable.subscribe(dialect, repo: repo, key: keys[key]))
            if (i + 1) % 100 == 0 { try engine.waitForSubscriptions(i + 1) }
        }
        try engine.waitForSubscriptions(subscribers)

        let publisher = try engine.addRequester(
            socket: server.socket, firstKey: 0, keyCount: keyCount, window: inflight, receivers: subscribers / keyCount)
        let cpu0 = cpuSeconds()
        let start = monotonicNanoseconds()
        engine.writing = true
        engine.fill(publisher)
        engine.serve(seconds: seconds)
        let subscriberCount = subscribers
        _ = engine.drain(grace: grace) { e in e.received == e.peer(publisher).sent * (subscriberCount / keyCount) }
        let cpu = cpuSeconds() - cpu0
        if let failure = engine.failure { throw BenchError(failure) }

        // Complete: every subscriber saw every value of its key (order was checked per event).
        let writes = engine.peer(publisher).sent
        for i in 0..<subscribers {
            let key = keyed ? i : 0
            let expected = writes / keyCount + (key < writes % keyCount ? 1 : 0)
            let last = engine.peer(i).last
            guard last == expected else { throw BenchError("subscriber \(i) of k\(key) saw \(last) of \(expected) values") }
        }
        let elapsed = Double(engine.lastDelivery - start) / 1e9
        print(
            "pubsub target=\(server.target) mode=\(mode) subscribers=\(subscribers) inflight=\(inflight) writes=\(writes) "
                + "events=\(engine.received) seconds=\(fmt(elapsed)) events/s=\(Int(Double(engine.received) / elapsed)) "
                + "\(engine.eventLatency.summary()) \(engine.replyLatency.summary(prefix: "reply-")) "
                + "loadgen-cpu=\(Int((cpu / elapsed * 100).rounded()))%")
    }
}
