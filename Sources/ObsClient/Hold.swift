// ObsClient — holds: a key that exists while this process holds it ("the indexer is up").
// A `Hold` writes the key on a lease bound to the session's connection, so the daemon deletes
// it when the process dies, however it dies. When the connection drops (the daemon restarted,
// the socket broke), the daemon deletes the key — its lease ended with the connection — and
// the hold's task grants a new lease on the next connection and writes the key again: between
// the two, for as long as the session takes to reconnect, the key is absent. `release()`,
// dropping the handle, or (with `withHold`) the end or cancellation of the body revoke the
// lease, which deletes the key at once.

import ObsProtocol
import ObservableKit

/// A key held at a value while this process holds it (see ``ObsSession/hold(_:as:in:)``).
public final class Hold: Sendable {
    /// The key held.
    public let key: Key
    /// Its repository.
    public let repository: String
    /// The value it is held at.
    public let value: JSONValue
    fileprivate let keeper: HoldKeeper

    fileprivate init(key: Key, repository: String, value: JSONValue, keeper: HoldKeeper) {
        self.key = key
        self.repository = repository
        self.value = value
        self.keeper = keeper
    }

    /// Dropping the handle releases the key (its lease is revoked without waiting).
    deinit { keeper.cancel() }

    /// Whether the key is held now: false while the session reconnects (the key is absent
    /// then), after a failure, and once released.
    public var isHeld: Bool { keeper.snapshot.lease != nil }

    /// The lease the key is attached to now; nil while it is not held.
    public var lease: Lease.ID? { keeper.snapshot.lease }

    /// Why the hold stopped writing the key again after a reconnection (say `forbidden`, when
    /// the daemon's policy changed); nil while it holds or reconnects.
    public var failure: ObsClientError? { keeper.snapshot.failure }

    /// Ends the hold: revokes its lease, which deletes the key, and returns once the daemon
    /// has done so (or at once, if the hold was not connected).
    public func release() async {
        keeper.cancel()
        await keeper.finished()
    }
}

extension ObsSession {
    /// Holds `key` of `repository` at `value` for as long as the returned handle lives.
    ///
    /// The key is written on a lease bound to the session's connection: if the process dies,
    /// the daemon deletes it (watchers see the deletion with `lease.end` `closed`). After the
    /// session reconnects, the hold writes it again on a new lease; **in between, the key is
    /// absent**. ``Hold/release()`` or dropping the handle deletes it.
    ///
    /// ```swift
    /// let up = try await session.hold("indexer/up", as: true, in: "svc")
    /// defer { Task { await up.release() } }
    /// ```
    ///
    /// - Returns: once the key is written (the first time).
    /// - Throws: what the first write failed with — a refusal of the daemon (`forbidden`,
    ///   `badRequest`, `overloaded` at the lease limit), `sessionClosed`, or `cancelled`.
    public func hold(_ key: Key, as value: JSONValue, in repository: String) async throws(ObsClientError) -> Hold {
        let keeper = HoldKeeper(key: key, repository: repository, value: value, core: core)
        let hold = Hold(key: key, repository: repository, value: value, keeper: keeper)
        let first = await withTaskCancellationHandler {
            await keeper.established()
        } onCancel: {
            keeper.cancel()
        }
        try first.get()
        return hold
    }

    /// Holds `key` of `repository` at `value` while `body` runs: releases it when `body`
    /// returns or throws, and as soon as the task running it is cancelled (without waiting for
    /// `body` to notice).
    public func withHold<R: Sendable>(
        _ key: Key, as value: JSONValue, in repository: String, isolation: isolated (any Actor)? = #isolation,
        _ body: (Hold) async throws -> R
    ) async throws -> R {
        let hold = try await self.hold(key, as: value, in: repository)
        do {
            let keeper = hold.keeper
            let result = try await withTaskCancellationHandler {
                try await body(hold)
            } onCancel: {
                keeper.cancel()
            }
            await hold.release()
            return result
        } catch {
            await hold.release()
            throw error
        }
    }
}

/// A hold's task: writes the key on a connection-bound lease, waits for that connection to
/// close, and writes it again on the next one, until cancelled — then revokes the lease.
final class HoldKeeper: Sendable {
    struct Snapshot {
        var lease: Lease.ID?
        var failure: ObsClientError?
    }

