// ObsClient — remote keys as Swift Observation models. `RemoteRepository` mirrors the
// selected keys of one repository into an `@Observable` object on the main actor, from one
// resumable watch: each revision is applied in one assignment, so an observer of any of
// its properties is notified once per revision — a batch of several keys included — and
// not at all for a write that changed nothing. Reading one key (`mirror["theme"]`) observes
// that key alone: its observer is notified only by a step that changed it — so a catch-up
// after a resume, or a snapshot that replaced the state, notifies the observers of the keys
// it changed and nobody else. `sync()` waits until the mirror shows every write acknowledged
// before the call. Works with SwiftUI on Apple platforms and with `withObservationTracking`
// everywhere.
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
/// try await ui.sync()                                       // ui shows every write acknowledged so far
/// ```
///
/// An observer of ``contents``, ``values`` or ``revision`` is notified once per step the
/// mirror takes; one that reads keys through ``subscript(_:)``, ``value(_:as:)`` or
/// ``leaseEnd(of:)`` only by a step that changed one of those keys. After a reconnection the
/// mirror resumes where it was: the daemon replays what it missed, or — past its history —
/// sends the keys that changed since, which the mirror applies in place; only a daemon that
/// lost or replaced the history sends the whole state again, which replaces the mirror's
/// (and notifies the keys whose values differ).
///
/// The mirror subscribes with `SubscriptionOptions.mirror` unless told otherwise: changes
/// coalesce while it lags (it is notified of the state, not of every intermediate value,
/// and the daemon never cuts it off for reading slowly), and writes made through its
/// session — by it, by another mirror, by `session.set` — are shown from their replies
/// rather than echoed back. Pass `options: .default` to receive every revision as an event.
@MainActor @Observable
public final class RemoteRepository {
    /// The mirrored state: changes as a whole, once per step.
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
        /// folded into a coalesced event or a catch-up, nor one missed across a resync.
        public var leaseEnds: [Key: LeaseEnd] = [:]
    }

    /// The repository mirrored.
    public let name: String
    /// The keys mirrored.
    public let selection: Selection
    /// The options of the mirror's subscriptions.
    public let options: SubscriptionOptions
    /// The mirrored state. Its observers are notified once per step that changed it.
    public var contents: Contents {
        access(keyPath: \.contents)
        return stored
    }
    /// The session's connection state.
    public private(set) var connection: ConnectionState
    /// Why the mirror stopped following the daemon for good (`forbidden` when access was
    /// revoked, `sessionClosed`); nil while it follows.
    public private(set) var failure: ObsClientError?

    @ObservationIgnored private let session: ObsSession
    @ObservationIgnored let link: MirrorLink
    /// `contents`, observed through `contents` (as a whole) and `keyObservers` (per key).
    @ObservationIgnored private var stored = Contents()
    /// The observers of single keys: each registered under the key path `\.[observing: key]`.
    @ObservationIgnored private let keyObservers = ObservationRegistrar()

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
            update: { [weak self] state, update in self?.publish(state, update) },
            state: { [weak self] state in self?.connection = state },
            end: { [weak self] error in self?.failure = error })
    }

    isolated deinit { link.stop() }

    /// The values of the selected keys.
    public var values: [Key: JSONValue] { contents.values }
    /// The revision the values are at.
    public var revision: UInt64 { contents.revision }

    /// The value of `key`, or nil if it does not exist (or is not selected). An observer of it
    /// is notified only when `key` changes.
    public subscript(key: Key) -> JSONValue? {
        observe(key)
        return stored.values[key]
    }

    /// Why `key` went away, if it did because its lease ended (see ``Contents/leaseEnds``).
    /// An observer of it is notified only when `key` changes.
    public func leaseEnd(of key: Key) -> LeaseEnd? {
        observe(key)
        return stored.leaseEnds[key]
    }

    /// The value of `key` decoded as `T`, or nil if it does not exist. An observer of it is
    /// notified only when `key` changes.
    public func value<T: Decodable>(_ key: Key, as type: T.Type = T.self) throws(ObsClientError) -> T? {
        observe(key)
        return try stored.values[key].map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
    }

    /// Waits until the mirror shows every write acknowledged (to anyone) before the call, and
    /// returns the revision it then shows.
    ///
    /// A mirror follows the daemon's events, which may still be on their way: its contents
    /// can be older than a `get` sent now would say. After `sync()`, a read from the mirror is
    /// as fresh as that `get` — for another process's writes too. It asks the daemon which
    /// revision it is at (the `sync` operation, whose reply follows every event of the
    /// mirror's subscription up to that revision) and returns once the mirror has applied
    /// them. Across a reconnection it asks again on the resumed subscription. A daemon
    /// without the operation (`unknown_op`) is asked for the repository's revision instead,
    /// and the mirror waits until its events, or the daemon's `progress` events (sent within
    /// about a second), bring it there.
    ///
    /// - Returns: the revision the daemon reported: the mirror shows every write acknowledged
    ///   up to it.
    /// - Throws: the reason the mirror stopped following the daemon (`cancelled` after
    ///   ``stop()``), or `cancelled` when the waiting task is cancelled.
    @discardableResult
    public func sync() async throws(ObsClientError) -> UInt64 {
        try await link.sync()
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

    /// One step: one notification for the observers of `contents`, and one for those of each
    /// key it changed; none for a step that changed nothing.
    private func publish(_ state: MirrorState, _ update: MirrorUpdate) {
        let next = Contents(revision: state.revision, values: state.values, isLoaded: state.isLoaded, leaseEnds: state.leaseEnds)
        guard next != stored else { return }
        let keys = update.changed
        for key in keys { keyObservers.willSet(self, keyPath: \.[observing: key]) }
        withMutation(keyPath: \.contents) { stored = next }
        for key in keys { keyObservers.didSet(self, keyPath: \.[observing: key]) }
    }

    /// Registers an access to `key` alone with the observation being tracked.
    private func observe(_ key: Key) {
        keyObservers.access(self, keyPath: \.[observing: key])
    }

    /// The key path a key's observers are registered under (it reads nothing).
    private nonisolated subscript(observing key: Key) -> Bool { false }
}
