// obsbench — `soak`: a bounded robustness run against a live obsd. Churning connections,
// rate-limited writers, gap-checked fast subscribers and slow readers that must be cut off
// run for `--seconds` (longer, until a slow reader was cut off, where the writers could not
// queue enough for one in that time); the daemon's RSS and open descriptors (`/proc/PID`)
// are sampled throughout. Exits non-zero on a gap, an error reply, a fast subscriber cut
// off, a slow reader never cut off, RSS growing past `--max-rss-growth` after warm-up, or a
// descriptor not given back once every connection is closed.

import ArgumentParser
import NIOCore
import NIOPosix
import ObsClient
import ObsProtocol

#if canImport(Glibc)
import Glibc
#endif

struct Soak: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Churn connections against a running obsd while checking delivery, memory and descriptors.")

    @Option(help: "The daemon's socket.") var socket: String
    @Option(help: "The daemon's pid (for /proc/PID/status and /proc/PID/fd).") var pid: Int32
    @Option(help: "Seconds of load.") var seconds: Int = 180
    @Option(help: "Seconds of load before the RSS reference sample.") var warmup: Int = 30
    @Option(help: "Seconds between samples.") var sample: Int = 10
    @Option(help: "Churning connections kept open at once.") var churners: Int = 1000
    @Option(help: "Writer connections.") var writers: Int = 4
    @Option(help: "Requests per second per writer.") var rate: Int = 250
    @Option(help: "Fast subscribers of the whole repository, checked for gaps.") var fast: Int = 4
    @Option(help: "Slow readers kept open at once.") var slow: Int = 4
    @Option(help: "Keys written.") var keys: Int = 1000
    @Option(help: "Repository.") var repo: String = "soak"
    @Option(help: "Largest RSS growth allowed from the warm-up sample to the end of the load (a fraction).")
    var maxRssGrowth: Double = 0.2

    func validate() throws {
        guard warmup < seconds else { throw ValidationError("--warmup must be shorter than --seconds") }
        guard sample > 0, churners >= 0, writers > 0, rate > 0, fast > 0, slow >= 0, keys > 0 else {
            throw ValidationError("counts and rates must be positive")
        }
    }

    func run() async throws {
        raiseDescriptorLimit()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let client = try await ObsConnection.connect(socketPath: socket, eventLoopGroup: group)
        // Touch the repository first so its storage exists before the descriptor baseline.
        try await client.set("k/0", to: .string("start"), in: repo)
        let idle = try await settledSample()
        say("soak start: rss=\(idle.rssKiB)KiB fds=\(idle.fds) (idle, one client connected)")

        let plan = SoakRun.Plan(
            socket: socket, repo: repo, keys: keys, churners: churners, writers: writers, rate: rate, fast: fast, slow: slow)
        let run = SoakRun(loop: loop, plan: plan)
        try await loop.submit { run.start() }.get()
        let start = ContinuousClock.now
        var reference: ProcSample?
        var last = idle
        var elapsed = 0
        while elapsed < seconds {
            let step = min(sample, seconds - elapsed)
            try await Task.sleep(for: .seconds(step))
            elapsed += step
            last = try ProcSample.read(pid)
            let c = try await loop.submit { run.counters }.get()
            if reference == nil && elapsed >= warmup { reference = last }
            say(
                "t=\(elapsed)s rss=\(last.rssKiB)KiB fds=\(last.fds) live=\(c.live) connects=\(c.connects) "
                    + "subscribed=\(c.subscribed) writes=\(c.writesAcked) fast-events=\(c.fastEvents) "
                    + "slow-cut-off=\(c.slowCutOffs) refused=\(c.connectFailures)")
        }
        // A slow reader is cut off once the writers have queued more than the daemon's limit
        // for it: on a starved machine they write less in `seconds`, so the load goes on until
        // one is — for at most `seconds` more — rather than judging a check the load never
        // reached (a run pinned to one busy CPU wrote a fifth as much, and cut nobody off).
        var extended = 0
        while slow > 0, extended < seconds, try await loop.submit({ run.counters.slowCutOffs }).get() == 0 {
            try await Task.sleep(for: .seconds(1))
            extended += 1
        }
        if extended > 0 { say("load extended by \(extended)s until a slow reader was cut off") }
        let loadSeconds = (ContinuousClock.now - start).seconds
        try await loop.flatSubmit { run.stop() }.get()
        let end = try await settledSample(baseline: idle.fds)
        let stats = try await client.statistics()
        await client.close()
        let (c, failures) = try await loop.submit { (run.counters, run.failures) }.get()
        try await group.shutdownGracefully()

        let daemonOverflows = stats.overflows.map { "\($0)" } ?? "-1"
        let warm = reference ?? last
        let growth = Double(last.rssKiB - warm.rssKiB) / Double(warm.rssKiB)
        say(
            "soak end: seconds=\(fmt(loadSeconds)) connects=\(c.connects) (\(Int(Double(c.connects) / loadSeconds))/s) "
                + "writes=\(c.writesAcked) fast-events=\(c.fastEvents) slow-cut-off=\(c.slowCutOffs) "
                + "(overflow event seen by \(c.slowSawOverflow)) daemon-overflows=\(daemonOverflows) "
                + "half-closed-served=\(c.halfClosedServed)")
        say(
            "soak rss: idle=\(idle.rssKiB)KiB warm=\(warm.rssKiB)KiB end-of-load=\(last.rssKiB)KiB "
                + "after-close=\(end.rssKiB)KiB peak=\(end.hwmKiB)KiB growth-after-warmup=\(fmt(growth * 100))%")
        say("soak fds: idle=\(idle.fds) end-of-load=\(last.fds) after-close=\(end.fds)")

        var problems = failures
        if c.fastEvents == 0 { problems.append("the fast subscribers saw no events") }
        if slow > 0 && c.slowCutOffs == 0 { problems.append("no slow reader was cut off") }
        if churners >= Churner.styles && c.halfClosedServed == 0 { problems.append("no half-closed churner was served") }
        if growth > maxRssGrowth { problems.append("RSS grew \(fmt(growth * 100))% after warm-up") }
        if end.fds != idle.fds {
            let added = end.targets.subtracting(idle.targets).sorted(), removed = idle.targets.subtracting(end.targets).sorted()
            problems.append("descriptors: \(idle.fds) before the load, \(end.fds) after it; new: \(added), gone: \(removed)")
        }
        if !problems.isEmpty {
            for problem in problems { say("FAIL: \(problem)") }
            throw ExitCode.failure
        }
        say("soak ok")
    }

    /// Samples until two readings 200 ms apart agree on the descriptor count (and, given a
    /// baseline, until it is reached), for at most ten seconds.
    private func settledSample(baseline: Int? = nil) async throws -> ProcSample {
        var previous = try ProcSample.read(pid)
        for _ in 0..<50 {
            try await Task.sleep(for: .milliseconds(200))
            let now = try ProcSample.read(pid)
            if now.fds == previous.fds && (baseline == nil || now.fds == baseline) { return now }
            previous = now
        }
        return previous
    }
}

