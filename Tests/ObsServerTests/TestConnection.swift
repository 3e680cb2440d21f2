// An in-process client connection for the ObsServer tests: the daemon's `ConnectionHandler`
// on an `EmbeddedChannel` whose event loop is the hub's, its credentials seam answering a
// fixed peer. A test writes request bytes inbound, runs the loop (the shard writes its
// connections once per tick), and reads back what the daemon wrote, a JSON line at a time.
// Nothing here sleeps: time moves only when a test advances the embedded loop's clock.

import Logging
import NIOCore
import NIOEmbedded
import ObsProtocol

@testable import ObsServer

#if canImport(Glibc)
import Glibc
#endif

/// The peer of test connections: this process's own user (privileged, like the daemon's uid).
let testPeer = Peer(uid: getuid(), gid: getgid(), pid: getpid())

/// A logger that drops everything (refusals log at notice level).
let quietLogger = Logger(label: "obsd-test") { _ in SwiftLogNoOpLogHandler() }

/// Counts the reads the connection handler passes on toward the socket.
final class ReadCounter: ChannelOutboundHandler {
    typealias OutboundIn = ByteBuffer
    private(set) var count = 0

    func read(context: ChannelHandlerContext) {
        count += 1
        context.read()
    }
}

/// One client connection, served by a `ConnectionHandler` on an `EmbeddedChannel`.
final class TestConnection {
    let channel: EmbeddedChannel
    /// The reads the handler issued (it holds them back while its outbox is congested).
    let reads = ReadCounter()
    private var partial: [UInt8] = []

    /// Connects (fires `channelActive`) as `peer`; `nil` stands for credentials that cannot be read.
    init(hub: Hub, loop: EmbeddedEventLoop, limits: Limits = .testing, peer: Peer? = testPeer) throws {
        channel = EmbeddedChannel(loop: loop)
        try channel.setOption(ChannelOptions.allowRemoteHalfClosure, value: true).wait()
        let handler = ConnectionHandler(hub: hub, limits: limits, startTime: .now, logger: quietLogger, peerOf: { _ in peer })
        try channel.pipeline.syncOperations.addHandlers([reads, handler])
        try channel.connect(to: SocketAddress(unixDomainSocketPath: "/run/obsd-test.sock")).wait()
    }

    /// Closes the channel if it is still open, and drops what the loop still has scheduled
    /// (a grace or lingering close), so neither is freed open or with pending tasks.
    deinit {
        _ = try? channel.finish(acceptAlreadyClosed: true)
    }

    var loop: EmbeddedEventLoop { channel.embeddedEventLoop }
    var isActive: Bool { channel.isActive }

    /// Writes `text` inbound as one read (with its read-complete), then, unless `tick` is
    /// false, runs what the loop has scheduled — the shard's tick, which writes the replies.
    func send(_ text: String, tick: Bool = true) throws {
        try channel.writeInbound(channel.allocator.buffer(string: text))
        if tick { loop.run() }
    }

    /// The complete lines the daemon wrote since the last call, parsed as JSON.
    func received() throws -> [JSONValue] {
        while let buffer = try channel.readOutbound(as: ByteBuffer.self) {
            partial += buffer.readableBytesView
        }
        var messages: [JSONValue] = []
        while let newline = partial.firstIndex(of: UInt8(ascii: "\n")) {
            messages.append(try JSONParser.parse(Array(partial[..<newline])))
            partial.removeSubrange(...newline)
        }
        return messages
    }

    /// The client shuts down its sending side: end of file, the connection still open.
    func shutdownInput() {
        channel.pipeline.syncOperations.fireUserInboundEventTriggered(ChannelEvent.inputClosed)
        loop.run()
    }

    /// The socket stops (or starts again) taking bytes; the pipeline hears of it as from NIO.
    func setWritable(_ writable: Bool) {
        channel.isWritable = writable
        channel.pipeline.syncOperations.fireChannelWritabilityChanged()
        loop.run()
    }

    /// Asks for a read, as NIO's auto-read does after each read cycle.
    func requestRead() {
        channel.read()
    }
}

/// Requests as one read: each followed by `\n`.
func lines(_ requests: String...) -> String {
    requests.map { $0 + "\n" }.joined()
}

extension JSONValue {
    /// The member `name` of an object (nil for anything else).
    subscript(_ name: String) -> JSONValue? { objectValue?[name] }

    /// An error reply's code.
    var errorCode: String? { self["error"]?["code"]?.stringValue }
}
