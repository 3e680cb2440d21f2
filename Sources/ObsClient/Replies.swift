// ObsClient — what a subscription delivers and how: its options and its events. The
// replies and events themselves are ObsProtocol's typed messages.

import ObsProtocol
import ObservableKit

/// How a subscription's events are delivered, beyond which keys it selects (the
/// `subscribe` options `coalesce`, `writers` and `echo` of the protocol).
///
/// ```swift
/// let subscription = try await connection.subscribe(to: "ui", options: SubscriptionOptions(coalesce: true, writers: true))
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

/// An event of a subscription.
public enum SubscriptionEvent: Sendable {
    /// The selected keys' values at `revision` (first, when asked with `initial`).
    case snapshot(revision: UInt64, values: [Key: JSONValue])
    /// A revision's changes to the selected keys (several revisions' when coalesced).
    case change(ChangeEvent<JSONValue>)
    /// The `since` replay is complete up to `revision`; what follows is live.
    case synced(revision: UInt64)
    /// For a subscription made with `catchUp` that resumed past the daemon's history (its
    /// ``Subscription/catchUp`` is `.diff`): the selected keys that changed after
    /// `since`, as they are at the event's revision; `synced` follows.
    case catchUp(CatchUpEvent<JSONValue>)

    /// The revision the event is at.
    public var revision: UInt64 {
        switch self {
        case .snapshot(let r, _), .synced(let r): return r
        case .change(let c): return c.revision
        case .catchUp(let c): return c.revision
        }
    }
}
