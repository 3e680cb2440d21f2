// Test support: a real etcd cluster on loopback — N members (3 by default) on free ports with
// their data in a temporary directory, started with `etcd` from Debian's etcd-server (the
// Makefile's `etcd` target unpacks it into .build/etcd without installing the package, so no
// system etcd runs; an installed one is used too; nothing is installed here), waited for until
// every member says it is healthy, and stopped by PID when the cluster goes away.
//
// Measured on the 2-core machine (etcd 3.4.23, heartbeat 100 ms, election timeout 1000 ms):
// from the first spawn to three healthy members 0.8–1.2 s idle, up to ~2.5 s with the machine
// busy building; each member ~30–65 MB RSS.

import ObservableKit

#if canImport(Glibc)
import Glibc
#endif

public struct EtcdClusterFailure: Error, CustomStringConvertible {
    public let description: String
}

/// A running etcd cluster for a test. Members are addressed by index (0..<count).
public final class EtcdCluster: Sendable {
    /// Where `etcd` is: unpacked by `make etcd` (`.build/etcd` in the package), or installed.
    public static let etcdPath: String? = {
        let package = String(#filePath.dropLast("/Tests/TestSupport/EtcdCluster.swift".count))
        return [package + "/.build/etcd/usr/bin/etcd", "/usr/bin/etcd", "/usr/local/bin/etcd"].first { access($0, X_OK) == 0 }
    }()

    /// Whether tests can start a cluster here.
    public static var isAvailable: Bool { etcdPath != nil }

    /// One member's fixed facts.
    public struct Member: Sendable {
        public let name: String
        public let clientPort: Int
        public let peerPort: Int
        public let dataDir: String
        public let logFile: String
        public var clientURL: String { "http://127.0.0.1:\(clientPort)" }
        var peerURL: String { "http://127.0.0.1:\(peerPort)" }
    }

    public let members: [Member]
    /// The temporary directory holding every member's data and log.
    public let directory: String
    private let processes: Locked<[ChildProcess?]>
    private let token: String

    /// Every member's client URL, in member order.
    public var clientURLs: [String] { members.map(\.clientURL) }

    /// Starts `count` members and waits (up to `timeout`) until each reports healthy. Ports are
    /// picked free just before the start; if another process takes one first, the member
    /// exits and the whole start is retried with new ports (three times at most).
    public static func start(count: Int = 3, timeout: Duration = .seconds(30)) async throws -> EtcdCluster {
        guard let etcd = etcdPath else {
            throw EtcdClusterFailure(description: "etcd is not there (Debian's etcd-server; `make etcd` unpacks it into .build/etcd)")
        }
        var lastFailure = ""
        for _ in 0..<3 {
            let cluster = try EtcdCluster(etcd: etcd, count: count)
            if await cluster.waitHealthy(timeout: timeout) { return cluster }
            lastFailure = cluster.diagnostics()
            cluster.killAll()
            cluster.removeDirectory()
        }
        throw EtcdClusterFailure(description: "etcd cluster did not become healthy within \(timeout):\n\(lastFailure)")
    }

    private let started: ContinuousClock.Instant
    private let startDurationBox = Locked<Duration?>(nil)

    private init(etcd: String, count: Int) throws {
        var template = Array("/tmp/obsd-etcd-XXXXXX".utf8CString)
        guard let dir = template.withUnsafeMutableBufferPointer({ mkdtemp($0.baseAddress!) }) else {
            throw EtcdClusterFailure(description: "mkdtemp: \(String(cString: strerror(errno)))")
        }
        directory = String(cString: dir)
        let ports = try Self.freePorts(2 * count)
        members = (0..<count).map { i in
            Member(
                name: "m\(i)", clientPort: ports[2 * i], peerPort: ports[2 * i + 1], dataDir: "\(String(cString: dir))/m\(i)",
                logFile: "\(String(cString: dir))/m\(i).log")
        }
        token = "obsd-test-\(getpid())-\(ports[0])"
        processes = Locked(Array(repeating: nil, count: count))
        started = .now
        for i in 0..<count { try spawn(i, etcd: etcd) }
    }

    deinit {
        killAll()
        removeDirectory()
    }

    // MARK: - Members

    /// Whether member `i`'s process runs.
    public func isRunning(_ i: Int) -> Bool {
        processes.withLock { $0[i]?.isRunning ?? false }
    }

    /// The PID of member `i`, if it runs.
    public func pid(_ i: Int) -> pid_t? {
        processes.withLock { $0[i].flatMap { $0.isRunning ? $0.pid : nil } }
    }

    /// Stops member `i` with SIGTERM (SIGKILL after `grace`), and waits for it.
    public func stop(_ i: Int, grace: Duration = .seconds(10)) {
        let process = processes.withLock { p in
            defer { p[i] = nil }
            return p[i]
        }
        process?.stop(grace: grace)
    }

    /// Kills member `i` with SIGKILL, and waits for it.
    public func kill(_ i: Int) {
        let process = processes.withLock { p in
            defer { p[i] = nil }
            return p[i]
        }
        process?.kill9()
    }

    /// Freezes member `i` (SIGSTOP): its sockets stay open and it answers nothing, as a hung
    /// member or a dead network path would.
    public func pause(_ i: Int) {
        processes.withLock { $0[i] }?.signal(SIGSTOP)
    }

    /// Lets a paused member go on (SIGCONT).
    public func resume(_ i: Int) {
        processes.withLock { $0[i] }?.signal(SIGCONT)
    }

    /// Starts member `i` again on its ports and data (after `stop` or `kill`); does not wait.
    public func restart(_ i: Int) throws {
        guard let etcd = Self.etcdPath else { throw EtcdClusterFailure(description: "etcd is not installed") }
        if isRunning(i) { return }
        try spawn(i, etcd: etcd)
    }

    /// Whether every running member (or those in `only`) reports healthy within `timeout`:
    /// `GET /health` answers `"health":"true"`, which etcd 3.4 says only with a leader and a
    /// committed read.
    public func waitHealthy(_ only: [Int]? = nil, timeout: Duration = .seconds(20)) async -> Bool {
        let indices = only ?? Array(members.indices)
        let healthy = await eventually(timeout: timeout, every: .milliseconds(50)) { () async -> Bool in
            indices.allSatisfy { isRunning($0) && Self.isHealthy(port: members[$0].clientPort) }
        }
        if healthy { startDurationBox.withLock { if $0 == nil { $0 = .now - started } } }
        return healthy
    }

    /// From the spawn of the first member to the first time every member was healthy.
    public var measuredStartDuration: Duration? { startDurationBox.withLock { $0 } }

    /// The last lines of every member's log, for a failure message.
    public func diagnostics(lines: Int = 15) -> String {
        members.enumerated().map { i, member in
            let state = isRunning(i) ? "running" : "not running"
            return "--- \(member.name) (\(member.clientURL), \(state)) \(member.logFile):\n" + Self.tail(member.logFile, lines: lines)
        }.joined(separator: "\n")
    }

    // MARK: - Processes

    private func spawn(_ i: Int, etcd: String) throws {
        let member = members[i]
        let cluster = members.map { "\($0.name)=\($0.peerURL)" }.joined(separator: ",")
        let arguments = [
            "--name", member.name, "--data-dir", member.dataDir,
            "--listen-client-urls", member.clientURL, "--advertise-client-urls", member.clientURL,
            "--listen-peer-urls", member.peerURL, "--initial-advertise-peer-urls", member.peerURL,
            "--initial-cluster", cluster, "--initial-cluster-token", token, "--initial-cluster-state", "new",
            "--heartbeat-interval", "100", "--election-timeout", "1000",
            "--logger", "zap", "--log-outputs", "stderr",
        ]
        // A clean environment: etcd reads ETCD_* variables as flags.
        let environment = ["PATH": "/usr/bin:/bin"]
        let process = try ChildProcess(
            etcd, arguments, environment: environment, stdout: .file(member.logFile), stderr: .file(member.logFile))
        processes.withLock { $0[i] = process }
    }

    private func killAll() {
        let all = processes.withLock { p in
            defer { p = Array(repeating: nil, count: p.count) }
            return p
        }
        for process in all { process?.kill9() }
    }

    private func removeDirectory() {
        guard directory.hasPrefix("/tmp/obsd-etcd-") else { return }
        if let rm = try? ChildProcess("/bin/rm", ["-rf", directory]) { rm.wait(timeout: .seconds(30)) }
    }

    // MARK: - Sockets

    /// `count` distinct free loopback TCP ports: bound together to port 0, then released.
    static func freePorts(_ count: Int) throws -> [Int] {
        var sockets: [Int32] = []
        defer { for s in sockets { close(s) } }
        var ports: [Int] = []
        for _ in 0..<count {
            let s = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            guard s >= 0 else { throw EtcdClusterFailure(description: "socket: \(String(cString: strerror(errno)))") }
            sockets.append(s)
            var address = sockaddr_in()
            address.sin_family = sa_family_t(AF_INET)
            address.sin_addr.s_addr = inet_addr("127.0.0.1")
            address.sin_port = 0
            var length = socklen_t(MemoryLayout<sockaddr_in>.size)
            let bound = withUnsafeMutablePointer(to: &address) { p in
                p.withMemoryRebound(to: sockaddr.self, capacity: 1) { sa in
                    bind(s, sa, length) == 0 && getsockname(s, sa, &length) == 0
                }
            }
            guard bound else { throw EtcdClusterFailure(description: "bind: \(String(cString: strerror(errno)))") }
            ports.append(Int(UInt16(bigEndian: address.sin_port)))
        }
        return ports
    }

    /// `GET /health` on 127.0.0.1:`port`, answered `"health":"true"` within two seconds.
    static func isHealthy(port: Int) -> Bool {
        let s = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard s >= 0 else { return false }
        defer { close(s) }
        var timeout = timeval(tv_sec: 2, tv_usec: 0)
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(port).bigEndian
        let connected = withUnsafePointer(to: &address) { p in
            p.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(s, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
        guard connected else { return false }
        let request = Array("GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".utf8)
        guard send(s, request, request.count, Int32(MSG_NOSIGNAL)) == request.count else { return false }
        var answer: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        while answer.count < 65536 {
            let n = recv(s, &chunk, chunk.count, 0)
            if n <= 0 { break }
            answer += chunk[0..<n]
        }
        let text = String(decoding: answer, as: UTF8.self)
        return text.hasPrefix("HTTP/1.") && text.contains("\"health\":\"true\"")
    }

    static func tail(_ path: String, lines: Int) -> String {
        guard let file = fopen(path, "r") else { return "(no log)" }
        defer { fclose(file) }
        var all: [String] = []
        var buffer = [CChar](repeating: 0, count: 8192)
        while fgets(&buffer, Int32(buffer.count), file) != nil {
            all.append(buffer.withUnsafeBufferPointer { String(cString: $0.baseAddress!) })
            if all.count > lines * 4 { all.removeFirst(all.count - lines) }
        }
        return all.suffix(lines).joined()
    }
}
