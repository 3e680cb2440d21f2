// obsbench — `cluster`: two obsd daemons sharing an etcd cluster (README, "Several hosts").
//
// latency: one writer on the first socket writes sequentially (each write after the previous
// acknowledgement); a subscriber on the second socket timestamps each event. Latency is from
// sending the write to its event's arrival on the other daemon.
// writes: N writers, each its own connection, alternately on the two sockets, each writing its
// own key sequentially for the given time; acknowledged writes/s. A subscriber on the second
// socket checks that the revisions it receives are dense.

import ArgumentParser
import ObsClient
import ObsProtocol
import ObservableKit
import Synchronization

struct Cluster: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Write→event latency and acknowledged writes/s across two obsd daemons on one etcd.")

    @Option(help: "The two daemons' sockets: writes go to the first (latency) or alternate (writes); the subscriber is on the second.")
    var sockets: String
    @Option(help: "latency or writes.") var mode: String = "latency"
    @Option(help: "Writes (latency).") var count: Int = 1000
    @Option(help: "Writers (writes).") var writers: Int = 1
    @Option(help: "Seconds of writing (writes).") var seconds: Double = 10
    @Option(help: "Repository.") var repo: String = "bench"

    func run() async throws {
        let paths = sockets.split(separator: ",").map(String.init)
        guard paths.count == 2 else { throw ValidationError("--sockets needs two paths, comma-separated") }
        let repository = "\(repo)-\(mode)-\(writers)-\(UInt32.random(in: 0...UInt32.max))"
        let subscriber = try await ObsConnection.connect(socketPath: paths[1])
        let subscription = try await subscriber.subscribe(to: repository)
        let arrivals = Arrivals()
        let reader = Task {
            for try await event in subscription {
                if case .change(let change) = event { arrivals.record(change) }
            }
        }
        defer { reader.cancel() }
        switch mode {
        case "latency": try await latency(paths[0], repository, arrivals)
        case "writes": try await writes(paths, repository, arrivals)
        default: throw ValidationError("--mode must be latency or writes")
        }
        await subscriber.close()
    }

    private func latency(_ path: String, _ repository: String, _ arrivals: Arrivals) async throws {
        let client = try await ObsConnection.connect(socketPath: path)
        var sent: [UInt64: ContinuousClock.Instant] = [:]
        for i in 0..<count {
            let start = ContinuousClock.now
            let reply = try await client.set("k", to: .int(Int64(i)), in: repository)
            sent[reply.revision] = start
        }
        let last = UInt64(count)
        guard await arrivals.wait(for: last) else { throw BenchError("the subscriber did not receive every event") }
        var samples = sent.compactMap { revision, start in arrivals.time(of: revision).map { ($0 - start).seconds * 1000 } }
        samples.sort()
        print(
            "cluster latency write on A -> event on B: n=\(samples.count) p50=\(fmt(percentile(samples, 0.50)))ms p99=\(fmt(percentile(samples, 0.99)))ms max=\(fmt(samples.last ?? 0))ms dense=\(arrivals.isDense)"
        )
        await client.close()
    }

    private func writes(_ paths: [String], _ repository: String, _ arrivals: Arrivals) async throws {
        var clients: [ObsConnection] = []
        for w in 0..<writers { clients.append(try await ObsConnection.connect(socketPath: paths[w % 2])) }
        let until = ContinuousClock.now + .milliseconds(Int64(seconds * 1000))
        let start = ContinuousClock.now
        let (acknowledged, failed) = try await withThrowingTaskGroup(of: (Int, Int).self) { group in
            for (w, client) in clients.enumerated() {
                group.addTask {
                    var (ok, failed) = (0, 0)
                    while ContinuousClock.now < until {
                        do {
                            try await client.set(Key("w\(w)"), to: .int(Int64(ok)), in: repository)
                            ok += 1
                        } catch {
                            failed += 1
                        }
                    }
                    return (ok, failed)
                }
            }
            return try await group.reduce(into: (0, 0)) { $0.0 += $1.0; $0.1 += $1.1 }
        }
        let elapsed = (ContinuousClock.now - start).seconds
        let delivered = await arrivals.wait(for: UInt64(acknowledged))
        print(
            "cluster writes: writers=\(writers) (\((writers + 1) / 2) on A, \(writers / 2) on B) acknowledged=\(acknowledged) failed=\(failed) seconds=\(fmt(elapsed)) writes/s=\(fmt(Double(acknowledged) / elapsed)) events on B=\(arrivals.count) dense=\(arrivals.isDense && delivered)"
        )
        for client in clients { await client.close() }
    }
}

/// When each revision's event arrived, and whether they came 1, 2, 3…
final class Arrivals: Sendable {
    private let state = Mutex<(times: [UInt64: ContinuousClock.Instant], last: UInt64, dense: Bool)>(([:], 0, true))

    func record(_ change: ChangeEvent<JSONValue>) {
        let now = ContinuousClock.now
        state.withLock { s in
            if change.revision != s.last + 1 || change.isCoalesced { s.dense = false }
            s.last = change.revision
            s.times[change.revision] = now
        }
    }

    func time(of revision: UInt64) -> ContinuousClock.Instant? { state.withLock { $0.times[revision] } }
    var count: Int { state.withLock { $0.times.count } }
    var isDense: Bool { state.withLock { $0.dense } }

    /// Whether the event of `revision` arrives within 30 s.
    func wait(for revision: UInt64) async -> Bool {
        let deadline = ContinuousClock.now + .seconds(30)
        while ContinuousClock.now < deadline {
            if state.withLock({ $0.last >= revision }) { return true }
            try? await Task.sleep(for: .milliseconds(5))
        }
        return state.withLock { $0.last >= revision }
    }
}

private func percentile(_ sorted: [Double], _ p: Double) -> Double {
    guard !sorted.isEmpty else { return 0 }
    return sorted[min(sorted.count - 1, Int(Double(sorted.count - 1) * p))]
}
