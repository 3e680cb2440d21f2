// ObsProtocol — the `stats` reply, typed: the fields docs/PROTOCOL.md documents, each a
// property, and the numeric fields a newer daemon adds, kept by name.
//
// Every peer gets `connections`, `subscriptions`, `repos`, `peer` and `server`; a privileged
// peer (root or the daemon's uid) also the daemon's totals — those properties are nil for
// anyone else. The encoder writes the fields in the daemon's order, the unknown counters last.

/// The daemon's counters, as the `stats` reply gives them.
public struct Stats: ReplyMessage, Equatable {
    /// The caller as the daemon sees it (`peer`).
    public struct Peer: Sendable, Equatable {
        public var uid: UInt32
        public var gid: UInt32
        public var pid: Int32
        /// Whether the daemon gave it its totals (root, or the daemon's own uid).
        public var privileged: Bool

        public init(uid: UInt32, gid: UInt32, pid: Int32, privileged: Bool) {
            self.uid = uid
            self.gid = gid
            self.pid = pid
            self.privileged = privileged
        }
    }

    /// A connected peer, as a privileged caller sees it (`clients`).
    public struct Client: Sendable, Equatable {
        public var uid: UInt32
        public var gid: UInt32
        public var pid: Int32
        /// Its live subscriptions.
        public var subscriptions: Int
        /// How long it has been connected, in seconds.
        public var connectedSeconds: UInt64

        public init(uid: UInt32, gid: UInt32, pid: Int32, subscriptions: Int, connectedSeconds: UInt64) {
            self.uid = uid
            self.gid = gid
            self.pid = pid
            self.subscriptions = subscriptions
            self.connectedSeconds = connectedSeconds
        }
    }

    /// A numeric field this version does not know (one a newer daemon added), kept as sent.
    public struct Counter: Sendable, Equatable {
        public var name: String
        /// A JSON number.
        public var value: JSONValue

        public init(name: String, value: JSONValue) {
            self.name = name
            self.value = value
        }
    }

    /// Connections open (for an unprivileged caller: its uid's).
    public var connections: UInt64
    /// Live subscriptions (for an unprivileged caller: this connection's).
    public var subscriptions: UInt64
    /// Repositories (for an unprivileged caller: those it may read) — `repos`.
    public var repositories: UInt64
    public var peer: Peer?
    /// The daemon and its release, e.g. `obsd/0.3.0`.
    public var server: String?

    // The daemon's totals, for a privileged caller.
    public var connectionsTotal: UInt64?
    public var connectionsRefused: UInt64?
    public var requests: UInt64?
    /// Writes that changed something.
    public var writes: UInt64?
    public var eventsOut: UInt64?
    public var bytesOut: UInt64?
    public var overflows: UInt64?
    /// Times a writer's connection was held until the fan-out caught up.
    public var writersHeld: UInt64?
    /// Repository objects in memory.
    public var repositoriesHeld: UInt64?
    /// Live leases (every daemon's, when a shared store keeps them).
    public var leases: UInt64?
    /// Error replies.
    public var errors: UInt64?
    /// `forbidden` replies.
    public var denied: UInt64?
    public var uptimeSeconds: UInt64?
    /// The daemon's process id.
    public var pid: UInt64?
    /// Configuration reloads that ended, applied or not.
    public var reloads: UInt64?
    /// Reloads that kept the running settings.
    public var reloadFailures: UInt64?
    /// Why the last reload failed, while it did.
    public var reloadError: String?
    /// The store, in words.
    public var storage: String?
    public var storageCommits: UInt64?
    public var storageFsyncs: UInt64?
    public var storageRecords: UInt64?
    public var storageFailures: UInt64?
    public var storageCheckpoints: UInt64?
    public var storageCheckpointFailures: UInt64?
    /// The connected peers.
    public var clients: [Client]?
    /// Numeric fields this version does not know, in the order the daemon sent them.
    public var otherCounters: [Counter]

    public init(
        connections: UInt64 = 0, subscriptions: UInt64 = 0, repositories: UInt64 = 0, peer: Peer? = nil, server: String? = nil,
        otherCounters: [Counter] = []
    ) {
        self.connections = connections
        self.subscriptions = subscriptions
        self.repositories = repositories
        self.peer = peer
        self.server = server
        self.otherCounters = otherCounters
    }

    /// The privileged counters, by field name, in the daemon's order around `reloadError` and `storage`.
    @usableFromInline
    static var totals: [(name: String, path: WritableKeyPath<Stats, UInt64?>)] {
        [
            ("connectionsTotal", \.connectionsTotal), ("connectionsRefused", \.connectionsRefused), ("requests", \.requests),
            ("writes", \.writes), ("eventsOut", \.eventsOut), ("bytesOut", \.bytesOut), ("overflows", \.overflows),
            ("writersHeld", \.writersHeld), ("repositoriesHeld", \.repositoriesHeld), ("leases", \.leases), ("errors", \.errors), ("denied", \.denied),
            ("uptimeSeconds", \.uptimeSeconds), ("pid", \.pid), ("reloads", \.reloads), ("reloadFailures", \.reloadFailures),
        ]
    }

