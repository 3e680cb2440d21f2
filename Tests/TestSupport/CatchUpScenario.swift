// Test support: the catch-up scenario of the contract's example ("Catching up"), written and
// read over a raw connection — so the local suites (EndToEndTests' CatchUpTests) and the
// etcd ones (ObsClusterTests, the writes through one daemon, the catch-up through another)
// check one scenario and the same wire form.

import ObsProtocol

public enum CatchUpScenario {
    /// `set` of `key` in `repo`; returns the revision.
    public static func set(_ c: WireConnection, _ key: String, _ value: JSONValue, repo: String = "r") throws -> UInt64 {
        let reply = try c.call(["op": "set", "repo": .string(repo), "key": .string(key), "value": value])
        guard reply.ok, let rev = reply["rev"]?.int64Value else { throw TestFailure("set \(key): \(reply)") }
        return UInt64(rev)
    }

    /// `delete` of `key` in `repo`; returns the revision.
    public static func delete(_ c: WireConnection, _ key: String, repo: String = "r") throws -> UInt64 {
        let reply = try c.call(["op": "delete", "repo": .string(repo), "key": .string(key)])
        guard reply.ok, let rev = reply["rev"]?.int64Value else { throw TestFailure("delete \(key): \(reply)") }
        return UInt64(rev)
    }

    /// The epoch of `repo`.
    public static func epoch(_ c: WireConnection, repo: String = "r") throws -> String {
        guard let epoch = try c.call(["op": "list", "repo": .string(repo)])["epoch"]?.stringValue else { throw TestFailure("no epoch for \(repo)") }
        return epoch
    }

    /// Writes the scenario of the contract's example in `repo`: `lang`, `theme`, `draft` at
    /// 1–3, then changes and deletions up to revision 8 (`tmp` created and deleted again, an
    /// equal `theme` that makes no revision); returns the revision a client saw (3) and the
    /// epoch. A catch-up from it lists `values` and `deleted` below.
    public static func write(_ c: WireConnection, repo: String = "r") throws -> (seen: UInt64, epoch: String) {
        _ = try set(c, "lang", "en", repo: repo)  // 1
        _ = try set(c, "theme", "light", repo: repo)  // 2
        let seen = try set(c, "draft", "x", repo: repo)  // 3
        _ = try set(c, "lang", "fr", repo: repo)  // 4
        _ = try delete(c, "draft", repo: repo)  // 5
        _ = try set(c, "theme", "dark", repo: repo)  // 6
        _ = try set(c, "tmp", 1, repo: repo)  // 7
        _ = try delete(c, "tmp", repo: repo)  // 8
        _ = try set(c, "theme", "dark", repo: repo)  // equal: no revision
        return (seen, try epoch(c, repo: repo))
    }

    /// The revision the scenario ends at.
    public static let revision: Int64 = 8
    /// A diff from `seen` lists these keys changed after it, as they are at 8 …
    public static let values: JSONValue = ["lang": "fr", "theme": "dark"]
    /// … and these deleted after it, in byte order (`tmp`: created and deleted again).
    public static let deleted: [JSONValue] = ["draft", "tmp"]
}