    private struct State {
        var snapshot = Snapshot()
        /// The first write's outcome, once known, and who waits for it.
        var first: Result<Void, ObsClientError>?
        var firstWaiters: [CheckedContinuation<Result<Void, ObsClientError>, Never>] = []
        var task: Task<Void, Never>?
        var done = false
        var doneWaiters: [CheckedContinuation<Void, Never>] = []
    }

    private let key: Key
    private let repository: String
    private let value: JSONValue
    private let core: SessionCore
    private let state = Locked(State())

    init(key: Key, repository: String, value: JSONValue, core: SessionCore) {
        self.key = key
        self.repository = repository
        self.value = value
        self.core = core
        let task = Task { [self] in
            await run()
            finish()
        }
        state.withLock { $0.task = task }
    }

    var snapshot: Snapshot { state.withLock { $0.snapshot } }

    func cancel() { state.withLock { $0.task }?.cancel() }

    /// Returns once the key was written the first time, or what that failed with.
    func established() async -> Result<Void, ObsClientError> {
        await withCheckedContinuation { (continuation: CheckedContinuation<Result<Void, ObsClientError>, Never>) in
            let now: Result<Void, ObsClientError>? = state.withLock { s in
                if let first = s.first { return first }
                s.firstWaiters.append(continuation)
                return nil
            }
            if let now { continuation.resume(returning: now) }
        }
    }

    /// Returns once the task has ended (after revoking the lease).
    func finished() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let now = state.withLock { s in
                if s.done { return true }
                s.doneWaiters.append(continuation)
                return false
            }
            if now { continuation.resume() }
        }
    }

    private func run() async {
        while !Task.isCancelled {
            let client: ObsConnection
            do {
                client = try await core.client()
            } catch {
                return report(error)
            }
            let closed = OneShot()
            client.whenClosed { closed.fire() }
            do throws(ObsClientError) {
                let reply = try await client.call(.lease(.grant(ttl: nil)), as: GrantReply.self)
                let lease = Lease.ID(rawValue: reply.lease)
                try await client.set(key, to: value, in: repository, lease: lease)
                state.withLock { $0.snapshot = Snapshot(lease: lease) }
                report(nil)
                await closed.wait()  // the connection closed, or the hold was cancelled
                state.withLock { $0.snapshot.lease = nil }
                if Task.isCancelled {
                    // Revoke on the connection that granted it (if it closed, the lease ended with it).
                    _ = try? await client.call(.lease(.revoke(lease: lease.rawValue)), as: RevokeReply.self)
                    return
                }
            } catch where error.code == .connectionClosed {
                continue  // the session reconnects; write the key again on the next connection
            } catch {
                return report(error)
            }
        }
        report(.cancelled)
    }

    /// Records the first write's outcome (a later failure ends the hold as `failure`).
    private func report(_ error: ObsClientError?) {
        let waiters: [CheckedContinuation<Result<Void, ObsClientError>, Never>] = state.withLock { s in
            if let error, s.first != nil, error.code != .cancelled { s.snapshot.failure = error }
            guard s.first == nil else { return [] }
            s.first = error.map { .failure($0) } ?? .success(())
            defer { s.firstWaiters = [] }
            return s.firstWaiters
        }
        let result: Result<Void, ObsClientError> = error.map { .failure($0) } ?? .success(())
        for waiter in waiters { waiter.resume(returning: result) }
    }

    private func finish() {
        let waiters = state.withLock { s in
            s.done = true
            s.snapshot.lease = nil
            defer { s.doneWaiters = [] }
            return s.doneWaiters
        }
        for waiter in waiters { waiter.resume() }
    }
}

/// A signal fired once — by a connection closing, or by cancellation of the task waiting on it.
final class OneShot: Sendable {
    private let state = Locked<(fired: Bool, waiter: CheckedContinuation<Void, Never>?)>((false, nil))

    func fire() {
        let waiter = state.withLock { s in
            s.fired = true
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume()
    }

    /// Returns once fired, or once the waiting task is cancelled.
    func wait() async {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s in
                    if s.fired { return true }
                    s.waiter = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            fire()
        }
    }
}
