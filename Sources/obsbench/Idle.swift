// obsbench — `idle`: N connections each subscribed to a key of its own, then idle; prints
// the server's RSS growth per connection (from /proc/PID/status), against obsd or Redis.

import ArgumentParser
import NIOCore
import NIOPosix

struct Idle: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "N idle connections, each subscribed to its own key; prints the server's RSS per connection.")

    @OptionGroup var server: ServerOptions
    @Option(help: "The server's pid.") var pid: Int32
    @Option(help: "Connections.") var connections: Int = 10_000
    @Option(help: "Repository (obsd).") var repo: String = "idle"

    func run() async throws {
        raiseDescriptorLimit()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let loop = group.next()
        let state = PubSubState(redis: server.redis, repo: repo, subscribers: connections, keys: connections, loop: loop)
        // One connection first, so the baseline includes what any first client costs.
        let first = try await connect(server.socket, loop: loop) { SubscriberHandler(index: 0, state: state) }
        try await waitUntil(loop) { state.subscribedCount == 1 }
        let before = try ProcSample.read(pid)
        var channels = [first]
        // In steps of 100, each subscribed before the next: a burst of thousands of connects
        // would overflow the listen backlog (EAGAIN on a Unix socket).
        for i in 1..<connections {
            channels.append(try await connect(server.socket, loop: loop) { SubscriberHandler(index: i, state: state) })
            if i % 100 == 0 { try await waitUntil(loop) { state.subscribedCount == i + 1 } }
        }
        try await state.subscribed.futureResult.get()
        try await Task.sleep(for: .seconds(1))  // let the server settle
        let after = try ProcSample.read(pid)
        let perConnection = Double(after.rssKiB - before.rssKiB) / Double(connections - 1)
        print(
            "idle target=\(server.target) connections=\(connections) rss-before-KiB=\(before.rssKiB) rss-after-KiB=\(after.rssKiB) "
                + "KiB/connection=\(fmt(perConnection))")
        for channel in channels { try? await channel.close() }
        try await group.shutdownGracefully()
    }

    private func waitUntil(_ loop: any EventLoop, _ condition: @escaping @Sendable () -> Bool) async throws {
        while try await !loop.submit(condition).get() { try await Task.sleep(for: .milliseconds(5)) }
    }
}
