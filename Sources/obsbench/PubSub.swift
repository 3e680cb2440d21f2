// obsbench — `pubsub`: keyed fan-out against obsd (`set` + keyed `subscribe`) or Redis
// (`PUBLISH` + `SUBSCRIBE`), the same load for both:
// - fanout: one key (channel), N subscribers, one publisher keeping K writes in flight;
// - keyed: N subscribers each on its own key, writes round-robin over the keys;
// - latency: one subscriber, writes at a fixed rate; time from send to event received.
// Every event is checked: each subscriber must see its key's values 1, 2, 3, … with no gap,
// and every Redis PUBLISH must report the expected number of receivers.

import ArgumentParser
import NIOCore
import NIOPosix
import ObsProtocol

struct PubSub: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "pubsub", abstract: "Keyed fan-out and latency, against obsd or Redis; prints events/s or percentiles.")

    @OptionGroup var server: ServerOptions
    @Option(help: "fanout, keyed or latency.") var mode: String = "fanout"
    @Option(help: "Subscribers (keyed: one key each; latency: 1).") var subscribers: Int = 100
    @Option(help: "Writes in flight (fanout, keyed).") var inflight: Int = 64
    @Option(help: "Writes per second (latency).") var rate: Int = 2000
    @Option(help: "Seconds of writing.") var seconds: Double = 3
    @Option(help: "Repository (obsd).") var repo: String = "ps"

    func validate() throws {
        guard ["fanout", "keyed", "latency"].contains(mode) else { throw ValidationError("--mode must be fanout, keyed or latency") }
    }

    func run() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let count = mode == "latency" ? 1 : subscribers
        let state = PubSubState(redis: server.redis, repo: repo, subscribers: count, keys: mode == "keyed" ? count : 1, loop: loop)
        var channels: [any Channel] = []
        for i in 0..<count {
            channels.append(try await connect(server.socket, loop: loop) { SubscriberHandler(index: i, state: state) })
        }
        try await state.subscribed.futureResult.get()

        let cpu0 = cpuSeconds()
        let publisher = try await connect(server.socket, loop: loop) {
            PublisherHandler(state: state, inflight: mode == "latency" ? nil : inflight, rate: rate)
        }
        try await publisher.writeAndFlush(ByteBuffer())  // start
        try await Task.sleep(for: .milliseconds(Int(seconds * 1000)))
        try await loop.submit { state.stopPublishing() }.get()
        try await state.delivered.futureResult.get()
        let cpu = cpuSeconds() - cpu0
        let summary = try await loop.submit { state.summary(mode: mode, cpu: cpu) }.get()
        print("pubsub target=\(server.target) mode=\(mode) subscribers=\(count) " + summary)
        for channel in channels + [publisher] { try? await channel.close() }
        try await group.shutdownGracefully()
    }
}

/// The run's shared state. Loop-confined.
final class PubSubState: @unchecked Sendable {
    // @unchecked: every access is on the benchmark's single event loop.
    let redis: Bool
    let repo: String
    let subscribers: Int
    let keys: Int
    let subscribed: EventLoopPromise<Void>
    let delivered: EventLoopPromise<Void>
    private(set) var subscribedCount = 0
    /// Writes sent per key, and in all; events received in all.
    var sentPerKey: [Int]
    var sent = 0
    var received = 0
    var publishing = true
    var start: UInt64 = 0
    var lastDelivery: UInt64 = 0
    /// Send time of each write of key 0 (latency mode), by value.
    var sendTimes: [UInt64] = [0]
    var latencies: [UInt64] = []
    var failure: String?

    init(redis: Bool, repo: String, subscribers: Int, keys: Int, loop: any EventLoop) {
        self.redis = redis
        self.repo = repo
        self.subscribers = subscribers
        self.keys = keys
        self.sentPerKey = Array(repeating: 0, count: keys)
        self.subscribed = loop.makePromise()
        self.delivered = loop.makePromise()
    }

    var expected: Int { keys == 1 ? sent * subscribers : sent }
    /// Receivers of each write: every subscriber in fan-out, one when keyed.
    var receiversPerWrite: Int { keys == 1 ? subscribers : 1 }

