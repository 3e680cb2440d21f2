// ObsStore — failpoints: faults compiled into the daemon and armed only by the test-only
// environment variable OBSD_FAILPOINTS, the way etcd's gofail arms its own. The robustness
// suite (robustness/README.md) uses them to fail the write-ahead log's system calls on a
// schedule (EIO, a full disk), to tear its last write and crash, to crash in the middle of a
// checkpoint or at a segment roll-over, to shrink the segment and snapshot thresholds so that
// those happen every few seconds, and — in its self-tests only — to break the daemon on
// purpose (a write acknowledged but never stored, a TTL that ends early) so that each
// validator is seen to catch the defect.
//
// Unset (every production start), `Failpoints.shared` is nil: the store uses the system's
// calls directly (`SystemFileOperations`) and no code path below runs.
//
// Syntax: `OBSD_FAILPOINTS="name=action[@modifier]…;name=action…"`, or `@/path/file` to read
// the same text from a file, read again whenever the file changes (checked at most every
// 10 ms), so a test can arm and disarm faults while the daemon runs. Actions: `off`,
// `error(EIO|ENOSPC|EROFS|EDQUOT|<number>)`, `crash` (SIGKILL at that point), `torn` (a write
// stores only its first half, then SIGKILL), `drop` (a write or sync reports success and does
// nothing), `sleep(ms)`, `value(n)` (a tunable), `early(ms)` (a deadline that many ms early).
// Modifiers: `@p0.01` (probability per hit), `@after(n)` (skip the first n hits), `@times(n)`
// (trigger at most n times). `OBSD_FAILPOINTS_SEED` seeds the probabilities. Read from a file,
// each trigger appends a line (`name action`) to `<file>.fired`, so that a test can wait for a
// fault that has no effect it could see (a dropped write) before it goes on.
//
// Points: `wal.open` (a new segment), `wal.write`, `wal.fdatasync`, `wal.ftruncate`,
// `checkpoint.commit` (a new snapshot written, not yet renamed in place), `lease.expire`
// (early), and the tunables `store.segment-size`, `store.snapshot-log-bytes`,
// `store.checkpoint-interval-ms`.

import ObservableKit
import SystemPackage

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

public final class Failpoints: Sendable {
    /// What a point does when it triggers.
    public enum Action: Sendable, Equatable {
        case off
        case error(Int32)
        case crash
        case torn
        case drop
        case sleep(milliseconds: Int)
        case value(Int)
        case early(milliseconds: Int)
    }

    struct Point: Sendable {
        var action: Action
        var probability = 1.0
        var after = 0
        var times = Int.max
        var hits = 0
        var triggered = 0
    }

    struct State: Sendable {
        var points: [String: Point] = [:]
        var rng: UInt64
        /// The file the spec is read from (nil: the environment's text, fixed).
        var file: String?
        var fileStamp: (Int, Int, Int) = (0, 0, -1)
        var lastCheck: UInt64 = 0
        var problems: [String] = []
    }

    private let state: Locked<State>

    /// The failpoints OBSD_FAILPOINTS arms, or nil when it is unset or empty.
    public static let shared: Failpoints? = {
        guard let raw = getenv("OBSD_FAILPOINTS"), raw.pointee != 0 else { return nil }
        let seed = getenv("OBSD_FAILPOINTS_SEED").flatMap { UInt64(String(cString: $0)) }
        return Failpoints(spec: String(cString: raw), seed: seed ?? (UInt64(UInt32(bitPattern: getpid())) &* 0x9E37_79B9_7F4A_7C15 ^ Failpoints.nanoseconds()))
    }()

    /// Failpoints from `spec` (the variable's text: points, or `@path`).
    public init(spec: String, seed: UInt64) {
        var s = State(rng: seed == 0 ? 0x2545_F491_4F6C_DD1D : seed)
        if spec.hasPrefix("@") {
            s.file = String(spec.dropFirst())
            Self.reload(&s, force: true)
        } else {
            (s.points, s.problems) = Self.parse(spec)
        }
        state = Locked(s)
    }

