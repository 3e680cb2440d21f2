// obsbench — the connections of a `soak` run and the loop-confined state they report to:
// churners (connect, subscribe, leave — politely or not), rate-limited writers, fast
// subscribers that check every revision arrives exactly once and in order, and slow
// readers that the daemon must cut off.

import NIOCore
import NIOPosix
import ObsProtocol

/// What the soak run has seen so far.
struct SoakCounters: Sendable {
    var connects = 0
    var connectFailures = 0
    var subscribed = 0
    var writesAcked = 0
    var fastEvents = 0
    var slowCutOffs = 0
    var slowSawOverflow = 0
    /// Half-closing churners that got every reply, then end of file.
    var halfClosedServed = 0
    var live = 0
}

/// The soak run's shared state. Loop-confined: every method runs on `loop`, the only loop
/// of the run, which is what makes the `@unchecked Sendable` sound.
final class SoakRun: @unchecked Sendable {
    enum Kind { case churner, writer, fast, slow }

    struct Plan: Sendable {
        var socket: String
        var repo: String
        var keys: Int
        var churners: Int
        var writers: Int
        var rate: Int
        var fast: Int
        var slow: Int
    }

    let loop: any EventLoop
    let plan: Plan
    private(set) var counters = SoakCounters()
    private(set) var failures: [String] = []
    private(set) var running = true
    private var channels: [ObjectIdentifier: any Channel] = [:]
    private var drained: EventLoopPromise<Void>?
    private var generator = SystemRandomNumberGenerator()

    init(loop: any EventLoop, plan: Plan) {
        self.loop = loop
        self.plan = plan
    }

    func start() {
        loop.preconditionInEventLoop()
        for i in 0..<plan.fast { open(.fast, index: i) }
        for i in 0..<plan.writers { open(.writer, index: i) }
        for i in 0..<plan.slow { open(.slow, index: i) }
        for i in 0..<plan.churners { open(.churner, index: i) }
    }

    /// Stops respawning, closes every connection; succeeds once all are closed.
    func stop() -> EventLoopFuture<Void> {
        loop.preconditionInEventLoop()
        running = false
        let promise = loop.makePromise(of: Void.self)
        drained = promise
        for channel in channels.values { channel.close(promise: nil) }
        if channels.isEmpty { promise.succeed(()) }
        return promise.futureResult
    }

    func fail(_ message: String) {
        if failures.count < 20 { failures.append(message) }
    }

    func random(_ range: Range<Int>) -> Int { Int.random(in: range, using: &generator) }

    func key() -> String { "k/\(random(0..<plan.keys))" }

    func count(_ update: (inout SoakCounters) -> Void) { update(&counters) }

    private func open(_ kind: Kind, index: Int) {
        guard running else { return }
        let bootstrap = ClientBootstrap(group: loop).channelInitializer { channel in
            channel.eventLoop.makeCompletedFuture {
                let handler: any ChannelHandler
                switch kind {
                case .churner:
                    if index % Churner.styles == 3 { try channel.syncOptions?.setOption(ChannelOptions.autoRead, value: false) }
                    if index % Churner.styles == 5 { try channel.syncOptions?.setOption(ChannelOptions.allowRemoteHalfClosure, value: true) }
                    handler = Churner(run: self, style: index % Churner.styles)
                case .writer: handler = SoakWriter(run: self)
                case .fast: handler = GapChecker(run: self, index: index)
                case .slow:
                    try channel.syncOptions?.setOption(ChannelOptions.autoRead, value: false)
                    try channel.syncOptions?.setOption(ChannelOptions.maxMessagesPerRead, value: 1)
                    try channel.syncOptions?.setOption(
                        ChannelOptions.recvAllocator, value: FixedSizeRecvByteBufferAllocator(capacity: 4096))
                    handler = SlowReader(run: self)
                }
                try channel.pipeline.syncOperations.addHandler(handler)
            }
        }
        bootstrap.connect(unixDomainSocketPath: plan.socket).whenComplete { result in
            switch result {
            case .success(let channel):
                self.counters.connects += 1
                self.counters.live += 1
                self.channels[ObjectIdentifier(channel)] = channel
                channel.closeFuture.whenComplete { _ in self.closed(channel, kind, index: index) }
            case .failure:
                self.counters.connectFailures += 1
                self.loop.scheduleTask(in: .milliseconds(20)) { self.open(kind, index: index) }
            }
        }
    }

