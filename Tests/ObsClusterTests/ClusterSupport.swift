// ObsClusterTests support: real `obsd` binaries on temporary sockets sharing a real 3-member
// etcd cluster (TestSupport's EtcdCluster), subscriptions recorded so a test can await
// events with a deadline, and the etcd leader found by asking each member.
//
// Every process a test starts is stopped by PID: `ClusterPair.stop()` in the test's `defer`,
// and the daemons' and the cluster's `deinit` (SIGKILL) should a test throw before that.

import Foundation
import ObsClient
import ObsEtcd
import ObsProtocol
import ObservableKit
import Synchronization
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// The reason the suite is skipped where etcd is missing.
let etcdMissing: Comment = "etcd is not there (Debian's etcd-server; `make etcd` unpacks it into .build/etcd)"

struct ClusterTestFailure: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}

/// One `obsd` process on a temporary socket, with its repositories in etcd.
final class ClusterDaemon: Sendable {
    let name: String
    let directory: String
    let socketPath: String
    let logPath: String
    let commandLine: [String]
    private let process = Mutex<ChildProcess?>(nil)

    init(name: String, endpoints: [String], prefix: String, extra: [String] = []) {
        var template = Array("/tmp/obsd-cluster-XXXXXX".utf8CString)
        directory = template.withUnsafeMutableBufferPointer { String(cString: mkdtemp($0.baseAddress!)) }
        self.name = name
        socketPath = directory + "/obsd.sock"
        logPath = directory + "/obsd.log"
        commandLine = [
            "--socket", socketPath, "--log-level", "debug", "--etcd-endpoints", endpoints.joined(separator: ","), "--etcd-prefix", prefix,
        ] + extra
    }

    /// Starts the process (again, after `kill9` or `stop`) and waits until it answers `ping`
    /// (obsd listens only once it has read the cluster).
    func launch(timeout: Duration = .seconds(30)) async throws {
        try spawn()
        try await waitUntilServing(timeout: timeout)
    }

    /// Starts the process without waiting for it.
    func spawn() throws {
        let child = try ChildProcess(BuildProducts.path("obsd"), commandLine, stdout: .file(logPath), stderr: .file(logPath))
        process.withLock { $0 = child }
    }

    /// Waits until the process answers `ping`.
    func waitUntilServing(timeout: Duration = .seconds(30)) async throws {
        guard let child = process.withLock({ $0 }) else { throw ClusterTestFailure("obsd \(name) was not started") }
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            guard child.isRunning else { throw ClusterTestFailure("obsd \(name) exited (\(child.terminationStatus)) before serving:\n\(log)") }
            if let client = try? await ObsConnection.connect(socketPath: socketPath) {
                let answered = (try? await client.ping()) != nil
                await client.close()
                if answered { return }
            }
            try await Task.sleep(for: .milliseconds(20))
        }
        throw ClusterTestFailure("obsd \(name) did not serve \(socketPath) within \(timeout):\n\(log)")
    }

    var pid: pid_t? { process.withLock { $0?.pid } }

    var isRunning: Bool { process.withLock { $0?.isRunning ?? false } }

    /// The exit status, once the process exited by itself.
    var exitCode: Int32? { process.withLock { $0?.exitCode } }

    /// SIGTERM, SIGKILL after `grace`; waits for the exit.
    func stop(grace: Duration = .seconds(10)) {
        let child = process.withLock { p in
            defer { p = nil }
            return p
        }
        _ = child?.stop(grace: grace)
    }

    /// Sends `sig` (SIGSTOP freezes the daemon, SIGCONT lets it go on).
    func signal(_ sig: Int32) {
        process.withLock { $0 }?.signal(sig)
    }

    /// SIGKILL; waits for the exit.
    func kill9() {
        let child = process.withLock { p in
            defer { p = nil }
            return p
        }
        child?.kill9()
    }

    var log: String { (try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "" }

    /// Whether something accepts connections on the socket now.
    var isServing: Bool {
        get async {
            guard let client = try? await ObsConnection.connect(socketPath: socketPath) else { return false }
            await client.close()
            return true
        }
    }

    func client() async throws -> ObsConnection { try await ObsConnection.connect(socketPath: socketPath) }

    deinit {
        process.withLock { $0 }?.kill9()
        if directory.hasPrefix("/tmp/obsd-cluster-") { try? FileManager.default.removeItem(atPath: directory) }
    }
}

/// A 3-member etcd cluster and two daemons A and B on it, under one prefix.
struct ClusterPair {
    let etcd: EtcdCluster
    let a: ClusterDaemon
    let b: ClusterDaemon
    let prefix = "/obsd-test/"

