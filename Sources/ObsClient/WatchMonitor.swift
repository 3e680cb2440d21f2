// ObsClient — what a mirror's `sync` needs to know of the watch it follows, shared between
// the watch's iterator (which updates it) and the mirror (which waits on it): the
// subscription the watch is on now, how far its consumer has got, and the sync marks it
// has reached.
//
// "How far the consumer has got" is the iterator's position and epoch at the moment the
// consumer asks for its next event — the consumer (MirrorLink) applies each event before it
// asks again — and at every `progress`, `synced` or sync mark the iterator reads, which come
// after every event it handed out. So a waiter that is resumed because the position reached
// a revision finds the mirror showing everything up to it.
//
// A `sync` leaves a mark in the subscription's stream where its reply arrived (ClientHandler);
// the iterator reports each mark it reads here. A mark lost with its subscription (a new one
// replaced it) is never reached: its waiter is resumed when the subscription changes and
// tries again on the new one.

import ObsProtocol
import ObservableKit

final class WatchMonitor: Sendable {
    /// The subscription a watch is on.
    struct Current: Sendable {
        let connection: ObsConnection
        let subscription: UInt64
        /// Counts the watch's subscriptions: a new one has a new generation.
        let generation: UInt64
    }

    /// How a wait for a mark or a position ended.
    enum Outcome: Sendable {
        /// What it waited for happened.
        case done
        /// The watch left the subscription first (or has none now): try again on the next one.
        case resubscribed
    }

    /// A waiting call: `poll` says, for a state, how to resume it (nil: not yet).
    private struct Waiter: Sendable {
        let poll: @Sendable (State) -> (@Sendable () -> Void)?
        let fail: @Sendable (ObsClientError) -> Void
    }

    private struct State {
        var current: Current?
        var generation: UInt64 = 0
        var position: UInt64?
        var epoch: String?
        var nextMark: UInt64 = 0
        /// Marks sent and not reached yet, and those reached and not yet taken by their waiter.
        var pending: Set<UInt64> = []
        var reached: Set<UInt64> = []
        /// Why the watch ended for good, once it did (nothing resumes it).
        var ended: ObsClientError?
        var waiters: [UInt64: Waiter] = [:]
        var nextWaiter: UInt64 = 0
    }

    private let locked = Locked(State())

    // MARK: The watch's side

    /// The watch subscribed anew.
    func opened(_ connection: ObsConnection, subscription: UInt64) {
        update { s in
            s.generation += 1
            s.current = Current(connection: connection, subscription: subscription, generation: s.generation)
        }
    }

    /// The watch's subscription ended (it will subscribe again, unless it ends).
    func lost() {
        update { s in s.current = nil }
    }

    /// The consumer has been handed, and has applied, everything through `position` of `epoch`.
    func consumed(position: UInt64?, epoch: String?) {
        update { s in
            s.position = position
            s.epoch = epoch
        }
    }

    /// The iterator read sync mark `mark`: everything before it was handed out and applied.
    func reached(mark: UInt64) {
        update { s in
            if s.pending.remove(mark) != nil { s.reached.insert(mark) }
        }
    }

    /// The watch ended for good: every wait fails with `error`.
    func end(_ error: ObsClientError) {
        update { s in
            if s.ended == nil { s.ended = error }
            s.current = nil
        }
    }

    // MARK: The mirror's side

    /// A new sync mark, pending until the iterator reaches it or `forget` drops it.
    func newMark() -> UInt64 {
        locked.withLock { s in
            s.nextMark += 1
            s.pending.insert(s.nextMark)
            return s.nextMark
        }
    }

    /// Drops a mark its waiter no longer waits for.
    func forget(mark: UInt64) {
        locked.withLock { s in
            s.pending.remove(mark)
            s.reached.remove(mark)
        }
    }

    /// The subscription the watch is on, waiting for one; not one of generation `stale` (a
    /// subscription a call found gone).
    func current(newerThan stale: UInt64? = nil) async throws(ObsClientError) -> Current {
        try await wait { s in
            guard let current = s.current, current.generation != stale else { return nil }
            return current
        }
    }

    /// Waits until the iterator reached `mark`, or left subscription `generation`.
    func waitUntilReached(mark: UInt64, generation: UInt64) async throws(ObsClientError) -> Outcome {
        defer { forget(mark: mark) }
        return try await wait { s in
            if s.reached.contains(mark) { return .done }
            return s.generation != generation || s.current == nil ? .resubscribed : nil
        }
    }

    /// Waits until the consumer has applied everything through `revision` of `epoch`, or the
    /// watch left subscription `generation`.
    func waitUntilConsumed(through revision: UInt64, epoch: String, generation: UInt64) async throws(ObsClientError) -> Outcome {
        try await wait { s in
            if let position = s.position, position >= revision, s.epoch == epoch { return .done }
            return s.generation != generation ? .resubscribed : nil
        }
    }

    // MARK: Plumbing

    /// Applies `change` and resumes the waiters whose condition now holds (or fails them all
    /// once the watch ended).
    private func update(_ change: (inout State) -> Void) {
        let (resumes, failed): ([@Sendable () -> Void], (ObsClientError, [Waiter])?) = locked.withLock { s in
            change(&s)
            if let ended = s.ended {
                defer { s.waiters = [:] }
                return ([], (ended, Array(s.waiters.values)))
            }
            var resumes: [@Sendable () -> Void] = []
            for (id, waiter) in s.waiters {
                if let resume = waiter.poll(s) {
                    resumes.append(resume)
                    s.waiters[id] = nil
                }
            }
            return (resumes, nil)
        }
        for resume in resumes { resume() }
        if let (error, waiters) = failed { for waiter in waiters { waiter.fail(error) } }
    }

    /// Waits until `evaluate` gives a value (it is asked now and at every update); throws the
    /// watch's end, or `cancelled` when the waiting task is cancelled.
    private func wait<T: Sendable>(_ evaluate: @escaping @Sendable (State) -> T?) async throws(ObsClientError) -> T {
        let id = locked.withLock { s in
            s.nextWaiter += 1
            return s.nextWaiter
        }
        do {
            return try await withTaskCancellationHandler {
                try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
                    let poll: @Sendable (State) -> (@Sendable () -> Void)? = { s in
                        guard let value = evaluate(s) else { return nil }
                        return { continuation.resume(returning: value) }
                    }
                    let fail: @Sendable (ObsClientError) -> Void = { error in continuation.resume(throwing: error) }
                    let immediate: Result<T, ObsClientError>? = locked.withLock { s in
                        if let ended = s.ended { return .failure(ended) }
                        if Task.isCancelled { return .failure(.cancelled) }
                        if let value = evaluate(s) { return .success(value) }
                        s.waiters[id] = Waiter(poll: poll, fail: fail)
                        return nil
                    }
                    if let immediate { continuation.resume(with: immediate) }
                }
            } onCancel: {
                locked.withLock { $0.waiters.removeValue(forKey: id) }?.fail(.cancelled)
            }
        } catch let error as ObsClientError {
            throw error
        } catch {
            throw .cancelled
        }
    }
}