    @usableFromInline
    static var storageCounters: [(name: String, path: WritableKeyPath<Stats, UInt64?>)] {
        [
            ("storageCommits", \.storageCommits), ("storageFsyncs", \.storageFsyncs), ("storageRecords", \.storageRecords),
            ("storageFailures", \.storageFailures), ("storageCheckpoints", \.storageCheckpoints),
            ("storageCheckpointFailures", \.storageCheckpointFailures),
        ]
    }

    /// Every field name this type knows.
    public static var knownFields: Set<String> {
        Set(["connections", "subscriptions", "repos", "peer", "server", "reloadError", "storage", "clients"])
            .union(totals.map(\.name)).union(storageCounters.map(\.name))
    }

    @inlinable
    public func writeMembers<S: JSONSink & ~Copyable>(into sink: inout S) {
        sink.writeMember(",\"connections\":", connections)
        sink.writeMember(",\"subscriptions\":", subscriptions)
        sink.writeMember(",\"repos\":", repositories)
        if let peer {
            sink.writeMember(",\"peer\":{\"uid\":", UInt64(peer.uid))
            sink.writeMember(",\"gid\":", UInt64(peer.gid))
            sink.writeRaw(",\"pid\":")
            sink.writeDecimal(Int64(peer.pid))
            sink.writeMember(",\"privileged\":", peer.privileged)
            sink.writeByte(UInt8(ascii: "}"))
        }
        if let server { sink.writeMember(",\"server\":", server) }
        for (name, path) in Self.totals {
            guard let value = self[keyPath: path] else { continue }
            Self.writeField(&sink, name, .number(value))
        }
        if let reloadError { Self.writeField(&sink, "reloadError", .string(reloadError)) }
        if let storage { Self.writeField(&sink, "storage", .string(storage)) }
        for (name, path) in Self.storageCounters {
            guard let value = self[keyPath: path] else { continue }
            Self.writeField(&sink, name, .number(value))
        }
        if let clients {
            sink.writeRaw(",\"clients\":[")
            for (i, client) in clients.enumerated() {
                if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                sink.writeMember("{\"uid\":", UInt64(client.uid))
                sink.writeMember(",\"gid\":", UInt64(client.gid))
                sink.writeRaw(",\"pid\":")
                sink.writeDecimal(Int64(client.pid))
                sink.writeRaw(",\"subscriptions\":")
                sink.writeDecimal(Int64(client.subscriptions))
                sink.writeMember(",\"connectedSeconds\":", client.connectedSeconds)
                sink.writeByte(UInt8(ascii: "}"))
            }
            sink.writeByte(UInt8(ascii: "]"))
        }
        for counter in otherCounters { Self.writeField(&sink, counter.name, counter.value) }
    }

    /// The reply's members as JSON, in the order the encoder writes them (for printing).
    public var jsonObject: JSONObject {
        var bytes: [UInt8] = [UInt8(ascii: "{"), UInt8(ascii: "\""), UInt8(ascii: "_"), UInt8(ascii: "\""), UInt8(ascii: ":"), UInt8(ascii: "0")]
        writeMembers(into: &bytes)
        bytes.append(UInt8(ascii: "}"))
        // The encoder's output is valid JSON; `_` is the placeholder that lets every member start with a comma.
        guard case .object(var object)? = try? JSONParser.parse(bytes, maxDepth: 16) else { return JSONObject() }
        object["_"] = nil
        return object
    }

    /// Writes `,"name":value`.
    @usableFromInline
    static func writeField<S: JSONSink & ~Copyable>(_ sink: inout S, _ name: String, _ value: JSONValue) {
        sink.writeByte(UInt8(ascii: ","))
        sink.writeJSONString(name)
        sink.writeByte(UInt8(ascii: ":"))
        sink.writeJSON(value)
    }

    public init(decoding members: JSONObject) throws(ProtocolViolation) {
        let f = MessageFields(members, "the stats reply")
        self.init(connections: try f.unsigned("connections"), subscriptions: try f.unsigned("subscriptions"), repositories: try f.unsigned("repos"))
        if let peer = f.present("peer") {
            guard let o = peer.objectValue else { throw f.violation("peer", "an object") }
            let p = MessageFields(o, "the stats reply's peer")
            let writer = try Writer(decoding: peer)
            self.peer = Peer(uid: writer.uid, gid: writer.gid, pid: writer.pid, privileged: try p.bool("privileged"))
        }
        if f.present("server") != nil { server = try f.string("server") }
        for (name, path) in Self.totals + Self.storageCounters { self[keyPath: path] = try f.optionalUnsigned(name) }
        if f.present("reloadError") != nil { reloadError = try f.string("reloadError") }
        if f.present("storage") != nil { storage = try f.string("storage") }
        if f.present("clients") != nil {
            var clients: [Client] = []
            for item in try f.array("clients") {
                guard let o = item.objectValue else { throw f.violation("clients", "an array of objects") }
                let c = MessageFields(o, "a stats client")
                let writer = try Writer(decoding: item)
                clients.append(
                    Client(uid: writer.uid, gid: writer.gid, pid: writer.pid, subscriptions: try c.count("subscriptions"),
                        connectedSeconds: try c.unsigned("connectedSeconds")))
            }
            self.clients = clients
        }
        let known = Self.knownFields
        for member in members.members where !known.contains(member.name) && member.name != "id" && member.name != "ok" {
            if case .int = member.value { otherCounters.append(Counter(name: member.name, value: member.value)) }
            if case .double = member.value { otherCounters.append(Counter(name: member.name, value: member.value)) }
        }
    }
}
