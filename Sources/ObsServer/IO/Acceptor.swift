// ObsServer — accepting connections: the listening sockets live on the first loop, which
// accepts in batches and hands each new connection to the loops in turn.
//
// When the process runs out of descriptors (EMFILE, ENFILE), the listening socket stays
// readable and accepting again at once would spin: the acceptor stops watching it for a
// tenth of a second, and says so in the log once per episode.

import CLinux
import Logging

#if canImport(Glibc)
import Glibc
#endif

final class Acceptor: @unchecked Sendable {
    // @unchecked Sendable: created before the loops run, then used only on the first loop
    // (`listen`, `ready`, `close` run in its tasks and handlers).

    private let loops: [Loop]
    private let hub: Hub
    private let runtime: Runtime
    private let logger: Logger
    private var listeners: [Listening] = []
    private var next = 0
    private var starved = false

    init(loops: [Loop], hub: Hub, runtime: Runtime, logger: Logger) {
        self.loops = loops
        self.hub = hub
        self.runtime = runtime
        self.logger = logger
    }

    private var home: IOLoop { loops[0].io }

    /// One listening socket.
    private final class Listening: IOHandler {
        let fd: Int32
        var slot = -1
        unowned let acceptor: Acceptor

        init(fd: Int32, acceptor: Acceptor) {
            self.fd = fd
            self.acceptor = acceptor
        }

        func ready(_ events: UInt32) { acceptor.accept(from: self) }
    }

    /// Accepts connections on `fd` (on the first loop).
    func listen(on fd: Int32) {
        let listening = Listening(fd: fd, acceptor: self)
        do {
            listening.slot = try home.register(fd, listening, events: EPOLLIN.rawValue)
            listeners.append(listening)
        } catch {
            logger.error("cannot accept connections on socket \(fd): \(error)")
        }
    }

    private func accept(from listening: Listening) {
        for _ in 0..<64 {
            let fd = obs_accept(listening.fd)
            if fd >= 0 {
                starved = false
                let loop = loops[next % loops.count]
                next &+= 1
                let limits = runtime.snapshot.limits
                let (hub, logger) = (self.hub, self.logger)
                let start: @Sendable () -> Void = {
                    Connection(fd: fd, shard: loop.shard, hub: hub, registry: loop.connections, limits: limits, logger: logger)
                        .start(limits: limits)
                }
                if loop.io === home { start() } else { loop.io.execute(start) }
                continue
            }
            switch errno {
            case EINTR, ECONNABORTED, EPROTO:
                continue
            case EMFILE, ENFILE, ENOBUFS, ENOMEM:
                if !starved {
                    starved = true
                    logger.error(
                        "cannot accept connections: \(String(cString: strerror(errno))); pausing accepts (raise LimitNOFILE= or limits.max-connections' descriptor budget)")
                }
                home.modify(listening.fd, slot: listening.slot, events: 0)
                home.schedule(in: 100_000_000) { [weak self] in
                    guard let self, self.listeners.contains(where: { $0 === listening }) else { return }
                    self.home.modify(listening.fd, slot: listening.slot, events: EPOLLIN.rawValue)
                }
                return
            default:
                return  // EAGAIN: none left
            }
        }
    }

    /// Stops accepting and closes the listening sockets.
    func close() {
        for listening in listeners {
            home.deregister(listening.fd, slot: listening.slot)
            Glibc.close(listening.fd)
        }
        listeners.removeAll()
    }
}
