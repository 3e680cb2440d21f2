// obsbench — `idle`: N connections each subscribed to a key of its own, then idle; prints
// the server's RSS growth per connection (from /proc/PID/status), against obsd or Redis.
// On the raw engine (Raw/Engine.swift): the load generator keeps no per-connection buffers
// beyond a small carry, so 10,000 connections cost it little.

import ArgumentParser

#if canImport(Glibc)
import Glibc
#endif

struct Idle: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "N idle connections, each subscribed to its own key; prints the server's RSS per connection.")

    @OptionGroup var server: ServerOptions
    @Option(help: "The server's pid.") var pid: Int32
    @Option(help: "Connections.") var connections: Int = 10_000
    @Option(help: "Repository (obsd).") var repo: String = "idle"

    func validate() throws {
        guard connections > 1 else { throw ValidationError("--connections must be at least 2") }
        try validateRepository(repo)
    }

    func run() throws {
        raiseDescriptorLimit()
        let dialect = server.dialect
        var engine = try Engine(
            dialect: dialect, connections: connections, requests: RequestTable(dialect: dialect, verb: .set, repo: repo, keys: []))
        func subscribe(_ i: Int, _ engine: inout Engine) throws(BenchError) {
            try engine.addSubscriber(socket: server.socket, key: i, request: RequestTable.subscribe(dialect, repo: repo, key: "k\(i)"))
        }
        // One connection first, so that the baseline includes what any first client costs.
        try subscribe(0, &engine)
        try engine.waitForSubscriptions(1)
        let before = try ProcSample.read(pid)
        // In steps of 100, each subscribed before the next: a burst of thousands of connects
        // would overflow the listen backlog.
        for i in 1..<connections {
            try subscribe(i, &engine)
            if i % 100 == 0 { try engine.waitForSubscriptions(i + 1) }
        }
        try engine.waitForSubscriptions(connections)
        engine.serve(seconds: 1)  // let the server settle
        if let failure = engine.failure { throw BenchError(failure) }
        let after = try ProcSample.read(pid)
        let perConnection = Double(after.rssKiB - before.rssKiB) / Double(connections - 1)
        print(
            "idle target=\(server.target) connections=\(connections) rss-before-KiB=\(before.rssKiB) rss-after-KiB=\(after.rssKiB) "
                + "KiB/connection=\(fmt(perConnection))")
    }
}
