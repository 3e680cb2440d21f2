// ObsValues — who wrote a revision: the peer credentials of the connection whose write made
// it, as every layer records and shows it (the store keeps it, events carry it as `by`).

/// Who wrote a revision: the peer credentials of the connection whose write made it (as
/// the daemon read them with SO_PEERCRED when it connected).
public struct Writer: Sendable, Hashable {
    public let uid: UInt32
    public let gid: UInt32
    public let pid: Int32

    public init(uid: UInt32, gid: UInt32, pid: Int32) {
        self.uid = uid
        self.gid = gid
        self.pid = pid
    }
}

extension Writer: CustomStringConvertible {
    /// `uid U gid G pid P`.
    public var description: String { "uid \(uid) gid \(gid) pid \(pid)" }

    /// The JSON form on the wire: `{"uid": U, "gid": G, "pid": P}`.
    public var jsonValue: JSONValue {
        .object(JSONObject(uniqueMembers: [
            (name: "uid", value: .int(Int64(uid))), (name: "gid", value: .int(Int64(gid))), (name: "pid", value: .int(Int64(pid))),
        ]))
    }
}
