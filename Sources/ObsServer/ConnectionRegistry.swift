// ObsServer — the open client connections, and how shutdown winds them down: no more
// requests, then storage makes durable what it holds (the replies waiting for it fill their
// places), then every reply reaches its client (bounded), then the connections close. A
// write is never taken after storage closed, and nothing storage made durable at shutdown
// goes unanswered.

import NIOCore
import ObservableKit

/// Sent through each connection's pipeline at shutdown.
enum ShutdownEvent: Sendable {
    /// Take no more requests.
    case quiesce
    /// Complete `promise` once everything queued for the client is written, or at `deadline`.
    case drain(EventLoopPromise<Void>, deadline: NIODeadline)
}

final class ConnectionRegistry: Sendable {
    private let channels = Locked<[ObjectIdentifier: any Channel]>([:])

    func add(_ channel: any Channel) {
        let id = ObjectIdentifier(channel)
        channels.withLock { $0[id] = channel }
        channel.closeFuture.whenComplete { [self] _ in
            _ = self.channels.withLock { $0.removeValue(forKey: id) }
        }
    }

    var count: Int { channels.withLock { $0.count } }

    private var all: [any Channel] { channels.withLock { Array($0.values) } }

    /// Tells every connection to take no more requests; returns once each has.
    func quiesceAll() async {
        for channel in all {
            try? await channel.eventLoop.submit {
                channel.pipeline.fireUserInboundEventTriggered(ShutdownEvent.quiesce)
            }.get()
        }
    }

    /// Waits until every connection has written what is queued for it, `within` at most.
    func drainAll(within limit: Duration) async {
        let deadline = NIODeadline.now() + .nanoseconds(Int64(limit.components.seconds) * 1_000_000_000 + limit.components.attoseconds / 1_000_000_000)
        let drained = all.map { channel -> EventLoopFuture<Void> in
            let promise = channel.eventLoop.makePromise(of: Void.self)
            // The deadline completes it in any case (a channel closing meanwhile may never see
            // the event); completing a promise twice keeps the first result.
            channel.eventLoop.scheduleTask(deadline: deadline) { promise.succeed(()) }
            channel.pipeline.fireUserInboundEventTriggered(ShutdownEvent.drain(promise, deadline: deadline))
            return promise.futureResult
        }
        for future in drained { try? await future.get() }
    }

    /// Closes every connection and waits until they are closed.
    func closeAll() async {
        let all = self.all
        for channel in all { channel.close(promise: nil) }
        for channel in all { try? await channel.closeFuture.get() }
    }
}