    /// Lines describing what is armed (and what could not be parsed), for the daemon's log.
    public var description: String {
        state.withLock { s in
            let armed = s.points.keys.sorted().map { "\($0)=\(s.points[$0]!.action)" }.joined(separator: "; ")
            let source = s.file.map { "from \($0): " } ?? ""
            let bad = s.problems.isEmpty ? "" : " (ignored: \(s.problems.joined(separator: "; ")))"
            return source + (armed.isEmpty ? "none armed yet" : armed) + bad
        }
    }

    /// The action of `name` if it triggers on this hit (counting the hit), else nil.
    public func evaluate(_ name: String) -> Action? {
        state.withLock { s in
            if s.file != nil { Self.reload(&s, force: false) }
            guard var point = s.points[name], point.action != .off else { return nil }
            defer { s.points[name] = point }
            point.hits += 1
            guard point.hits > point.after, point.triggered < point.times else { return nil }
            if point.probability < 1 {
                s.rng = s.rng &+ 0x9E37_79B9_7F4A_7C15
                var z = s.rng
                z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
                z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
                z ^= z >> 31
                guard Double(z >> 11) / Double(1 << 53) < point.probability else { return nil }
            }
            point.triggered += 1
            if let file = s.file { Self.noteFired(name, point.action, beside: file) }
            return point.action
        }
    }

    /// Appends `name action` to `<file>.fired` (best effort).
    private static func noteFired(_ name: String, _ action: Action, beside file: String) {
        guard let fd = try? FilePath(file + ".fired").open(.writeOnly, options: [.append, .create]) else { return }
        defer { try? fd.close() }
        let line = Array("\(name) \(action)\n".utf8)
        _ = line.withUnsafeBytes { try? fd.write($0) }
    }

    /// The tunable `name` (`value(n)`), if set.
    public func value(_ name: String) -> Int? {
        state.withLock { s in
            if case .value(let n)? = s.points[name]?.action { return n }
            return nil
        }
    }

    /// How many nanoseconds early `name` (`early(ms)`) moves a deadline; 0 when not armed.
    public func earliness(_ name: String) -> UInt64 {
        if case .early(let ms)? = evaluate(name) { return UInt64(max(0, ms)) * 1_000_000 }
        return 0
    }

    /// Runs a point that only crashes or sleeps (`checkpoint.commit`).
    public static func hit(_ name: String) {
        guard let action = shared?.evaluate(name) else { return }
        switch action {
        case .crash, .torn: crash()
        case .sleep(let ms): usleep(UInt32(max(0, ms)) * 1000)
        default: break
        }
    }

    /// Kills the process the way `kill -9` does.
    static func crash() -> Never {
        kill(getpid(), SIGKILL)
        while true { pause() }
    }

    // MARK: Parsing

    static func parse(_ spec: String) -> ([String: Point], [String]) {
        var points: [String: Point] = [:]
        var problems: [String] = []
        for raw in spec.split(whereSeparator: { $0 == ";" || $0 == "\n" }) {
            let term = raw.filter { !$0.isWhitespace }
            guard !term.isEmpty, !term.hasPrefix("#") else { continue }
            guard let eq = term.firstIndex(of: "=") else {
                problems.append(term)
                continue
            }
            let name = String(term[..<eq])
            var parts = term[term.index(after: eq)...].split(separator: "@", omittingEmptySubsequences: false).map(String.init)
            guard !parts.isEmpty, var point = action(parts.removeFirst()).map({ Point(action: $0) }) else {
                problems.append(term)
                continue
            }
            var ok = true
            for modifier in parts {
                if modifier.hasPrefix("p"), let p = Double(modifier.dropFirst()), p >= 0, p <= 1 {
                    point.probability = p
                } else if let n = argument(modifier, "after").flatMap({ Int($0) }), n >= 0 {
                    point.after = n
                } else if let n = argument(modifier, "times").flatMap({ Int($0) }), n >= 0 {
                    point.times = n
                } else {
                    ok = false
                }
            }
            if ok { points[name] = point } else { problems.append(term) }
        }
        return (points, problems)
    }

