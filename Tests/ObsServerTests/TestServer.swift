// What the ObsServer tests share: the daemon's state in process — a `Hub` over event loops
// the test runs itself, on its own thread, one iteration at a time until they are idle — and
// client connections over socket pairs, served by the daemon's real `Connection`. Time moves
// only when a test says so (the loops' clock is a manual one). Nothing here sleeps.

import CLinux
import Logging
import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import Testing

@testable import ObsServer

#if canImport(Glibc)
import Glibc
#endif

extension Limits {
    /// The daemon's defaults, for in-process tests.
    static let testing = Limits()
}

/// The peer of test connections: this process's own user (privileged, like the daemon's uid).
let testPeer = Peer(uid: getuid(), gid: getgid(), pid: getpid(), daemonUID: getuid())

/// A logger that drops everything (refusals log at notice level).
let quietLogger = Logger(label: "obsd-test") { _ in SwiftLogNoOpLogHandler() }

/// A clock the test moves (nanoseconds).
final class ManualClock: Sendable {
    private let value = Atomic<UInt64>(1_000_000_000)
    var now: UInt64 { value.load(ordering: .relaxed) }
    func advance(by duration: Duration) {
        let (s, a) = duration.components
        value.add(UInt64(s) * 1_000_000_000 + UInt64(a / 1_000_000_000), ordering: .relaxed)
    }
}

/// The daemon's state over `loops` event loops that the test runs.
final class TestServer {
    let loops: [Loop]
    let hub: Hub
    let clock = ManualClock()
    let limits: Limits

    init(storage: any Storage = InMemoryStorage(), limits: Limits = .testing, loops count: Int = 1, delivery: DeliveryBudget = DeliveryBudget()) throws {
        let clock = self.clock
        loops = try (0..<count).map { i in try Loop(index: i, delivery: delivery, clock: { clock.now }) }
        hub = try Hub(
            shards: loops.map(\.shard), historyLimits: HistoryLimits(count: 100, maxBytes: 64 << 20, maxAge: nil), storage: storage,
            runtime: Runtime(limits: limits, policy: .open))
        self.limits = limits
        if let shared = storage as? any SharedStorage, let delivery = hub.delivery { shared.start(delivering: delivery) }
    }

    /// The lease table of a hub on local storage.
    var leaseTable: LeaseTable {
        get throws { try #require(hub.leases as? LocalLeases).table }
    }

    /// Runs loop `index` (every loop: nil) until it has nothing left to do.
    func run(_ index: Int? = nil) {
        let chosen = index.map { [loops[$0]] } ?? loops
        var idle = 0
        while idle < 2 {
            var worked = false
            for loop in chosen where loop.io.runOnce(maxWait: 0) { worked = true }
            idle = worked ? 0 : idle + 1
        }
    }

    /// Moves the loops' clock on, then runs them.
    func advanceTime(by duration: Duration) {
        clock.advance(by: duration)
        run()
    }
}

/// Storage that takes what it is given and reports durability only when the test says so
/// (`durable` / `failed` on the listeners — a repository, the lease table — called by the test
/// as the committer would; `confirmAll` tells every listener everything it queued is durable).
final class ManualStorage: Storage {
    private let queued = Locked<[(listener: any DurabilityListener, sequence: UInt64)]>([])
    var isImmediate: Bool { false }
    var summary: String { "manual (test)" }
    var counters: StorageCounters? { nil }
    var notices: [String] { [] }
    func load() -> [LoadedRepository] { [] }
    func append(_ frame: LogFrame, sequence: UInt64, listener: any DurabilityListener) -> Bool {
        queued.withLock { $0.append((listener, sequence)) }
        return true
    }
    func discard(_ listener: any DurabilityListener, after sequence: UInt64) {
        queued.withLock { $0.removeAll { $0.listener === listener && $0.sequence > sequence } }
    }
    func close() {}

    /// Tells each listener that everything it queued so far is durable.
    func confirmAll() {
        let last = queued.withLock { q -> [(any DurabilityListener, UInt64)] in
            defer { q.removeAll() }
            var last: [ObjectIdentifier: (any DurabilityListener, UInt64)] = [:]
            for (listener, sequence) in q { last[ObjectIdentifier(listener)] = (listener, max(sequence, last[ObjectIdentifier(listener)]?.1 ?? 0)) }
            return Array(last.values)
        }
        for (listener, sequence) in last { listener.durable(through: sequence) }
    }
}

/// One client connection over a socket pair, the daemon's end served by a `Connection` on
/// one of the test server's loops. Socket buffers are small, so a client that stops reading
/// fills them soon (`setWritable(false)`).
final class TestConnection {
    let server: TestServer
    let loopIndex: Int
    private(set) var connection: Connection!
    private var fd: Int32
    private var partial: [UInt8] = []
    /// How much of `partial` holds no newline.
    private var scanned = 0
    private var stashed: [JSONValue] = []
    private var endOfFile = false
    private var bytesRead = 0

