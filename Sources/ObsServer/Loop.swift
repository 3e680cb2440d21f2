// ObsServer — the daemon's loops, one word for one thing: a `Loop` is one thread of the
// daemon, made of its I/O loop (`IOLoop`: epoll, timers, tasks posted to it), its share of
// delivery (`LoopShard`: the revisions posted to it, routed to its subscriptions) and its
// connections (`LoopConnections`). How many there are: one per CPU the daemon may actually
// use.
//
// NIO's `System.coreCount` honours cgroup quotas and cpusets but not the process's CPU
// affinity (`taskset`, systemd's `CPUAffinity=`); a daemon pinned to one CPU that ran two
// loops there would hand every fan-out from one thread to another on the same core. The
// count is the smaller of the two; `server.threads` overrides it.

import CLinux
import NIOCore

/// One of the daemon's loops: its thread's I/O loop, its share of delivery, and its
/// connections.
final class Loop: Sendable {
    let io: IOLoop
    let shard: LoopShard
    /// Loop-confined (touched only in tasks run on `io`).
    nonisolated(unsafe) let connections = LoopConnections()

    init(index: Int, delivery: DeliveryBudget, busyPoll: UInt64 = 0, clock: @escaping @Sendable () -> UInt64 = IOLoop.monotonicNow)
        throws(SocketError)
    {
        io = try IOLoop(index: index, clock: clock, busyPoll: busyPoll)
        shard = LoopShard(loop: io, budget: delivery)
    }

    /// Runs `body` on the loop and returns its result.
    func run<R: Sendable>(_ body: @escaping @Sendable () -> R) async -> R {
        await withCheckedContinuation { continuation in
            io.execute { continuation.resume(returning: body()) }
        }
    }

    /// Waits until every connection of the loop has written what is queued for it, `within`
    /// nanoseconds at most.
    func drain(within limit: UInt64) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            io.execute { [self] in
                let done = Once { continuation.resume() }
                var left = connections.count
                guard left > 0 else { return done.run() }
                io.schedule(in: limit) { done.run() }
                for connection in connections.all.values {
                    connection.whenDrained {
                        left -= 1
                        if left == 0 { done.run() }
                    }
                }
            }
        }
    }
}

/// Runs a closure once, however often it is asked.
private final class Once: @unchecked Sendable {
    // @unchecked Sendable: created and run on one event loop only.
    private var body: (() -> Void)?
    init(_ body: @escaping () -> Void) { self.body = body }
    func run() {
        let body = self.body
        self.body = nil
        body?()
    }
}

extension Loop {
    /// The number of loops, and what decided it (for the log).
    static func sized() -> (count: Int, reason: String) {
        let quota = System.coreCount
        let allowed = Int(obs_cpus_allowed())
        if allowed > 0, allowed < quota { return (allowed, "CPU affinity (\(allowed) of \(quota) CPUs)") }
        return (max(1, quota), "CPUs available to the process (cgroup quota and cpuset honoured)")
    }
}
