// obsbench — `writes`: acknowledged writes per second from N pipelined writers against
// obsd (`set`) or Redis (`SET`), on the raw engine (Raw/Engine.swift). Writer w writes its
// own 1,000 keys (`<repo><w>/k0` …) round robin with `--inflight` writes in flight; every
// reply must be a success. After a warm-up, acknowledgements, reply latency, the load
// generator's CPU and (obsd) the daemon's fsyncs are measured over `--seconds`.

import ArgumentParser

#if canImport(Glibc)
import Glibc
#endif

struct Writes: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "N writers keep K writes in flight each; prints acknowledged writes/s.")

    @OptionGroup var server: ServerOptions
    @Option(help: "Writer connections.") var writers: Int = 1
    @Option(help: "Writes in flight per writer.") var inflight: Int = 64
    @Option(help: "Measured seconds (after the warm-up).") var seconds: Double = 5
    @Option(help: "Seconds of writing before the measurement.") var warmup: Double = 1
    @Option(help: "Repository (obsd) or key prefix (redis).") var repo: String = "w"
    @Option(help: "Seconds without a reply, once writing stopped, before the run fails.") var grace: Double = 10

    static let keysPerWriter = 1000

    func validate() throws {
        guard writers > 0, inflight > 0, seconds > 0, warmup >= 0 else { throw ValidationError("counts and seconds must be positive") }
        try validateRepository(repo)
    }

    func run() throws {
        raiseDescriptorLimit()
        let dialect = server.dialect
        let keys = (0..<writers).flatMap { w in (0..<Self.keysPerWriter).map { "\(repo)\(w)/k\($0)" } }
        var engine = try Engine(
            dialect: dialect, connections: writers, requests: RequestTable(dialect: dialect, verb: .set, repo: repo, keys: keys))
        var connections: [Int] = []
        for w in 0..<writers {
            connections.append(
                try engine.addRequester(
                    socket: server.socket, firstKey: w * Self.keysPerWriter, keyCount: Self.keysPerWriter, window: inflight, receivers: nil))
        }
        let stats = server.redis ? nil : try StatsProbe(socket: server.socket)
        engine.writing = true
        for c in connections { engine.fill(c) }
        engine.serve(seconds: warmup)

        let fsyncs0 = try stats?.fsyncs() ?? 0
        engine.replyLatency.reset()
        let (acks0, cpu0, start) = (engine.requestTotals.answered, cpuSeconds(), monotonicNanoseconds())
        engine.serve(seconds: seconds)
        let (acks1, cpu1, end) = (engine.requestTotals.answered, cpuSeconds(), monotonicNanoseconds())
        let fsyncs1 = try stats?.fsyncs() ?? 0
        _ = engine.drain(grace: grace) { _ in true }
        if let failure = engine.failure { throw BenchError(failure) }

        let elapsed = Double(end - start) / 1e9
        print(
            "writes target=\(server.target) writers=\(writers) inflight=\(inflight) seconds=\(fmt(elapsed)) "
                + "acks/s=\(Int(Double(acks1 - acks0) / elapsed)) fsyncs/s=\(fmt(Double(fsyncs1 - fsyncs0) / elapsed)) "
                + "\(engine.replyLatency.summary(prefix: "reply-")) loadgen-cpu=\(Int(((cpu1 - cpu0) / elapsed * 100).rounded()))%")
    }
}

/// A blocking connection to obsd for its `stats` (the daemon counts its fsyncs).
struct StatsProbe: ~Copyable {
    let fd: Int32

    init(socket: String) throws(BenchError) { fd = try RawSocket.connect(socket) }

    deinit { close(fd) }

    /// `storageFsyncs` from a `stats` reply; 0 when the daemon has no such counter (`--in-memory`).
    func fsyncs() throws(BenchError) -> Int {
        try RawSocket.writeAll(fd, Array(#"{"id":1,"op":"stats"}"#.utf8) + [0x0A])
        let line = try RawSocket.readLine(fd)
        let value = line.withUnsafeBufferPointer { b -> Int?? in
            guard let start = b.baseAddress, Wire.isSuccess(start, start + b.count) else { return nil }
            guard let marker = Wire.find(#""storageFsyncs":"#, start, start + b.count) else { return .some(0) }
            var q = marker + 16
            let digits = q
            while q < start + b.count, q[0] &- 48 < 10 { q += 1 }
            return .some(Wire.digitsValue(digits, q))
        }
        guard let value, let value else { throw BenchError("stats: \(String(decoding: line.prefix(300), as: UTF8.self))") }
        return value
    }
}
