// obsbench — the load generator for obsd benchmarks.
//
// Written for the purpose: one event loop, raw line handling (no JSON tree per event),
// and every delivered event counted and checked for order — a fast-but-lossy run fails.
// Scenarios: `fanout` (one key, N subscribers, pipelined writes), `writes` (acknowledged
// writes/s for N pipelined writers, against obsd or Redis), `pubsub` (fan-out, keyed
// and latency, against obsd or Redis), `idle` (memory per idle subscribed connection),
// `fill` (load many keys), `soak` (a bounded robustness run: churn, slow readers, memory
// and descriptors).

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
        subcommands: [Fanout.self, Writes.self, PubSub.self, Idle.self, Fill.self, Soak.self])
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

struct Fanout: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "One writer sets one key; N subscribers of that key receive every change.")

    @Option(help: "The daemon's socket.") var socket: String
    @Option(help: "Subscribers.") var subscribers: Int = 100
    @Option(help: "Writes.") var writes: Int = 20_000
    @Option(help: "Writes in flight.") var inflight: Int = 64
    @Option(help: "Repository name (use a fresh one per run).") var repo: String = "bench"

    func run() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let done = loop.makePromise(of: Void.self)
        let tracker = Tracker(expected: subscribers, lastRevision: UInt64(writes), done: done)

        var subs: [any Channel] = []
        for i in 0..<subscribers {
            let channel = try await connect(socket, loop: loop) { EventCounter(index: i, tracker: tracker) }
            try await channel.writeAndFlush(line(#"{"id":1,"op":"subscribe","repo":"\#(repo)","keys":["k"]}"#))
            subs.append(channel)
        }
        try await tracker.waitForSubscribed(loop: loop)

        let cpu0 = cpuSeconds()
        let start = ContinuousClock.now
        let writer = try await connect(socket, loop: loop) { PipelinedWriter(repo: repo, total: writes, inflight: inflight) }
        try await writer.writeAndFlush(ByteBuffer())  // kick
        try await done.futureResult.get()
        let elapsed = ContinuousClock.now - start
        let cpu = cpuSeconds() - cpu0
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        let events = Double(subscribers * writes)
        print(
            "fanout subscribers=\(subscribers) writes=\(writes) inflight=\(inflight) "
                + "seconds=\(fmt(seconds)) events/s=\(Int(events / seconds)) writes/s=\(Int(Double(writes) / seconds)) "
                + "loadgen-cpu=\(Int(cpu / seconds * 100))%")
        for channel in subs + [writer] { try? await channel.close() }
        try await group.shutdownGracefully()
    }
}

/// Counts subscribers ready and subscribers finished; checks order.
final class Tracker: @unchecked Sendable {
    // @unchecked: every method runs on the benchmark's single event loop.
    let expected: Int
    let lastRevision: UInt64
    let done: EventLoopPromise<Void>
    private var subscribed = 0
    private var finished = 0
    private var subscribedPromise: EventLoopPromise<Void>?

    init(expected: Int, lastRevision: UInt64, done: EventLoopPromise<Void>) {
        self.expected = expected
        self.lastRevision = lastRevision
        self.done = done
    }

    func waitForSubscribed(loop: any EventLoop) async throws {
        try await loop.submit { () -> EventLoopFuture<Void> in
            if self.subscribed == self.expected { return loop.makeSucceededFuture(()) }
            let p = loop.makePromise(of: Void.self)
            self.subscribedPromise = p
            return p.futureResult
        }.flatMap { $0 }.get()
    }

    func didSubscribe() {
        subscribed += 1
        if subscribed == expected { subscribedPromise?.succeed(()) }
    }

    func didFinish() {
        finished += 1
        if finished == expected { done.succeed(()) }
    }

    func fail(_ message: String) {
        done.fail(BenchError(message))
    }
}

struct BenchError: Error, CustomStringConvertible {
    let description: String
    init(_ d: String) { description = d }
}

/// A subscriber: counts change events and checks they arrive at consecutive revisions.
final class EventCounter: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    let index: Int
    let tracker: Tracker
    var framer = LineFramer(maxLine: 1 << 24)
    var last: UInt64 = 0
    var subscribed = false

    init(index: Int, tracker: Tracker) {
        self.index = index
        self.tracker = tracker
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                guard case .line(let line) = frame else { return }
                if !subscribed {
                    subscribed = true
                    tracker.didSubscribe()
                    return
                }
                guard let rev = revision(in: line) else { return }
                if rev != last + 1 { tracker.fail("subscriber \(index): revision \(rev) after \(last)") }
                last = rev
                if rev == tracker.lastRevision { tracker.didFinish() }
            }
        }
    }
}

/// Keeps `inflight` set requests outstanding until `total` have been answered.
final class PipelinedWriter: ChannelDuplexHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    let repo: String
    let total: Int
    let inflight: Int
    var sent = 0
    var answered = 0
    var framer = LineFramer(maxLine: 1 << 20)

    init(repo: String, total: Int, inflight: Int) {
        self.repo = repo
        self.total = total
        self.inflight = inflight
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        promise?.succeed(())
        send(context, upTo: inflight)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        var replies = 0
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { _ in replies += 1 }
        }
        answered += replies
        send(context, upTo: answered + inflight)
    }

    private func send(_ context: ChannelHandlerContext, upTo limit: Int) {
        var buffer = context.channel.allocator.buffer(capacity: 4096)
        while sent < min(limit, total) {
            sent += 1
            buffer.writeString(#"{"op":"set","repo":"\#(repo)","key":"k","value":\#(sent)}"#)
            buffer.writeInteger(UInt8(ascii: "\n"))
        }
        if buffer.readableBytes > 0 { context.writeAndFlush(NIOAny(buffer), promise: nil) }
    }
}

/// The value of the first `"rev":` in a line.
func revision(in line: UnsafeRawBufferPointer) -> UInt64? {
    let needle = Array(#""rev":"#.utf8)
    guard line.count > needle.count else { return nil }
    var i = 0
    while i + needle.count < line.count {
        if line[i] == needle[0], (0..<needle.count).allSatisfy({ line[i + $0] == needle[$0] }) {
            var j = i + needle.count
            var v: UInt64 = 0
            while j < line.count, line[j] >= 48, line[j] <= 57 {
                v = v * 10 + UInt64(line[j] - 48)
                j += 1
            }
            return v
        }
        i += 1
    }
    return nil
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