    func didSubscribe() {
        subscribedCount += 1
        if subscribedCount == subscribers { subscribed.succeed(()) }
    }

    func didReceive(at now: UInt64) {
        received += 1
        lastDelivery = now
        if !publishing && received == expected { delivered.succeed(()) }
    }

    func stopPublishing() {
        publishing = false
        if received == expected { delivered.succeed(()) }
    }

    func fail(_ message: String) {
        if failure == nil { failure = message }
        delivered.fail(BenchError(message))
    }

    func summary(mode: String, cpu: Double) -> String {
        let seconds = Double(lastDelivery - start) / 1e9
        var text = "writes=\(sent) events=\(received) seconds=\(fmt(seconds)) events/s=\(Int(Double(received) / seconds)) "
        if mode == "latency" {
            let sorted = latencies.sorted()
            func percentile(_ p: Double) -> String { fmt(Double(sorted[min(sorted.count - 1, Int(Double(sorted.count) * p))]) / 1000) }
            text += "p50-us=\(percentile(0.5)) p99-us=\(percentile(0.99)) p999-us=\(percentile(0.999)) "
        }
        return text + "loadgen-cpu=\(Int(cpu / seconds * 100))%"
    }
}

/// One subscriber: subscribes to its key, then checks that values arrive as 1, 2, 3, ….
final class SubscriberHandler: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    let index: Int
    let state: PubSubState
    let key: String
    var framer = LineFramer(maxLine: 1 << 20)
    var resp = RESPReader()
    var subscribed = false
    var last = 0

    init(index: Int, state: PubSubState) {
        self.index = index
        self.state = state
        self.key = "k\(state.keys == 1 ? 0 : index)"
    }

    func channelActive(context: ChannelHandlerContext) {
        let request =
            state.redis
            ? "*2\r\n$9\r\nSUBSCRIBE\r\n$\(key.utf8.count)\r\n\(key)\r\n"
            : #"{"id":1,"op":"subscribe","repo":"\#(state.repo)","keys":["\#(key)"]}"# + "\n"
        context.writeAndFlush(NIOAny(context.channel.allocator.buffer(string: request)), promise: nil)
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        let now = DispatchTime.nanoseconds
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                guard case .line(let line) = frame else { return }
                if state.redis {
                    guard let message = resp.feed(line) else { return }
                    if !subscribed, message.first == Array("subscribe".utf8) {
                        subscribed = true
                        state.didSubscribe()
                    } else if message.count == 3, message[0] == Array("message".utf8) {
                        deliver(integer(message[2][...]), at: now)
                    }
                } else if !subscribed {
                    subscribed = true
                    state.didSubscribe()
                } else {
                    deliver(valueAfter(#""new":"#, in: line), at: now)
                }
            }
        }
    }

    private func deliver(_ value: Int?, at now: UInt64) {
        guard let value, value == last + 1 else {
            return state.fail("subscriber \(index) (\(key)): value \(value.map(String.init) ?? "?") after \(last)")
        }
        last = value
        if state.keys == 1, value < state.sendTimes.count, state.sendTimes[value] > 0 {
            state.latencies.append(now - state.sendTimes[value])
        }
        state.didReceive(at: now)
    }
}

/// The publisher: keeps `inflight` writes outstanding, or (latency) writes `rate` per
/// second on a 1 ms tick. Checks every reply.
final class PublisherHandler: ChannelDuplexHandler, @unchecked Sendable {
    // @unchecked: used only on its channel's event loop.
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    let state: PubSubState
    let inflight: Int?
    let rate: Int
    var answered = 0
    var framer = LineFramer(maxLine: 1 << 20)
    var tick: RepeatedTask?