/// A process's resident memory and open descriptors, from /proc.
struct ProcSample: Sendable {
    var rssKiB: Int
    var hwmKiB: Int
    var fds: Int
    /// What each descriptor refers to (`fd -> target`), for reporting a difference.
    var targets: Set<String>

    static func read(_ pid: Int32) throws -> ProcSample {
        guard let file = fopen("/proc/\(pid)/status", "r") else { throw BenchError("cannot read /proc/\(pid)/status") }
        defer { fclose(file) }
        var sample = ProcSample(rssKiB: 0, hwmKiB: 0, fds: 0, targets: [])
        var buffer = [CChar](repeating: 0, count: 512)
        while fgets(&buffer, Int32(buffer.count), file) != nil {
            let line = String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
            let number = { Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "") ?? 0 }
            if line.hasPrefix("VmRSS:") { sample.rssKiB = number() }
            if line.hasPrefix("VmHWM:") { sample.hwmKiB = number() }
        }
        guard let dir = opendir("/proc/\(pid)/fd") else { throw BenchError("cannot list /proc/\(pid)/fd") }
        defer { closedir(dir) }
        while let entry = readdir(dir) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard name != ".", name != ".." else { continue }
            sample.fds += 1
            var target = [CChar](repeating: 0, count: 4096)
            let n = readlink("/proc/\(pid)/fd/\(name)", &target, target.count - 1)
            sample.targets.insert("\(name) -> " + String(decoding: target.prefix(max(0, n)).map { UInt8(bitPattern: $0) }, as: UTF8.self))
        }
        return sample
    }
}

/// Lifts the soft descriptor limit to the hard one: a thousand connections need it.
func raiseDescriptorLimit() {
    var limit = rlimit()
    guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0, limit.rlim_cur < limit.rlim_max else { return }
    limit.rlim_cur = limit.rlim_max
    _ = setrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
}

/// Prints a line at once, also into a pipe or file: a long soak reports as it goes.
func say(_ line: String) {
    print(line)
    fflush(nil)
}
