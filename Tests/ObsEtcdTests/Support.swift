// ObsEtcdTests support: clients of a test cluster, a watch recorder that a test awaits with a
// deadline, and small byte helpers.

import ObsEtcd
import Testing
import Synchronization
import TestSupport

/// The reason the suites are skipped where etcd is missing.
let etcdMissing: Comment = "etcd is not there (Debian's etcd-server; `make etcd` unpacks it into .build/etcd)"

func bytes(_ s: String) -> [UInt8] { Array(s.utf8) }

func text(_ b: [UInt8]) -> String { String(decoding: b, as: UTF8.self) }

extension EtcdCluster {
    /// A client of the members `order` (default: all, in member order).
    func client(_ order: [Int]? = nil, requestTimeout: Duration = .seconds(5)) throws -> EtcdClient {
        var configuration = try EtcdClient.Configuration(endpoints: (order ?? Array(members.indices)).map { members[$0].clientURL })
        configuration.requestTimeout = requestTimeout
        return try EtcdClient(configuration: configuration)
    }

    /// The index of the member that is leader, asking each running member.
    func leader(using client: EtcdClient) async -> Int? {
        for i in members.indices where isRunning(i) {
            if let status = try? await client.status(endpoint: i, timeout: .seconds(2)), status.isLeader { return i }
        }
        return nil
    }

    /// Starts a test cluster, or fails the test with the members' logs.
    static func started() async throws -> EtcdCluster {
        try await EtcdCluster.start()
    }
}

/// Iterates a watch in its own task and records what arrives, so a test can wait for a number
/// of responses with a deadline (the iterator cannot be raced against a timer directly).
final class WatchRecorder: Sendable {
    /// What arrived, and how the watch ended.
    private final class Record: Sendable {
        let value = Mutex<(responses: [EtcdWatchResponse], error: EtcdError?, ended: Bool)>(([], nil, false))
        func append(_ r: EtcdWatchResponse) { value.withLock { $0.responses.append(r) } }
        func end(_ e: EtcdError?) { value.withLock { $0 = ($0.responses, e, true) } }
    }

    private let box = Record()
    private let task: Task<Void, Never>

    init(_ watch: EtcdWatch) {
        let box = self.box
        task = Task {
            do {
                for try await response in watch { box.append(response) }
                box.end(nil)
            } catch let error as EtcdError {
                box.end(error)
            } catch {
                box.end(.invalidResponse("not an EtcdError: \(error)"))
            }
        }
    }

    var responses: [EtcdWatchResponse] { box.value.withLock { $0.responses } }
    var error: EtcdError? { box.value.withLock { $0.error } }
    var ended: Bool { box.value.withLock { $0.ended } }

    /// Whether at least `count` responses arrived within `timeout`.
    func wait(forCount count: Int, timeout: Duration = .seconds(15)) async -> Bool {
        await eventually(timeout: timeout, every: .milliseconds(5)) { () async -> Bool in self.responses.count >= count }
    }

    /// Whether the watch ended within `timeout`.
    func waitEnded(timeout: Duration = .seconds(15)) async -> Bool {
        await eventually(timeout: timeout, every: .milliseconds(5)) { () async -> Bool in self.ended }
    }

    /// Every event's revision, in arrival order.
    var revisions: [Int64] { responses.filter { !$0.isProgress }.map(\.revision) }

    func cancel() { task.cancel() }

    deinit { task.cancel() }
}