    init(state: PubSubState, inflight: Int?, rate: Int) {
        self.state = state
        self.inflight = inflight
        self.rate = rate
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        promise?.succeed(())
        state.start = DispatchTime.nanoseconds
        if inflight != nil {
            send(context, count: inflight!)
        } else {
            let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
            tick = context.eventLoop.scheduleRepeatedTask(initialDelay: .zero, delay: .milliseconds(1)) { [self] task in
                guard state.publishing else { return task.cancel() }
                let due = Int(Double(DispatchTime.nanoseconds - state.start) / 1e9 * Double(rate)) - state.sent
                if due > 0 { send(loopBound.value, count: due) }
            }
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = unwrapInboundIn(data)
        var replies = 0
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                guard case .line(let line) = frame else { return }
                replies += 1
                if state.redis {
                    if integer(line.dropFirst()[...]) != state.receiversPerWrite {
                        state.fail("PUBLISH reached \(String(decoding: line, as: UTF8.self)) subscribers, not \(state.receiversPerWrite)")
                    }
                } else if !contains(line, #""ok":true"#) {
                    state.fail("write failed: \(String(decoding: line, as: UTF8.self))")
                }
            }
        }
        answered += replies
        if let inflight, state.publishing { send(context, count: answered + inflight - state.sent) }
    }

    private func send(_ context: ChannelHandlerContext, count: Int) {
        guard count > 0, state.publishing else { return }
        var buffer = context.channel.allocator.buffer(capacity: 64 * count)
        for _ in 0..<count {
            let k = state.sent % state.keys
            state.sent += 1
            state.sentPerKey[k] += 1
            let key = "k\(k)", value = "\(state.sentPerKey[k])"
            if k == 0 && inflight == nil { state.sendTimes.append(DispatchTime.nanoseconds) }
            if state.redis {
                buffer.writeString("*3\r\n$7\r\nPUBLISH\r\n$\(key.utf8.count)\r\n\(key)\r\n$\(value.utf8.count)\r\n\(value)\r\n")
            } else {
                buffer.writeString(#"{"op":"set","repo":"\#(state.repo)","key":"\#(key)","value":\#(value)}"#)
                buffer.writeInteger(UInt8(ascii: "\n"))
            }
        }
        context.writeAndFlush(NIOAny(buffer), promise: nil)
    }
}

/// Assembles RESP arrays of bulk strings and integers from lines (`\r` already dropped).
struct RESPReader {
    private var remaining = 0
    private var expectBulk = false
    private var elements: [[UInt8]] = []

    /// Feeds one line; returns an array once complete.
    mutating func feed(_ line: UnsafeRawBufferPointer) -> [[UInt8]]? {
        if expectBulk {
            expectBulk = false
            elements.append(Array(line))
        } else if line.first == UInt8(ascii: "*") {
            remaining = integer(line.dropFirst()[...]) ?? 0
            elements = []
            return nil
        } else if line.first == UInt8(ascii: "$") {
            expectBulk = true
            return nil
        } else {
            elements.append(Array(line.dropFirst()))
        }
        remaining -= 1
        return remaining == 0 ? elements : nil
    }
}

/// The decimal integer in `bytes`, if that is all it holds.
func integer<C: Collection>(_ bytes: C) -> Int? where C.Element == UInt8 {
    guard !bytes.isEmpty else { return nil }
    var value = 0
    for b in bytes {
        guard b >= 48, b <= 57 else { return nil }
        value = value * 10 + Int(b - 48)
    }
    return value
}

/// The integer right after `marker` in `line`.
func valueAfter(_ marker: String, in line: UnsafeRawBufferPointer) -> Int? {
    let needle = Array(marker.utf8)
    guard line.count > needle.count else { return nil }
    for i in 0...(line.count - needle.count) where line[i] == needle[0] {
        guard (0..<needle.count).allSatisfy({ line[i + $0] == needle[$0] }) else { continue }
        var j = i + needle.count
        var value = 0
        while j < line.count, line[j] >= 48, line[j] <= 57 {
            value = value * 10 + Int(line[j] - 48)
            j += 1
        }
        return j > i + needle.count ? value : nil
    }
    return nil
}

enum DispatchTime {
    /// Monotonic nanoseconds.
    static var nanoseconds: UInt64 { NIODeadline.now().uptimeNanoseconds }
}