    private func closed(_ channel: any Channel, _ kind: Kind, index: Int) {
        counters.live -= 1
        channels[ObjectIdentifier(channel)] = nil
        if running {
            switch kind {
            case .churner, .slow: open(kind, index: index)
            case .writer, .fast: fail("a \(kind) connection closed during the run")
            }
        } else if channels.isEmpty {
            drained?.succeed(())
        }
    }
}

/// Feeds lines to `body`; fails the run on any error reply or overflow.
private func lines(_ buffer: ByteBuffer, _ framer: inout LineFramer, _ run: SoakRun, _ who: String, _ body: (UnsafeRawBufferPointer) -> Void) {
    buffer.withUnsafeReadableBytes { bytes in
        framer.feed(bytes) { frame in
            guard case .line(let line) = frame else { return run.fail("\(who): a line over the limit") }
            if contains(line, #""ok":false"#) || contains(line, #""event":"overflow""#) {
                run.fail("\(who): \(String(decoding: line.prefix(300), as: UTF8.self))")
            }
            body(line)
        }
    }
}

/// Connects, subscribes in one of six ways, lingers up to two seconds and leaves.
/// Styles: 0 keys with a snapshot, 1 a prefix, 2 `once`, 3 subscribe and a `get` (of `k/0`,
/// which the soak writes before any churner starts: any other key may not exist yet) and
/// leave without waiting for the answers, 4 half a request (no newline), 5 subscribe, `list` and `set`, then shut
/// down its sending side and read every reply until the daemon closes.
final class Churner: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on the run's single event loop.
    typealias InboundIn = ByteBuffer
    static let styles = 6
    let run: SoakRun
    let style: Int
    var framer = LineFramer(maxLine: 1 << 20)
    var replied = false
    var replies = 0

    init(run: SoakRun, style: Int) {
        self.run = run
        self.style = style
    }

    func channelActive(context: ChannelHandlerContext) {
        let repo = run.plan.repo
        let request: String
        switch style {
        case 0: request = #"{"id":1,"op":"subscribe","repo":"\#(repo)","keys":["\#(run.key())","\#(run.key())"],"initial":true}"#
        case 1: request = #"{"id":1,"op":"subscribe","repo":"\#(repo)","prefix":"k/1\#(run.random(0..<10))"}"#
        case 2: request = #"{"id":1,"op":"subscribe","repo":"\#(repo)","keys":["\#(run.key())"],"once":true}"#
        case 3: request = #"{"id":1,"op":"subscribe","repo":"\#(repo)"}"# + "\n" + #"{"id":2,"op":"get","repo":"\#(repo)","key":"k/0"}"#
        case 4: request = #"{"id":1,"op":"subscribe","repo":"\#(repo)","ke"#
        default:
            request = #"{"id":1,"op":"subscribe","repo":"\#(repo)"}"# + "\n" + #"{"id":2,"op":"list","repo":"\#(repo)","prefix":"h/"}"#
                + "\n" + #"{"id":3,"op":"set","repo":"\#(repo)","key":"h/\#(run.random(0..<100))","value":\#(run.random(0..<1000))}"#
        }
        context.writeAndFlush(NIOAny(ByteBuffer(string: style == 4 ? request : request + "\n")), promise: nil)
        if style == 5 {
            context.close(mode: .output, promise: nil)
        } else if style >= 3 {
            leave(context)
        }
        context.fireChannelActive()
    }

    /// Closes the connection after up to two seconds: the lifetimes keep about a thousand
    /// connects a second for a thousand churners.
    private func leave(_ context: ChannelHandlerContext) {
        let channel = context.channel
        context.eventLoop.scheduleTask(in: .milliseconds(Int64(run.random(0..<2000)))) { channel.close(promise: nil) }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        lines(unwrapInboundIn(data), &framer, run, "churner") { line in
            if style == 5, !contains(line, #""event":"#) { replies += 1 }
            guard !replied, contains(line, #""id":1"#) else { return }
            replied = true
            run.count { $0.subscribed += 1 }
            if style < 3 { leave(context) }
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        // The daemon's end of file (its output closed after ours: the channel closes whole),
        // after every reply to a client that shut down first.
        if style == 5, run.running {
            if replies == 3 {
                run.count { $0.halfClosedServed += 1 }
            } else {
                run.fail("a half-closed churner got \(replies) of its 3 replies before end of file")
            }
        }
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }
}

/// Sets `rate` values a second (every tenth request a batch of five), 256 in flight at most.
final class SoakWriter: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on the run's single event loop.
    typealias InboundIn = ByteBuffer
    let run: SoakRun
    var framer = LineFramer(maxLine: 1 << 20)
    var sent = 0
    var inFlight = 0
    var task: RepeatedTask?
    let padding = String(repeating: "p", count: 160)

    init(run: SoakRun) { self.run = run }

    func channelActive(context: ChannelHandlerContext) {
        let perTick = max(1, run.plan.rate / 100)
        let channel = context.channel
        task = context.eventLoop.scheduleRepeatedTask(initialDelay: .zero, delay: .milliseconds(10)) { _ in
            self.tick(channel, perTick)
        }
        context.fireChannelActive()
    }

    private func tick(_ channel: any Channel, _ count: Int) {
        var buffer = channel.allocator.buffer(capacity: 512 * count)
        let repo = run.plan.repo
        for _ in 0..<count where inFlight < 256 {
            sent += 1
            inFlight += 1
            if sent % 10 == 0 {
                let ops = (0..<5).map { i in #"{"op":"set","key":"b/\#(i)","value":{"n":\#(sent),"pad":"\#(padding)"}}"# }
                buffer.writeString(#"{"op":"batch","repo":"\#(repo)","ops":[\#(ops.joined(separator: ","))]}"#)
            } else {
                buffer.writeString(#"{"op":"set","repo":"\#(repo)","key":"\#(run.key())","value":{"n":\#(sent),"pad":"\#(padding)"}}"#)
            }
            buffer.writeInteger(UInt8(ascii: "\n"))
        }
        if buffer.readableBytes > 0 { channel.writeAndFlush(buffer, promise: nil) }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        lines(unwrapInboundIn(data), &framer, run, "writer") { _ in
            inFlight -= 1
            run.count { $0.writesAcked += 1 }
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        task?.cancel()
        context.fireChannelInactive()
    }
}

/// Subscribes to the whole repository; every revision after the reply's must arrive, once,
/// in order (each revision changes at least one key, so the sequence has no holes).
final class GapChecker: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on the run's single event loop.
    typealias InboundIn = ByteBuffer
    let run: SoakRun
    let index: Int
    var framer = LineFramer(maxLine: 1 << 20)
    var last: UInt64?

    init(run: SoakRun, index: Int) {
        self.run = run
        self.index = index
    }

    func channelActive(context: ChannelHandlerContext) {
        context.writeAndFlush(NIOAny(line(#"{"id":1,"op":"subscribe","repo":"\#(run.plan.repo)"}"#)), promise: nil)
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        lines(unwrapInboundIn(data), &framer, run, "fast subscriber \(index)") { line in
            guard let rev = valueAfter(#""rev":"#, in: line).map(UInt64.init) else { return }
            guard let previous = last else {
                last = rev  // the subscribe reply: events start above this revision
                return
            }
            if rev != previous + 1 { run.fail("fast subscriber \(index): revision \(rev) after \(previous)") }
            last = rev
            run.count { $0.fastEvents += 1 }
        }
    }
}

/// Subscribes to the whole repository and then reads 4 KiB a second — far slower than events
/// arrive, even on a starved machine — until the daemon cuts it off.
final class SlowReader: ChannelInboundHandler, @unchecked Sendable {
    // @unchecked: used only on the run's single event loop.
    typealias InboundIn = ByteBuffer
    let run: SoakRun
    var task: RepeatedTask?
    var sawOverflow = false
    var framer = LineFramer(maxLine: 1 << 20)

    init(run: SoakRun) { self.run = run }

    func channelActive(context: ChannelHandlerContext) {
        context.writeAndFlush(NIOAny(line(#"{"id":1,"op":"subscribe","repo":"\#(run.plan.repo)"}"#)), promise: nil)
        let channel = context.channel
        task = context.eventLoop.scheduleRepeatedTask(initialDelay: .zero, delay: .seconds(1)) { _ in
            channel.read()
        }
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        unwrapInboundIn(data).withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { frame in
                if case .line(let line) = frame, contains(line, #""event":"overflow""#) { sawOverflow = true }
            }
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        task?.cancel()
        if run.running {  // the run only closes connections once it stops
            let overflow = sawOverflow
            run.count {
                $0.slowCutOffs += 1
                if overflow { $0.slowSawOverflow += 1 }
            }
        }
        context.fireChannelInactive()
    }
}
