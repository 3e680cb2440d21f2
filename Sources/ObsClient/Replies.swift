// ObsClient — typed replies and subscription events.

import ObsProtocol
import ObservableKit

/// What `hello` tells about the daemon.
public struct ServerInfo: Sendable, Equatable {
    public let protocolVersion: Int64
    public let server: String
    public let maxLine: Int

    public init(protocolVersion: Int64, server: String, maxLine: Int) {
        self.protocolVersion = protocolVersion
        self.server = server
        self.maxLine = maxLine
    }
}

/// The reply to `set` or `delete`.
public struct WriteReply: Sendable, Equatable {
    /// The repository revision after the call.
    public let revision: UInt64
    /// Whether the call changed anything.
    public let changed: Bool
    /// The key's previous value; `nil` if the key did not exist (`.some(.null)` if it held null).
    public let old: JSONValue?

    public init(revision: UInt64, changed: Bool, old: JSONValue?) {
        self.revision = revision
        self.changed = changed
        self.old = old
    }
}

/// The reply to `batch`.
public struct BatchReply: Sendable, Equatable {
    public let revision: UInt64
    public let changed: Bool

    public init(revision: UInt64, changed: Bool) {
        self.revision = revision
        self.changed = changed
    }
}

/// The reply to `list`.
public struct Listing: Sendable {
    public let revision: UInt64
    /// The history `revision` belongs to.
    public let epoch: String
    /// Keys in byte order.
    public let keys: [Key]
    /// Values by key, when asked for.
    public let values: [Key: JSONValue]?
}

/// One repository as `repos` lists it.
public struct RepositoryInfo: Sendable, Equatable {
    public let name: String
    public let revision: UInt64
    public let keys: Int
    /// The history `revision` belongs to.
    public let epoch: String

    public init(name: String, revision: UInt64, keys: Int, epoch: String) {
        self.name = name
        self.revision = revision
        self.keys = keys
        self.epoch = epoch
    }
}

/// An event of a subscription.
public enum SubscriptionEvent: Sendable {
    /// The selected keys' values at `revision` (first, when asked with `initial`).
    case snapshot(revision: UInt64, values: [Key: JSONValue])
    /// One revision's changes to the selected keys.
    case change(ChangeSet<JSONValue>)
    /// The `since` replay is complete up to `revision`; what follows is live.
    case synced(revision: UInt64)

    /// The revision the event is at.
    public var revision: UInt64 {
        switch self {
        case .snapshot(let r, _), .synced(let r): return r
        case .change(let c): return c.revision
        }
    }
}
