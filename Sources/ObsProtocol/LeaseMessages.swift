// ObsProtocol — the lease operations (`grant`, `keepalive`, `revoke`): their requests as
// `LeaseCommand` (a `Command.lease`), encoded and decoded with the same rules and precise
// errors as every request, and their replies, typed.

/// A request of the lease extension.
public enum LeaseCommand: Sendable, Equatable {
    /// A new lease; with `ttl`, it ends `ttl` seconds after the grant or the last keepalive,
    /// without, when the connection that granted it ends.
    case grant(ttl: UInt32?)
    /// Starts a lease's TTL again in full.
    case keepalive(lease: UInt64)
    /// Ends a lease at once, deleting the keys attached to it.
    case revoke(lease: UInt64)

    /// The longest TTL, in seconds: one year.
    public static let maxTTL: UInt32 = 31_536_000

    /// The operation's name on the wire.
    public var op: String {
        switch self {
        case .grant: return "grant"
        case .keepalive: return "keepalive"
        case .revoke: return "revoke"
        }
    }

    /// The request line with `id` and `op`, ended by `\n` (client side).
    @inlinable
    public func encodeRequest<S: JSONSink & ~Copyable>(into sink: inout S, id: JSONValue) {
        sink.writeMember("{\"id\":", id)
        switch self {
        case .grant(let ttl):
            sink.writeRaw(",\"op\":\"grant\"")
            if let ttl { sink.writeMember(",\"ttl\":", UInt64(ttl)) }
        case .keepalive(let lease):
            sink.writeMember(",\"op\":\"keepalive\",\"lease\":", lease)
        case .revoke(let lease):
            sink.writeMember(",\"op\":\"revoke\",\"lease\":", lease)
        }
        sink.writeRaw("}\n")
    }
}

import ObservableKit

/// The reply to `grant`.
public struct GrantReply: ReplyMessage, Equatable {
    /// The new lease's id (1 or more; never reused while the daemon's data persists).
    public var lease: UInt64
    /// The TTL asked for, in seconds; nil for a lease bound to its connection.
    public var ttl: UInt32?

    public init(lease: UInt64, ttl: UInt32? = nil) {
        self.lease = lease
        self.ttl = ttl
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"lease\":", lease)
        if let ttl { sink.writeMember(",\"ttl\":", UInt64(ttl)) }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the grant reply")
        let lease = try f.unsigned("lease")
        guard lease >= 1 else { throw f.violation("lease", "a lease id (1 or more)") }
        self.init(lease: lease, ttl: try Self.ttl(f))
    }

    static func ttl(_ f: MessageFields) throws(ProtocolViolation) -> UInt32? {
        guard let value = try f.optionalUnsigned("ttl") else { return nil }
        guard let ttl = UInt32(exactly: value), ttl >= 1, ttl <= LeaseCommand.maxTTL else {
            throw f.violation("ttl", "seconds from 1 to \(LeaseCommand.maxTTL)")
        }
        return ttl
    }
}

/// The reply to `keepalive`.
public struct KeepaliveReply: ReplyMessage, Equatable {
    /// The lease's TTL, started again; nil for a lease bound to its connection.
    public var ttl: UInt32?

    public init(ttl: UInt32? = nil) {
        self.ttl = ttl
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        if let ttl { sink.writeMember(",\"ttl\":", UInt64(ttl)) }
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        self.init(ttl: try GrantReply.ttl(MessageFields(members, "the keepalive reply")))
    }
}

/// The reply to `revoke`: for each repository that held keys of the lease, the revision
/// that deleted them.
public struct RevokeReply: ReplyMessage, Equatable {
    /// Repository name → the revision that deleted its keys of the lease (`revs`); empty if
    /// the lease held none.
    public var revisions: [String: UInt64]

    public init(revisions: [String: UInt64] = [:]) {
        self.revisions = revisions
    }

    /// Writes `,"revs":{…}`, repositories in byte order of their names.
    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeRaw(",\"revs\":{")
        for (i, entry) in revisions.sorted(by: { Key($0.key) < Key($1.key) }).enumerated() {
            if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
            sink.writeJSONString(entry.key)
            sink.writeByte(UInt8(ascii: ":"))
            sink.writeDecimal(entry.value)
        }
        sink.writeByte(UInt8(ascii: "}"))
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the revoke reply")
        var revisions: [String: UInt64] = [:]
        for m in try f.objectMember("revs").members {
            guard let revision = m.value.uint64Value else { throw f.violation("revs", "repository names with revisions") }
            revisions[m.name] = revision
        }
        self.init(revisions: revisions)
    }
}
