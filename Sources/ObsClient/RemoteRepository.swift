// ObsClient — remote keys as Swift Observation models. `RemoteRepository` mirrors the
// selected keys of one repository into an `@Observable` object on the main actor, from one
// resumable watch: each revision is applied in one assignment, so an observer of any of
// its properties is notified once per revision — a batch of several keys included — and
// not at all for a write that changed nothing. Works with SwiftUI on Apple platforms and
// with `withObservationTracking` everywhere.
//
// By default the watch coalesces (a mirror wants state: while it lags, the daemon sends
// one event per catch-up, never cuts it off) and has no echo (the session's own writes are
// shown from their replies, see MirrorLink and MirrorState).

import Observation
import ObsProtocol
import ObservableKit

/// What a write through a mirror (``RemoteRepository``, ``RemoteValue``) did.
public enum RemoteWriteResult: Sendable, Equatable {
    /// The write changed the key at `revision`; the mirror already shows it when the key
    /// is one the mirror selects.
    case applied(revision: UInt64)
    /// The key already held an equal value: nothing changed and nobody was notified.
    case unchanged(revision: UInt64)
    /// `ifRevision` did not match the key's revision: nothing changed. Read again and retry.
    case conflict
}

/// The selected keys of one repository, kept current from the daemon.
///
/// ```swift
/// let ui = RemoteRepository("ui")                           // every key of "ui", on ObsSession.shared
/// // SwiftUI: Text(ui["theme"]?.stringValue ?? "default")  — redrawn when theme changes
/// try await ui.set("theme", to: "dark")                     // returns once ui shows it
/// ```
///
/// The mirror subscribes with `SubscriptionOptions.mirror` unless told otherwise: changes
/// coalesce while it lags (it is notified of the state, not of every intermediate value,
/// and the daemon never cuts it off for reading slowly), and writes made through its
/// session — by it, by another mirror, by `session.set` — are shown from their replies
/// rather than echoed back. Pass `options: .default` to receive every revision as an event.
@MainActor @Observable
public final class RemoteRepository {
    /// The mirrored state: changes as a whole, once per revision.
    public struct Contents: Sendable, Equatable {
        /// The revision the values are at (0 before the first snapshot).
        public var revision: UInt64 = 0
        /// The selected keys that exist, with their values.
        public var values: [Key: JSONValue] = [:]
        /// Whether the first snapshot has arrived.
        public var isLoaded = false
        /// For the selected keys that went away because the lease they were attached to ended:
        /// which lease, and why (`expired`, `revoked`, `closed`) — until the key is written
        /// again. Only a deletion the mirror received as its own event says so: not one
        /// folded into a coalesced event, nor one missed across a resync.
        public var leaseEnds: [Key: LeaseEnd] = [:]
    }

    /// The repository mirrored.
    public let name: String
    /// The keys mirrored.
    public let selection: Selection
    /// The options of the mirror's subscriptions.
    public let options: SubscriptionOptions
    /// The mirrored state.
    public private(set) var contents = Contents()
    /// The session's connection state.
    public private(set) var connection: ConnectionState
    /// Why the mirror stopped following the daemon for good (`forbidden` when access was
    /// revoked, `sessionClosed`); nil while it follows.
    public private(set) var failure: ObsClientError?

    @ObservationIgnored private let session: ObsSession
    @ObservationIgnored private let link: MirrorLink

    /// Starts mirroring `selection` of repository `name` through `session`.
    ///
    /// - Parameters:
    ///   - name: the repository.
    ///   - selection: the keys mirrored: some, a prefix, or all of them.
    ///   - options: the watch's subscription options; by default `.mirror` (coalesced, no
    ///     echo). With `writers`, nothing changes: a mirror keeps values only.
    ///   - session: the session to follow the daemon through; by default ``ObsSession/shared``.
    public init(_ name: String, selection: Selection = .all, options: SubscriptionOptions = .mirror, session: ObsSession = .shared) {
        self.name = name
        self.selection = selection
        self.options = options
        self.session = session
        self.connection = session.connectionState
        self.link = MirrorLink(selection: selection)
        link.start(
            session: session, watch: session.watch(name, selecting: selection, initial: true, options: options),
            update: { [weak self] state, _ in self?.publish(state) },
            state: { [weak self] state in self?.connection = state },
            end: { [weak self] error in self?.failure = error })
    }

    isolated deinit { link.stop() }

    /// The values of the selected keys.
    public var values: [Key: JSONValue] { contents.values }
    /// The revision the values are at.
    public var revision: UInt64 { contents.revision }

    /// The value of `key`, or nil if it does not exist (or is not selected).
    public subscript(key: Key) -> JSONValue? { contents.values[key] }

    /// Why `key` went away, if it did because its lease ended (see ``Contents/leaseEnds``).
    public func leaseEnd(of key: Key) -> LeaseEnd? { contents.leaseEnds[key] }

    /// The value of `key` decoded as `T`, or nil if it does not exist.
    public func value<T: Decodable>(_ key: Key, as type: T.Type = T.self) throws(ObsClientError) -> T? {
        try contents.values[key].map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
    }

    /// Sets `key` to `value`; with `ifRevision`, only if the key's revision is still that (0:
    /// only if it does not exist). Returns once the mirror shows the write (for a selected key).
    @discardableResult
    public func set(_ key: Key, to value: JSONValue, ifRevision: UInt64? = nil, force: Bool = false) async throws(ObsClientError) -> RemoteWriteResult {
        try await link.write { () async throws(ObsClientError) in
            try await session.set(key, to: value, in: name, ifRevision: ifRevision, force: force)
        }
    }

    /// Sets `key` to the JSON encoding of `value` (see `set(_:to:ifRevision:force:)`).
    @discardableResult
    public func set<T: Encodable>(_ key: Key, to value: T, ifRevision: UInt64? = nil, force: Bool = false) async throws(ObsClientError) -> RemoteWriteResult {
        try await set(key, to: try JSONValue(encoding: value), ifRevision: ifRevision, force: force)
    }

    /// Deletes `key` (with `ifRevision`, only if its revision is still that).
    @discardableResult
    public func delete(_ key: Key, ifRevision: UInt64? = nil) async throws(ObsClientError) -> RemoteWriteResult {
        try await link.write { () async throws(ObsClientError) in
            try await session.delete(key, in: name, ifRevision: ifRevision)
        }
    }

    /// Stops following the daemon; the contents stay as they are.
    public func stop() { link.stop() }

    private func publish(_ state: MirrorState) {
        let next = Contents(revision: state.revision, values: state.values, isLoaded: state.isLoaded, leaseEnds: state.leaseEnds)
        if next != contents { contents = next }  // one notification per revision, none for nothing
    }
}