    static func action(_ text: String) -> Action? {
        switch text {
        case "off": return .off
        case "crash": return .crash
        case "torn": return .torn
        case "drop": return .drop
        default: break
        }
        if let e = argument(text, "error") {
            let names: [String: Int32] = ["EIO": Errno.ioError.rawValue, "ENOSPC": Errno.noSpace.rawValue, "EROFS": Errno.readOnlyFileSystem.rawValue, "EDQUOT": Errno.diskQuotaExceeded.rawValue]
            if let code = names[e] ?? Int32(e), code > 0 { return .error(code) }
            return nil
        }
        if let n = argument(text, "sleep").flatMap({ Int($0) }), n >= 0 { return .sleep(milliseconds: n) }
        if let n = argument(text, "value").flatMap({ Int($0) }) { return .value(n) }
        if let n = argument(text, "early").flatMap({ Int($0) }), n >= 0 { return .early(milliseconds: n) }
        return nil
    }

    /// `x` of `name(x)`, or nil.
    static func argument(_ text: String, _ name: String) -> String? {
        guard text.hasPrefix(name + "("), text.hasSuffix(")") else { return nil }
        return String(text.dropFirst(name.count + 1).dropLast())
    }

    // MARK: The file

    static func nanoseconds() -> UInt64 {
        var t = timespec()
        clock_gettime(CLOCK_MONOTONIC, &t)
        return UInt64(t.tv_sec) * 1_000_000_000 + UInt64(t.tv_nsec)
    }

    /// Reads the spec file again if it changed (looked at no more than every 10 ms). A file
    /// that is missing or unreadable arms nothing.
    static func reload(_ s: inout State, force: Bool) {
        guard let path = s.file else { return }
        let now = nanoseconds()
        if !force, now &- s.lastCheck < 10_000_000 { return }
        s.lastCheck = now
        guard let info = try? FilePath(path).stat() else {
            if s.fileStamp.2 != -1 { s.points = [:] }
            s.fileStamp = (0, 0, -1)
            return
        }
        let stamp = (Int(info.st_mtim.tv_sec), Int(info.st_mtim.tv_nsec), Int(info.size))
        if !force, stamp == s.fileStamp { return }
        s.fileStamp = stamp
        guard let file = try? FilePath(path).open(.readOnly) else { return }
        defer { try? file.close() }
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while let n = try? buffer.withMutableBytes({ (raw) throws(Errno) in try file.read(into: raw, at: bytes.count) }), n > 0 {
            bytes += buffer[0..<n]
        }
        (s.points, s.problems) = parse(String(decoding: bytes, as: UTF8.self))
    }
}

/// The log's system calls with the failpoints `wal.open` (creating a segment), `wal.write`,
/// `wal.fdatasync` and `wal.ftruncate` in front of them.
struct FailpointFileOperations: FileOperations {
    let failpoints: Failpoints
    private let system = SystemFileOperations()

    init(_ failpoints: Failpoints) { self.failpoints = failpoints }

    /// Runs what `name` asks that is common to every call: an error (thrown: the call
    /// fails), a crash, a sleep (then the call proceeds).
    private func common(_ action: Failpoints.Action?) throws(Errno) {
        switch action {
        case .error(let code)?: throw Errno(rawValue: code)
        case .crash?: Failpoints.crash()
        case .sleep(let ms)?: usleep(UInt32(max(0, ms)) * 1000)
        default: break
        }
    }

    func open(
        _ path: FilePath, _ mode: FileDescriptor.AccessMode, options: FileDescriptor.OpenOptions, permissions: FilePermissions
    ) throws(Errno) -> FileDescriptor {
        if options.contains(.create) { try common(failpoints.evaluate("wal.open")) }
        return try system.open(path, mode, options: options, permissions: permissions)
    }

    func write(_ fd: FileDescriptor, _ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(Errno) -> Int {
        let action = failpoints.evaluate("wal.write")
        switch action {
        case .torn?:
            if bytes.count > 1 { _ = try? system.write(fd, UnsafeRawBufferPointer(rebasing: bytes[..<(bytes.count / 2)]), at: offset) }
            Failpoints.crash()
        case .drop?:
            return bytes.count
        default:
            try common(action)
            return try system.write(fd, bytes, at: offset)
        }
    }

    func fdatasync(_ fd: FileDescriptor) throws(Errno) {
        let action = failpoints.evaluate("wal.fdatasync")
        if action == .drop { return }
        try common(action)
        try system.fdatasync(fd)
    }

    func truncate(_ fd: FileDescriptor, to length: Int64) throws(Errno) {
        try common(failpoints.evaluate("wal.ftruncate"))
        try system.truncate(fd, to: length)
    }
}
