// ObsValues — a lease's end, the one type every layer names it with: the `change` event that
// deleted an ended lease's keys carries it (`"lease":{"id","end"}`, ObsProtocol's Events.swift),
// the store keeps it with that revision and with the lease (ObsStore: the log, the snapshot,
// etcd's records), and a client reads it back (re-exported by ObsClient).
//
// Its reason is extensible, so a client reads a newer daemon's reason as itself. A store holds
// only the three the daemon makes: ObsStore converts at its boundary (SharedLeases.swift,
// `LeaseEnd.Reason.toStore` and `init(storedName:)`; the log's and the snapshot's codes,
// LegacyLeaseJournal.swift) and refuses a record naming another.

/// How a lease ended, as the `change` event that deleted its keys says (`"lease":{"id","end"}`).
public struct LeaseEnd: Sendable, Hashable {
    /// Why a lease ended: extensible, so a newer reason reads as itself.
    public struct Reason: RawRepresentable, Sendable, Hashable, CustomStringConvertible {
        public var rawValue: String
        public init(rawValue: String) { self.rawValue = rawValue }

        /// Its TTL passed without a `keepalive`.
        public static let expired = Reason(rawValue: "expired")
        /// A `revoke` ended it.
        public static let revoked = Reason(rawValue: "revoked")
        /// The connection it was bound to ended — or the daemon holding that connection
        /// stopped, or lost the store it shares with others.
        public static let closed = Reason(rawValue: "closed")

        public var description: String { rawValue }
    }

    /// The lease (`id`).
    public var lease: UInt64
    /// Why it ended (`end`).
    public var reason: Reason

    public init(lease: UInt64, reason: Reason) {
        self.lease = lease
        self.reason = reason
    }

    /// Writes `,"lease":{"id":L,"end":"E"}` — the member a lease's end adds to its event.
    @inlinable
    public func writeMember<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"lease\":{\"id\":", lease)
        sink.writeMember(",\"end\":", reason.rawValue)
        sink.writeByte(UInt8(ascii: "}"))
    }
}
