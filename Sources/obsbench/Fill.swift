// obsbench — `fill`: loads many keys into one repository quickly (batches of 1000), for
// start-up measurements.

import ArgumentParser
import NIOCore
import NIOPosix
import ObsProtocol

struct Fill: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Writes N keys into a repository, in batches.")

    @Option(help: "The daemon's socket.") var socket: String
    @Option(help: "Keys.") var keys: Int = 1_000_000
    @Option(help: "Keys per batch.") var batch: Int = 1000
    @Option(help: "Repository.") var repo: String = "fill"

    func run() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let done = loop.makePromise(of: Void.self)
        let channel = try await connect(socket, loop: loop) { BatchWriter(repo: repo, keys: keys, batch: batch, done: done) }
        let start = ContinuousClock.now
        try await channel.writeAndFlush(ByteBuffer())
        try await done.futureResult.get()
        print("fill keys=\(keys) seconds=\(fmt((ContinuousClock.now - start).seconds))")
        try? await channel.close()
        try await group.shutdownGracefully()
    }
}

/// Sends batches with 4 in flight until every key is written.
final class BatchWriter: ChannelDuplexHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    let repo: String
    let keys: Int
    let batch: Int
    let done: EventLoopPromise<Void>
    var next = 0
    var outstanding = 0
    var framer = LineFramer(maxLine: 1 << 20)

    init(repo: String, keys: Int, batch: Int, done: EventLoopPromise<Void>) {
        self.repo = repo
        self.keys = keys
        self.batch = batch
        self.done = done
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        promise?.succeed(())
        send(context)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                guard case .line(let line) = frame else { return }
                outstanding -= 1
                if !contains(line, #""ok":true"#) { done.fail(BenchError(String(decoding: line, as: UTF8.self))) }
            }
        }
        send(context)
        if next >= keys && outstanding == 0 { done.succeed(()) }
    }

    private func send(_ context: ChannelHandlerContext) {
        var buffer = context.channel.allocator.buffer(capacity: 64 * batch)
        while outstanding < 4 && next < keys {
            buffer.writeString(#"{"op":"batch","repo":"\#(repo)","ops":["#)
            let end = min(keys, next + batch)
            for i in next..<end {
                if i > next { buffer.writeString(",") }
                buffer.writeString(#"{"op":"set","key":"key/\#(i)","value":{"n":\#(i),"name":"item \#(i)"}}"#)
            }
            buffer.writeString("]}\n")
            next = end
            outstanding += 1
        }
        if buffer.readableBytes > 0 { context.writeAndFlush(NIOAny(buffer), promise: nil) }
    }
}
