// ObsClient — one remote key as a typed Swift Observation model: `RemoteValue<Value>`
// holds the key's current value as `Value`, kept current from a resumable watch, with
// typed writes, an optimistic read-modify-write (`update`) over compare-and-set, and `sync`.
// Like `RemoteRepository`, it watches with `SubscriptionOptions.mirror` (coalesced, no echo)
// unless told otherwise, and is notified only by a step that changed its key.

import Observation
import ObsProtocol
import ObservableKit

/// One key of a repository, as a `Value`, kept current from the daemon.
///
/// ```swift
/// enum Theme: String, Codable, Sendable { case light, dark }
/// let theme = RemoteValue("theme", in: "ui", as: Theme.self)   // on ObsSession.shared
/// // SwiftUI: Text(theme.value?.rawValue ?? "default")
/// try await theme.set(.dark)
/// ```
///
/// Writes made through the session (this value's, another mirror's, `session.set`) are
/// shown from their replies; other writers' arrive as events, coalesced while it lags.
@MainActor @Observable
public final class RemoteValue<Value: Codable & Sendable> {
    /// The key's mirrored state: changes as a whole, once per revision.
    public struct Current: Sendable {
        /// The value; nil when the key does not exist or its value is not a `Value`.
        public var value: Value?
        /// Whether the key exists.
        public var exists = false
        /// The revision the value is at (0 before the first snapshot).
        public var revision: UInt64 = 0
        /// Whether the first snapshot has arrived.
        public var isLoaded = false
        /// Why the key's value is not a `Value`, when it is not.
        public var decodingError: ObsClientError?
        /// When the key went away because the lease it was attached to ended: which lease, and
        /// why (`expired`, `revoked`, `closed`); nil once it is written again (see
        /// ``RemoteRepository/Contents/leaseEnds``).
        public var leaseEnd: LeaseEnd?
    }

    /// The repository of the key.
    public let repository: String
    /// The key mirrored.
    public let key: Key
    /// The options of the mirror's subscriptions.
    public let options: SubscriptionOptions
    /// The mirrored state.
    public private(set) var current = Current()
    /// The session's connection state.
    public private(set) var connection: ConnectionState
    /// Why the value stopped following the daemon for good; nil while it follows.
    public private(set) var failure: ObsClientError?

    @ObservationIgnored private let session: ObsSession
    @ObservationIgnored private let link: MirrorLink

    /// Starts mirroring `key` of `repository` through `session`.
    ///
    /// - Parameters:
    ///   - key: the key.
    ///   - repository: its repository.
    ///   - type: the type its value decodes as (a value that does not is `nil`, and
    ///     `current.decodingError` says why).
    ///   - options: the watch's subscription options; by default `.mirror` (coalesced, no echo).
    ///   - session: the session to follow the daemon through; by default ``ObsSession/shared``.
    public init(
        _ key: Key, in repository: String, as type: Value.Type = Value.self, options: SubscriptionOptions = .mirror,
        session: ObsSession = .shared
    ) {
        self.repository = repository
        self.key = key
        self.options = options
        self.session = session
        self.connection = session.connectionState
        self.link = MirrorLink(selection: .keys([key]))
        link.start(
            session: session, watch: session.watch(repository, selecting: .keys([key]), initial: true, options: options),
            update: { [weak self] state, update in self?.publish(state, update) },
            state: { [weak self] state in self?.connection = state },
            end: { [weak self] error in self?.failure = error })
    }

    isolated deinit { link.stop() }

    /// The value; nil when the key does not exist or its value is not a `Value`.
    public var value: Value? { current.value }

    /// Sets the key to `value`; with `ifRevision`, only if the key's revision is still that
    /// (0: only if it does not exist). Returns once this mirror shows the write.
    @discardableResult
    public func set(_ value: Value, ifRevision: UInt64? = nil, force: Bool = false) async throws(ObsClientError) -> RemoteWriteResult {
        let json = try JSONValue(encoding: value)
        return try await link.write { () async throws(ObsClientError) in
            try await session.set(key, to: json, in: repository, ifRevision: ifRevision, force: force)
        }
    }

    /// Deletes the key (with `ifRevision`, only if its revision is still that).
    @discardableResult
    public func delete(ifRevision: UInt64? = nil) async throws(ObsClientError) -> RemoteWriteResult {
        try await link.write { () async throws(ObsClientError) in
            try await session.delete(key, in: repository, ifRevision: ifRevision)
        }
    }

    /// Reads the key, computes its next value from it, and writes that only if nobody wrote
    /// the key in between (compare-and-set on its revision). Returns `.conflict` if someone
    /// did; call again to retry on the newer value.
    @discardableResult
    public func update(_ transform: (Value?) throws -> Value) async throws(ObsClientError) -> RemoteWriteResult {
        let entry = try await session.get(key, in: repository, as: Value.self)
        let next: Value
        do {
            next = try transform(entry?.value)
        } catch let error as ObsClientError {
            throw error
        } catch {
            throw .unencodable(type: "\(Value.self)", reason: "the update failed: \(error)")
        }
        return try await set(next, ifRevision: entry?.revision ?? 0)
    }

    /// Waits until the value shows every write acknowledged (to anyone) before the call, and
    /// returns the revision the repository was at (see ``RemoteRepository/sync()``).
    @discardableResult
    public func sync() async throws(ObsClientError) -> UInt64 {
        try await link.sync()
    }

    /// Stops following the daemon; the value stays as it is.
    public func stop() { link.stop() }

    /// Publishes a step that changed the key (or the first snapshot); none other — a catch-up
    /// or a snapshot after a reconnection that left the key as it was notifies nobody.
    private func publish(_ state: MirrorState, _ update: MirrorUpdate) {
        if current.isLoaded, !update.changed.contains(key) { return }
        let json = state.values[key]
        var next = Current(exists: json != nil, revision: state.revision, isLoaded: true, leaseEnd: state.leaseEnds[key])
        do {
            next.value = try json.map { value throws(ObsClientError) in try value.decode(as: Value.self, key: key) }
        } catch {
            next.decodingError = error
        }
        current = next
    }
}