    /// Starts the cluster, then A and B (`extra` arguments for both). `bOnItsOwnMember`: A
    /// talks to members 0 and 1 only and B to member 2 only, so that stopping B and member 2
    /// cuts B off while A writes.
    static func start(extra: [String] = [], bOnItsOwnMember: Bool = false) async throws -> ClusterPair {
        let etcd = try await EtcdCluster.start()
        let (endpointsA, endpointsB) = bOnItsOwnMember ? (Array(etcd.clientURLs.prefix(2)), [etcd.clientURLs[2]]) : (etcd.clientURLs, etcd.clientURLs)
        let a = ClusterDaemon(name: "A", endpoints: endpointsA, prefix: "/obsd-test/", extra: extra)
        let b = ClusterDaemon(name: "B", endpoints: endpointsB, prefix: "/obsd-test/", extra: extra)
        let pair = ClusterPair(etcd: etcd, a: a, b: b)
        do {
            try await a.launch()
            try await b.launch()
        } catch {
            pair.stop()
            throw error
        }
        return pair
    }

    /// Stops both daemons (B continued first, if a test stopped it) and every etcd member, by PID.
    func stop() {
        b.signal(SIGCONT)
        a.stop()
        b.stop()
        for i in etcd.members.indices { etcd.kill(i) }
    }

    /// Both daemons' logs and the members' last lines, for a failure message.
    var diagnostics: String {
        "--- obsd A:\n\(a.log.suffix(4000))\n--- obsd B:\n\(b.log.suffix(4000))\n\(etcd.diagnostics())"
    }

    /// A client of the etcd cluster itself (to find the leader, to compact).
    func etcdClient(requestTimeout: Duration = .seconds(5)) throws -> EtcdClient {
        try Self.etcdClient(etcd, requestTimeout: requestTimeout)
    }

    /// A client of every member of `etcd`, in member order.
    static func etcdClient(_ etcd: EtcdCluster, requestTimeout: Duration = .seconds(5)) throws -> EtcdClient {
        var configuration = try EtcdClient.Configuration(endpoints: etcd.clientURLs)
        configuration.requestTimeout = requestTimeout
        return try EtcdClient(configuration: configuration)
    }

    /// The index of the member that is leader, asking each running member.
    func leader(using client: EtcdClient) async -> Int? {
        for i in etcd.members.indices where etcd.isRunning(i) {
            if let status = try? await client.status(endpoint: i, timeout: .seconds(2)), status.isLeader { return i }
        }
        return nil
    }
}

/// Records a subscription's events in its own task, so a test can await a condition on them
/// with a deadline (the iterator cannot be raced against a timer directly).
final class EventLog: Sendable {
    private final class Box: Sendable {
        let value = Mutex<(events: [SubscriptionEvent], failure: String?, ended: Bool)>(([], nil, false))
    }

    private let box = Box()
    private let task: Task<Void, Never>
    let subscription: Subscription

    init(_ subscription: Subscription) {
        self.subscription = subscription
        let box = self.box
        task = Task {
            do {
                for try await event in subscription { box.value.withLock { $0.events.append(event) } }
                box.value.withLock { $0.ended = true }
            } catch {
                box.value.withLock {
                    $0.failure = "\(error)"
                    $0.ended = true
                }
            }
        }
    }

    var events: [SubscriptionEvent] { box.value.withLock { $0.events } }
    var failure: String? { box.value.withLock { $0.failure } }

    /// The change events, in arrival order.
    var changes: [ChangeEvent<JSONValue>] {
        events.compactMap { if case .change(let c) = $0 { return c } else { return nil } }
    }

    /// Whether `condition` holds of the events within `timeout` (a failure guard: the
    /// condition is checked as events arrive, every 5 ms).
    func wait(timeout: Duration = .seconds(15), _ condition: @escaping @Sendable ([SubscriptionEvent]) -> Bool) async -> Bool {
        await eventually(timeout: timeout, every: .milliseconds(5)) { () async -> Bool in condition(self.events) }
    }

    /// Whether a change at `revision` (or later) arrived within `timeout`.
    func wait(forRevision revision: UInt64, timeout: Duration = .seconds(15)) async -> Bool {
        await wait(timeout: timeout) { events in
            events.contains { if case .change(let c) = $0 { c.revision >= revision } else { false } }
        }
    }

    func cancel() { task.cancel() }

    deinit { task.cancel() }
}

/// A JSON value from an integer.
func int(_ i: Int) -> JSONValue { .int(Int64(i)) }
