// obsbench — `writes`: acknowledged writes per second from N pipelined writers, against
// obsd (JSON lines) or Redis (RESP `SET`), checking every reply is a success.

import ArgumentParser
import NIOCore
import NIOPosix
import ObsClient
import ObsProtocol

struct Writes: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "N writers keep K writes in flight each; prints acknowledged writes/s.")

    @OptionGroup var server: ServerOptions
    @Option(help: "Writer connections.") var writers: Int = 1
    @Option(help: "Writes in flight per writer.") var inflight: Int = 64
    @Option(help: "Measured seconds (after one second of warm-up).") var seconds: Double = 5
    @Option(help: "Repository (obsd) or key prefix (redis).") var repo: String = "w"

    func run() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let counter = AckCounter()
        let redis = server.redis
        var channels: [any Channel] = []
        for w in 0..<writers {
            let prefix = "\(repo)\(w)"
            let channel = try await connect(server.socket, loop: loop) {
                KeepInFlight(redis: redis, repo: repo, prefix: prefix, inflight: inflight, counter: counter)
            }
            try await channel.writeAndFlush(ByteBuffer())  // kick
            channels.append(channel)
        }
        // obsd reports its fsyncs; read them at both ends of the measured window.
        let stats = redis ? nil : try await ObsClient.connect(socketPath: server.socket, eventLoopGroup: group)
        try await Task.sleep(for: .seconds(1))
        let fsyncs0 = try await stats?.stats()["storageFsyncs"]?.int64Value ?? 0
        let (acks0, cpu0, start) = (try await counter.count(on: loop), cpuSeconds(), ContinuousClock.now)
        try await Task.sleep(for: .milliseconds(Int(seconds * 1000)))
        let (acks1, cpu1, end) = (try await counter.count(on: loop), cpuSeconds(), ContinuousClock.now)
        let fsyncs1 = try await stats?.stats()["storageFsyncs"]?.int64Value ?? 0
        let elapsed = (end - start).seconds
        if let failure = try await counter.failure(on: loop) { throw BenchError(failure) }
        print(
            "writes target=\(server.target) writers=\(writers) inflight=\(inflight) seconds=\(fmt(elapsed)) "
                + "acks/s=\(Int(Double(acks1 - acks0) / elapsed)) fsyncs/s=\(fmt(Double(fsyncs1 - fsyncs0) / elapsed)) "
                + "loadgen-cpu=\(Int((cpu1 - cpu0) / elapsed * 100))%")
        await stats?.close()
        for channel in channels { try? await channel.close() }
        try await group.shutdownGracefully()
    }
}

/// Counts acknowledgements across writers. Loop-confined.
final class AckCounter: @unchecked Sendable {
    // @unchecked: mutated only on the benchmark's single event loop.
    var acks = 0
    var firstFailure: String?

    func count(on loop: any EventLoop) async throws -> Int { try await loop.submit { self.acks }.get() }
    func failure(on loop: any EventLoop) async throws -> String? { try await loop.submit { self.firstFailure }.get() }
}

/// Keeps `inflight` writes outstanding on one connection, forever.
final class KeepInFlight: ChannelDuplexHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    let redis: Bool
    let repo: String
    let prefix: String
    let inflight: Int
    let counter: AckCounter
    var sent = 0
    var answered = 0
    var framer = LineFramer(maxLine: 1 << 20)

    init(redis: Bool, repo: String, prefix: String, inflight: Int, counter: AckCounter) {
        self.redis = redis
        self.repo = repo
        self.prefix = prefix
        self.inflight = inflight
        self.counter = counter
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        promise?.succeed(())
        send(context)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        var replies = 0
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                guard case .line(let line) = frame else { return }
                replies += 1
                let good = redis ? line.first == UInt8(ascii: "+") : contains(line, #""ok":true"#)
                if !good, counter.firstFailure == nil { counter.firstFailure = String(decoding: line, as: UTF8.self) }
            }
        }
        answered += replies
        counter.acks += replies
        send(context)
    }

    private func send(_ context: ChannelHandlerContext) {
        var buffer = context.channel.allocator.buffer(capacity: 4096)
        while sent < answered + inflight {
            sent += 1
            let key = "\(prefix)/k\(sent % 1000)"
            let value = "\(sent)"
            if redis {
                buffer.writeString("*3\r\n$3\r\nSET\r\n$\(key.utf8.count)\r\n\(key)\r\n$\(value.utf8.count)\r\n\(value)\r\n")
            } else {
                buffer.writeString(#"{"op":"set","repo":"\#(repo)","key":"\#(key)","value":\#(value)}"#)
                buffer.writeInteger(UInt8(ascii: "\n"))
            }
        }
        if buffer.readableBytes > 0 { context.writeAndFlush(NIOAny(buffer), promise: nil) }
    }
}

/// Whether `line` contains `needle`.
func contains(_ line: UnsafeRawBufferPointer, _ needle: String) -> Bool {
    let n = Array(needle.utf8)
    guard line.count >= n.count else { return false }
    for i in 0...(line.count - n.count) where line[i] == n[0] {
        if (0..<n.count).allSatisfy({ line[i + $0] == n[$0] }) { return true }
    }
    return false
}

extension Duration {
    var seconds: Double { Double(components.seconds) + Double(components.attoseconds) / 1e18 }
}
