// obsbench — the load generator for obsd benchmarks.
//
// Written for the purpose: one event loop, raw line handling (no JSON tree per event),
// and every delivered event counted and checked for order — a fast-but-lossy run fails.
// Scenarios: `pubsub` (fan-out, keyed and latency, against obsd or Redis), `writes`
// (acknowledged writes/s for N pipelined writers, against obsd or Redis), `idle` (memory
// per idle subscribed connection), `fill` (load many keys), `soak` (a bounded robustness
// run: churn, slow readers, memory and descriptors).

import ArgumentParser
import NIOCore
import NIOPosix
import ObsProtocol

#if canImport(Glibc)
import Glibc
#endif

@main
struct Obsbench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "obsbench",
        abstract: "Load generator for obsd benchmarks.",
        subcommands: [PubSub.self, Writes.self, Idle.self, Fill.self, Soak.self])
}

/// The server a scenario runs against: obsd or Redis, on a Unix socket.
struct ServerOptions: ParsableArguments {
    @Option(help: "obsd or redis.") var target: String = "obsd"
    @Option(help: "The server's socket.") var socket: String

    var redis: Bool { target == "redis" }

    func validate() throws {
        guard target == "obsd" || target == "redis" else { throw ValidationError("--target must be obsd or redis") }
    }
}

struct BenchError: Error, CustomStringConvertible {
    let description: String
    init(_ d: String) { description = d }
}

func connect<H: ChannelHandler & Sendable>(_ path: String, loop: any EventLoop, _ make: @escaping @Sendable () -> H) async throws -> any Channel {
    try await ClientBootstrap(group: loop)
        .channelInitializer { channel in
            channel.eventLoop.makeCompletedFuture { try channel.pipeline.syncOperations.addHandler(make()) }
        }
        .connect(unixDomainSocketPath: path).get()
}

func line(_ text: String) -> ByteBuffer {
    ByteBuffer(string: text + "\n")
}

func cpuSeconds() -> Double {
    var usage = rusage()
    getrusage(RUSAGE_SELF.rawValue, &usage)
    return Double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) + Double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6
}

func fmt(_ x: Double) -> String {
    let scaled = (x * 1000).rounded() / 1000
    return "\(scaled)"
}
