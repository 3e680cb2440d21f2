// ObsServer — who is connected, and what they may do.
//
// `Peer` is a connection's identity from `SO_PEERCRED` (uid, gid, pid); the uid's name and
// groups come from the user database (as dbus-daemon resolves `group=` policy) only when a
// decision or a message needs them, cached per uid — a lookup can block for as long as a
// remote user database (LDAP, sssd) takes, on an event loop. `AccessPolicy`
// grants `read` (get, list, subscribe) or `write` (also set, delete, batch) on repository
// name patterns to users and groups; the daemon's own uid and root may do everything;
// everyone else gets the policy's default (none, unless configured).

import Logging
import ObsProtocol
import ObservableKit

#if canImport(Glibc)
import Glibc
#endif

/// A connected process, as the kernel vouches for it.
public struct Peer: Sendable, Equatable, CustomStringConvertible {
    public let uid: UInt32
    public let gid: UInt32
    public let pid: Int32
    /// root or the daemon's own uid: not subject to the access policy.
    public let isPrivileged: Bool

    /// A peer as the daemon running as `daemonUID` sees it.
    public init(uid: UInt32, gid: UInt32, pid: Int32, daemonUID: UInt32) {
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.isPrivileged = uid == 0 || uid == daemonUID
    }

    public var description: String { "uid \(uid) pid \(pid)" }

    /// As `description`, with the user's name when the user database has one.
    func described(by users: UserDatabase) -> String {
        "uid \(uid)\(users.name(of: uid).map { " (\($0))" } ?? "") pid \(pid)"
    }

    /// Log metadata: journal fields OBSD_PEER_UID, OBSD_PEER_GID, OBSD_PEER_PID.
    var metadata: Logger.Metadata {
        ["peer.uid": "\(uid)", "peer.gid": "\(gid)", "peer.pid": "\(pid)"]
    }
}

public struct AccessPolicyError: Error, Sendable, CustomStringConvertible {
    public let description: String
}

/// What a peer may do to a repository.
public enum Permission: Int, Sendable, Comparable {
    case none = 0, read, write

    public static func < (a: Permission, b: Permission) -> Bool { a.rawValue < b.rawValue }

    var verb: String {
        switch self {
        case .none: return "use"
        case .read: return "read"
        case .write: return "write"
        }
    }
}

/// Who may read or write which repositories.
public struct AccessPolicy: Sendable {
    public struct Rule: Sendable {
        public let patterns: [String]
        public let users: Set<UInt32>
        public let groups: Set<UInt32>
        public let allow: Permission
    }

    public let rules: [Rule]
    /// For peers no rule matches.
    public let fallback: Permission

    /// Everyone may do everything (tests, private instances).
    public static let open = AccessPolicy(rules: [], fallback: .write)

    /// Only root and the daemon's own uid may do anything: the daemon's default.
    public static let ownerOnly = AccessPolicy(rules: [], fallback: .none)

    public init(rules: [Rule], fallback: Permission) {
        self.rules = rules
        self.fallback = fallback
    }

    /// A policy from configuration: user and group names are looked up now.
    ///
    /// - Throws: a message naming the rule when a name is unknown.
    public init(rules settings: [(repos: [String], users: [String], groups: [String], allow: String)], fallback: String) throws(AccessPolicyError) {
        var rules: [Rule] = []
        for (i, s) in settings.enumerated() {
            let users = try s.users.map { (name) throws(AccessPolicyError) -> UInt32 in
                if let id = UInt32(name) { return id }
                guard let id = UserDatabase.uid(named: name) else {
                    throw AccessPolicyError(description: "access rule \(i + 1): no user named \(name)")
                }
                return id
            }
            let groups = try s.groups.map { (name) throws(AccessPolicyError) -> UInt32 in
                if let id = UInt32(name) { return id }
                guard let id = UserDatabase.gid(named: name) else {
                    throw AccessPolicyError(description: "access rule \(i + 1): no group named \(name)")
                }
                return id
            }
            rules.append(Rule(patterns: s.repos, users: Set(users), groups: Set(groups), allow: s.allow == "write" ? .write : .read))
        }
        self.init(rules: rules, fallback: fallback == "write" ? .write : fallback == "read" ? .read : .none)
    }

