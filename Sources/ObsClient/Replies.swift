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

/// How a subscription's events are delivered, beyond which keys it selects (the
/// `subscribe` options `coalesce`, `writers` and `echo` of the protocol).
///
/// ```swift
/// let sub = try await client.subscribe("ui", options: SubscriptionOptions(coalesce: true, writers: true))
/// ```
public struct SubscriptionOptions: Sendable, Hashable {
    /// Deliver the current state rather than every intermediate change: while this client
    /// reads too slowly, the daemon coalesces the changes it could not send into one
    /// `ChangeEvent` (with `from` set) per catch-up, holding one value per selected key,
    /// and never cuts the connection off for it. Cannot be combined with `once`.
    public var coalesce: Bool
    /// Every change event carries `by`: the uid, gid and pid of the writer's connection.
    public var writers: Bool
    /// `false`: no event for revisions written on this subscription's own connection (the
    /// writer already has their replies). Other connections' writes arrive as usual.
    public var echo: Bool

    /// Options as given; the defaults are the protocol's (every revision, no `by`, echo).
    public init(coalesce: Bool = false, writers: Bool = false, echo: Bool = true) {
        self.coalesce = coalesce
        self.writers = writers
        self.echo = echo
    }

    /// Every revision, without `by`, own writes included: a subscription without options.
    public static let `default` = SubscriptionOptions()

    /// What the Observation mirrors (`RemoteRepository`, `RemoteValue`) use unless told
    /// otherwise: coalesced state, and no echo — a mirror shows the writes made through
    /// its session from their replies.
    public static let mirror = SubscriptionOptions(coalesce: true, echo: false)
}

/// A `change` event: the changes to a subscription's keys of one revision — or, from a
/// coalescing subscription that lagged, of several.
public struct ChangeEvent: Sendable, Equatable {
    /// The revision the changes are at.
    public let revision: UInt64
    /// The changes: of one revision in the order they were applied; of a coalesced event,
    /// one per key whose value differs from the one last received, in byte order of the
    /// keys, `old` being the value last received (nil: the key did not exist then).
    public let changes: [Change<JSONValue>]
    /// For a coalesced event, the first revision it covers (it covers `from...revision`);
    /// nil for the changes of exactly one revision.
    public let from: UInt64?
    /// Who wrote `revision` (the latest revision, for a coalesced event), when the
    /// subscription asked for `writers`.
    public let by: Writer?

    public init(revision: UInt64, changes: [Change<JSONValue>], from: UInt64? = nil, by: Writer? = nil) {
        self.revision = revision
        self.changes = changes
        self.from = from
        self.by = by
    }

    /// Whether this event coalesces several revisions.
    public var isCoalesced: Bool { from != nil }

    /// The change of `key` in this event, if any.
    public func change(for key: Key) -> Change<JSONValue>? {
        changes.first { $0.key == key }
    }

    /// The changes as an ObservableKit change set (`from` kept, `by` dropped).
    public var changeSet: ChangeSet<JSONValue> { ChangeSet(revision: revision, changes: changes, from: from) }
}

/// An event of a subscription.
public enum SubscriptionEvent: Sendable {
    /// The selected keys' values at `revision` (first, when asked with `initial`).
    case snapshot(revision: UInt64, values: [Key: JSONValue])
    /// A revision's changes to the selected keys (several revisions' when coalesced).
    case change(ChangeEvent)
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
