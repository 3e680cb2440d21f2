// obsbench — the load generator for obsd benchmarks (see README, "Performance").
//
// `pubsub` (fan-out, keyed and latency), `writes` and `idle` run against obsd or Redis on
// a raw engine (Raw/): one thread, epoll, non-blocking Unix sockets, one shared read buffer,
// frames scanned in place, no allocation per event — so that the load generator is not
// what limits a fast server, and it checks every event and reply all the same.
// `fill` (load many keys), `soak` (a bounded robustness run: churn, slow readers, memory
// and descriptors) and `cluster` (two daemons sharing one etcd) drive obsd alone and stay
// on SwiftNIO and the client library.

import ArgumentParser
import NIOCore
import NIOPosix

#if canImport(Glibc)
import Glibc
#endif

@main
struct Obsbench: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "obsbench",
        abstract: "Load generator for obsd benchmarks.",
        subcommands: [PubSub.self, Writes.self, Idle.self, Fill.self, Soak.self, Cluster.self])
}

/// The server a scenario runs against: obsd or Redis, on a Unix socket.
struct ServerOptions: ParsableArguments {
    @Option(help: "obsd or redis.") var target: String = "obsd"
    @Option(help: "The server's socket.") var socket: String

    var redis: Bool { target == "redis" }
    var dialect: Dialect { redis ? .redis : .obsd }

    func validate() throws {
        guard target == "obsd" || target == "redis" else { throw ValidationError("--target must be obsd or redis") }
    }
}

/// A repository name as the contract allows it (1–128 of `[A-Za-z0-9._-]`); requests are
/// encoded without escaping, so nothing else may reach them.
func validateRepository(_ name: String) throws {
    let allowed = name.utf8.allSatisfy { b in
        (b >= 0x30 && b <= 0x39) || (b >= 0x41 && b <= 0x5A) || (b >= 0x61 && b <= 0x7A) || b == 0x2E || b == 0x5F || b == 0x2D
    }
    guard allowed, (1...128).contains(name.utf8.count) else {
        throw ValidationError("--repo must be 1-128 characters of [A-Za-z0-9._-]")
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

extension Duration {
    var seconds: Double { Double(components.seconds) + Double(components.attoseconds) / 1e18 }
}