    init(_ server: TestServer, loop: Int = 0, limits: Limits? = nil, peer: Peer? = testPeer) throws {
        self.server = server
        self.loopIndex = loop
        var pair: [Int32] = [0, 0]
        guard socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair) == 0 else {
            throw TestError("socketpair: \(errno)")
        }
        fd = pair[0]
        var small: Int32 = 4096
        setsockopt(pair[1], SOL_SOCKET, SO_SNDBUF, &small, socklen_t(MemoryLayout<Int32>.size))
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, socklen_t(MemoryLayout<Int32>.size))
        let loop = server.loops[loop]
        let connection = Connection(
            fd: pair[1], shard: loop.shard, hub: server.hub, registry: loop.connections, limits: limits ?? server.limits, logger: quietLogger)
        connection.start(limits: limits ?? server.limits) { _ in peer }
        self.connection = connection
        server.run()
    }

    deinit { if fd >= 0 { Glibc.close(fd) } }

    /// The client closes its socket.
    func close() {
        if fd >= 0 { Glibc.close(fd) }
        fd = -1
        server.run()
    }

    /// Whether the daemon still serves the connection.
    var isActive: Bool { !connection.isClosed }
    var outbox: Outbox { connection.outbox }

    /// Writes `text`, then (unless `run` is false) runs the loops until idle.
    func send(_ text: String, run: Bool = true) throws {
        var bytes = Array(text.utf8)
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeMutableBytes { Glibc.write(fd, $0.baseAddress! + offset, $0.count - offset) }
            if n < 0, errno == EAGAIN {
                server.run()  // a line longer than the socket's buffers: the daemon reads on
                continue
            }
            guard n > 0 else { throw TestError("write to the daemon failed: \(errno)") }
            offset += n
        }
        bytes.removeAll()
        if run { server.run() }
    }

    /// The complete messages the daemon wrote since the last call — after running every loop
    /// until idle, or only loop `running`, or (`nil`) none.
    func received(running: Int?? = .some(nil)) throws -> [JSONValue] {
        // What the socket could not take yet is sent once the client has read: run and read
        // until nothing more comes.
        var quiet = false
        while !quiet {
            let before = bytesRead
            switch running {
            case .none: break
            case .some(.none): server.run()
            case .some(.some(let index)): server.run(index)
            }
            try readAvailable()
            quiet = bytesRead == before || running == .none
        }
        defer { stashed.removeAll() }
        return stashed
    }

    /// Runs loop `running` (and `alsoRunning`, if given) until `count` messages arrived, for
    /// answers that come from another thread (the shared store's tasks).
    /// Suspends between looks, so the tasks it waits for get the thread this test runs on.
    ///
    /// It gives up after ten seconds *and* 2,000 looks. The clock alone would lie: those tasks
    /// and this test share Swift's cooperative pool (two threads here), which tests that block
    /// their thread can keep busy for longer than ten seconds under a sanitizer — neither this
    /// test nor the task it waits for runs then. Each look suspends after the store's task was
    /// queued, so 2,000 looks are 2,000 turns that task had.
    func receive(running: Int, count: Int, alsoRunning other: Int? = nil) async throws -> [JSONValue] {
        let deadline = ContinuousClock.now + .seconds(10)
        var messages: [JSONValue] = []
        var looks = 0
        while messages.count < count {
            guard looks < 2000 || ContinuousClock.now < deadline else {
                throw TestError("got \(messages.count) of \(count) messages after \(looks) looks: \(messages)")
            }
            looks += 1
            server.loops[running].io.runOnce(maxWait: 0)
            if let other { server.run(other) }
            messages += try received(running: running)
            if messages.count < count { try await Task.sleep(for: .milliseconds(1)) }
        }
        return messages
    }

    /// Whether the daemon closed its side (end of file after everything it wrote).
    func sawEndOfFile() throws -> Bool {
        server.run()
        try readAvailable()
        return endOfFile
    }

    private func readAvailable() throws {
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = chunk.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress!, $0.count) }
            if n > 0 {
                partial += chunk[..<n]
                bytesRead += n
                continue
            }
            if n == 0 { endOfFile = true }
            break
        }
        // Only bytes not looked at yet are searched (a long message arrives in many reads).
        while let newline = partial[min(scanned, partial.count)...].firstIndex(of: UInt8(ascii: "\n")) {
            let message = try JSONParser.parse(Array(partial[..<newline]))
            partial.removeSubrange(...newline)
            scanned = 0
            if message["id"] != .string("fill") { stashed.append(message) }
        }
        scanned = partial.count
    }

    /// `false`: the client stops reading, and the socket fills — pings (answered, then
    /// dropped from what `received` returns) until the daemon holds output the socket does not
    /// take. `true`: the client reads again until the daemon has written everything.
    func setWritable(_ writable: Bool) throws {
        if writable {
            var quiet = 0
            while quiet < 2 {
                let before = bytesRead
                server.run()
                try readAvailable()
                quiet = bytesRead == before && (!isActive || outbox.queuedBytes == 0) ? quiet + 1 : 0
            }
            return
        }
        var sent = 0
        while outbox.queuedBytes == 0 {
            try send(lines(#"{"id":"fill","op":"ping"}"#))
            sent += 1
            guard sent < 10_000 else { throw TestError("the socket never filled") }
        }
    }

    /// The client shuts down its sending side: end of file, the connection still open.
    func shutdownInput() {
        shutdown(fd, Int32(SHUT_WR))
        server.run()
    }
}

struct TestError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
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
    var errorMessage: String? { self["error"]?["message"]?.stringValue }
}

extension Array {
    /// The one element, if there is exactly one.
    var only: Element? { count == 1 ? first : nil }
}