    /// The most a matching rule grants (or the fallback when none matches). `groups` (the
    /// peer's primary and supplementary groups) is asked only if a rule names groups.
    public func permission(of peer: Peer, on repo: String, groups: () -> Set<UInt32>) -> Permission {
        if peer.isPrivileged { return .write }
        var granted: Permission? = nil
        var known: Set<UInt32>? = nil
        func member(of ruleGroups: Set<UInt32>) -> Bool {
            if ruleGroups.isEmpty { return false }
            if known == nil { known = groups().union([peer.gid]) }
            return !ruleGroups.isDisjoint(with: known!)
        }
        for rule in rules where rule.users.contains(peer.uid) || member(of: rule.groups) {
            if rule.patterns.contains(where: { Glob.matches($0, repo) }) {
                granted = max(granted ?? .none, rule.allow)
            }
        }
        return granted ?? fallback
    }
}

/// `*` (any run of characters) and `?` (one character) over repository names.
enum Glob {
    static func matches(_ pattern: String, _ name: String) -> Bool {
        let p = Array(pattern.utf8), n = Array(name.utf8)
        var (pi, ni) = (0, 0)
        var star: (p: Int, n: Int)? = nil
        while ni < n.count {
            if pi < p.count, p[pi] == UInt8(ascii: "?") || p[pi] == n[ni] {
                pi += 1
                ni += 1
            } else if pi < p.count, p[pi] == UInt8(ascii: "*") {
                star = (pi, ni)
                pi += 1
            } else if let s = star {
                pi = s.p + 1
                ni = s.n + 1
                star = (s.p, s.n + 1)
            } else {
                return false
            }
        }
        while pi < p.count, p[pi] == UInt8(ascii: "*") { pi += 1 }
        return pi == p.count
    }
}

/// User and group lookups, cached per uid for a minute (misses too): a lookup can be slow
/// with remote user databases, and runs on an event loop.
final class UserDatabase: Sendable {
    private struct Known: Sendable {
        var name: String?
        var groups: Set<UInt32>?
        var at: ContinuousClock.Instant
    }

    private let cache = Locked<[UInt32: Known]>([:])

    /// The user's name, if the user database has one.
    func name(of uid: UInt32) -> String? {
        if let hit = fresh(uid) { return hit.name }
        let name = Self.userName(uid)
        remember(uid) { $0.name = name }
        return name
    }

    /// The uid's groups: `primary` and its supplementary groups.
    func groups(of uid: UInt32, primary: UInt32) -> Set<UInt32> {
        if let hit = fresh(uid), let groups = hit.groups { return groups }
        var result: Set<UInt32> = [primary]
        if let name = name(of: uid) {
            var count: Int32 = 64
            var list = [gid_t](repeating: 0, count: Int(count))
            if getgrouplist(name, primary, &list, &count) == -1 {
                list = [gid_t](repeating: 0, count: Int(count))
                _ = getgrouplist(name, primary, &list, &count)
            }
            result.formUnion(list.prefix(Int(max(0, count))))
        }
        remember(uid) { $0.groups = result }
        return result
    }

    private func fresh(_ uid: UInt32) -> Known? {
        cache.withLock { $0[uid] }.flatMap { ContinuousClock.now - $0.at < .seconds(60) ? $0 : nil }
    }

    private func remember(_ uid: UInt32, _ update: (inout Known) -> Void) {
        cache.withLock { map in
            if map.count > 4096 { map.removeAll() }  // bounded: one entry per uid seen lately
            var entry = map[uid].flatMap { ContinuousClock.now - $0.at < .seconds(60) ? $0 : nil }
                ?? Known(name: nil, groups: nil, at: .now)
            update(&entry)
            map[uid] = entry
        }
    }

    static func userName(_ uid: UInt32) -> String? {
        var entry = passwd()
        var result: UnsafeMutablePointer<passwd>? = nil
        var buffer = [CChar](repeating: 0, count: 4096)
        guard getpwuid_r(uid, &entry, &buffer, buffer.count, &result) == 0, result != nil else { return nil }
        return String(cString: entry.pw_name)
    }

    static func uid(named name: String) -> UInt32? {
        getpwnam(name).map { $0.pointee.pw_uid }
    }

    static func gid(named name: String) -> UInt32? {
        getgrnam(name).map { $0.pointee.gr_gid }
    }
}
