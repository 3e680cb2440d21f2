// ObsClient — remote keys as Swift Observation models. `RemoteRepository` mirrors the
// selected keys of one repository into an `@Observable` object on the main actor, from one
// resumable watch: each revision is applied in one assignment, so an observer of any of
// its properties is notified once per revision — a batch of several keys included — and
// not at all for a write that changed nothing. Works with SwiftUI on Apple platforms and
// with `withObservationTracking` everywhere.

import Observation
import ObsProtocol
import ObservableKit

/// What a write through a mirror did.
public enum WriteResult: Sendable, Equatable {
    /// The write changed the key at `revision`; the mirror already shows it when the key
    /// is one the mirror selects.
    case applied(revision: UInt64)
    /// The key already held an equal value: nothing changed and nobody was notified.
    case unchanged(revision: UInt64)
    /// `ifRev` did not match the key's revision: nothing changed. Read again and retry.
    case conflict
}

/// The selected keys of one repository, kept current from the daemon.
///
/// ```swift
/// let session = ObsSession()
/// let ui = RemoteRepository("ui", session: session)        // every key of "ui"
/// // SwiftUI: Text(ui["theme"]?.stringValue ?? "default")  — redrawn when theme changes
/// try await ui.set("theme", "dark")                          // returns once ui shows it
/// ```
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
    }

    /// The repository mirrored.
    public let name: String
    /// The keys mirrored.
    public let selection: Selection
    /// The mirrored state.
    public private(set) var contents = Contents()
    /// The session's connection state.
    public private(set) var connection: ConnectionState
    /// Why the mirror stopped following the daemon for good (`forbidden` when access was
    /// revoked, `sessionClosed`); nil while it follows.
    public private(set) var failure: ObsClientError?

    @ObservationIgnored private let session: ObsSession
    @ObservationIgnored private let link = MirrorLink()

    /// Starts mirroring `selection` of repository `name` through `session`.
    public init(_ name: String, selection: Selection = .all, session: ObsSession) {
        self.name = name
        self.selection = selection
        self.session = session
        self.connection = session.connectionState
        link.start(
            session: session, watch: session.watch(name, selection, initial: true),
            apply: { [weak self] event in self?.apply(event) },
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

    /// The value of `key` decoded as `T`, or nil if it does not exist.
    public func value<T: Decodable>(_ key: Key, as type: T.Type = T.self) throws(ObsClientError) -> T? {
        try contents.values[key].map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
    }

    /// Sets `key`; with `ifRev`, only if the key's revision is still `ifRev` (0: only if
    /// it does not exist). Returns once the mirror shows the write (for a selected key).
    @discardableResult
    public func set(_ key: Key, _ value: JSONValue, ifRev: UInt64? = nil, force: Bool = false) async throws(ObsClientError) -> WriteResult {
        try await link.write(key: key, selected: selection.matches(key)) { () async throws(ObsClientError) in
            try await session.set(name, key, value, ifRev: ifRev, force: force)
        }
    }

    /// Sets `key` to the JSON encoding of `value` (see `set(_:_:ifRev:force:)`).
    @discardableResult
    public func set<T: Encodable>(_ key: Key, encoding value: T, ifRev: UInt64? = nil) async throws(ObsClientError) -> WriteResult {
        try await set(key, try JSONValue(encoding: value), ifRev: ifRev)
    }

    /// Deletes `key` (with `ifRev`, only if its revision is still `ifRev`).
    @discardableResult
    public func delete(_ key: Key, ifRev: UInt64? = nil) async throws(ObsClientError) -> WriteResult {
        try await link.write(key: key, selected: selection.matches(key)) { () async throws(ObsClientError) in
            try await session.delete(name, key, ifRev: ifRev)
        }
    }

    /// Stops following the daemon; the contents stay as they are.
    public func stop() { link.stop() }

    private func apply(_ event: WatchEvent) {
        var next = contents
        switch event {
        case .snapshot(let revision, let values, _):
            next = Contents(revision: revision, values: values, isLoaded: true)
        case .change(let changes):
            next.revision = changes.revision
            for change in changes.changes { next.values[change.key] = change.new }
        }
        if next != contents { contents = next }  // one notification per revision, none for nothing
        link.reached(event)
    }
}

/// Runs a mirror's watch and connection-state tasks on the main actor, and lets a write
/// wait until the mirror has applied the revision it produced.
@MainActor
final class MirrorLink {
    private var tasks: [Task<Void, Never>] = []
    private var waiters: [(revision: UInt64, continuation: CheckedContinuation<Void, Never>)] = []
    private var revision: UInt64 = 0
    private var stopped = false

    func start(
        session: ObsSession, watch: Watch,
        apply: @escaping @MainActor (WatchEvent) -> Void,
        state: @escaping @MainActor (ConnectionState) -> Void,
        end: @escaping @MainActor (ObsClientError) -> Void
    ) {
        tasks.append(
            Task { [weak self] in
                do {
                    for try await event in watch { apply(event) }
                } catch let error as ObsClientError {
                    end(error)
                } catch {
                    end(.cancelled)
                }
                self?.stop()
            })
        let states = session.connectionStates()
        tasks.append(Task { for await s in states { state(s) } })
    }

    /// Records that the mirror shows `event`'s revision; wakes the writes waiting for it —
    /// all of them after a resync, whose snapshot holds every write the daemon still has
    /// (a restarted in-memory daemon may be at a lower revision than a write it lost).
    func reached(_ event: WatchEvent) {
        revision = event.revision
        let resync = if case .snapshot(_, _, true) = event { true } else { false }
        waiters.removeAll { waiter in
            guard resync || waiter.revision <= revision else { return false }
            waiter.continuation.resume()
            return true
        }
    }

    /// Performs a write; when it changed a selected key, waits for the mirror to show it.
    func write(key: Key, selected: Bool, _ body: () async throws(ObsClientError) -> WriteReply) async throws(ObsClientError) -> WriteResult {
        let reply: WriteReply
        do {
            reply = try await body()
        } catch .server(let error) where error.code == .conflict {
            return .conflict
        }
        guard reply.changed else { return .unchanged(revision: reply.revision) }
        if selected && !stopped && revision < reply.revision {
            await withCheckedContinuation { waiters.append((reply.revision, $0)) }
        }
        return .applied(revision: reply.revision)
    }

    func stop() {
        stopped = true
        for task in tasks { task.cancel() }
        tasks = []
        for waiter in waiters { waiter.continuation.resume() }
        waiters = []
    }
}
