// ObsClient — the engine of the Observation mirrors: runs a mirror's watch and
// connection-state tasks on the main actor, receives the writes made through its session,
// merges both into a `MirrorState`, and hands each step to the mirror to publish, with the
// keys it changed. Its `sync` returns once the mirror shows every write acknowledged before
// the call: with the daemon's `sync` (whose reply follows every event it covers, and leaves
// a mark in the watch's stream where it arrived, see WatchMonitor.swift), or — from a daemon
// without it (`unknown_op`) — by reading the repository's revision and waiting until the
// watch's events, or its `progress` events, bring the mirror there.

import ObsProtocol
import ObservableKit

/// What changed in a mirror's state in one step.
enum MirrorUpdate {
    /// A snapshot replaced the state; these keys' values (or lease ends) changed.
    case snapshot(changed: [Key])
    /// These keys were written (a forced write of an equal value included).
    case keys([Key])

    /// The keys whose observers are told.
    var changed: [Key] {
        switch self {
        case .snapshot(let keys), .keys(let keys): return keys
        }
    }
}

/// Runs a mirror's watch and connection-state tasks on the main actor, and lets a write
/// return once the mirror shows it.
@MainActor
final class MirrorLink {
    private(set) var state: MirrorState
    private var tasks: [Task<Void, Never>] = []
    private var inbox: (fanOut: LocalWriteFanOut, id: ObserverID, queue: LocalWriteInbox)?
    private var update: (@MainActor (MirrorState, MirrorUpdate) -> Void)?
    /// Writes waiting for the first snapshot, to return with the mirror loaded.
    private var loadWaiters: [CheckedContinuation<Void, Never>] = []
    /// For tests: awaited by a write between finding the mirror not loaded and registering its
    /// wait — where the snapshot may be applied (see `write`).
    var beforeWaitingForLoad: (@MainActor () async -> Void)?
    private var stopped = false
    /// Where the watch is, for `sync`.
    private let monitor = WatchMonitor()
    /// The connections (serial numbers) whose daemon answered `sync` with `unknown_op`.
    private var withoutSync: Swift.Set<UInt64> = []
    private var repository = ""

    init(selection: Selection) {
        state = MirrorState(selection: selection)
    }

    func start(
        session: ObsSession, watch: Watch,
        update: @escaping @MainActor (MirrorState, MirrorUpdate) -> Void,
        state: @escaping @MainActor (ConnectionState) -> Void,
        end: @escaping @MainActor (ObsClientError) -> Void
    ) {
        self.update = update
        repository = watch.repository
        let queue = LocalWriteInbox(repository: watch.repository) { [weak self] in self?.drain() }
        let fanOut = session.core.localWrites
        inbox = (fanOut, fanOut.add(queue), queue)
        let monitor = self.monitor
        tasks.append(
            Task { [weak self] in
                var events = watch.makeAsyncIterator()
                events.monitor = monitor
                do {
                    while let event = try await events.next() {
                        guard let self else { return }
                        self.receive(event, connection: events.connection)
                    }
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

    /// Applies an event of the watch, after the session's writes read before it.
    private func receive(_ event: WatchEvent, connection: UInt64) {
        drain()
        let written = state.apply(event, connection: connection)
        if case .snapshot = event {
            update?(state, .snapshot(changed: written))
            resumeLoadWaiters()
        } else if !written.isEmpty {
            update?(state, .keys(written))
        }
    }

    private func resumeLoadWaiters() {
        let waiters = loadWaiters
        loadWaiters = []
        for waiter in waiters { waiter.resume() }
    }

    /// Applies the session's writes received so far, one step each.
    private func drain() {
        guard let queue = inbox?.queue else { return }
        for write in queue.take() {
            let written = state.apply(write)
            if !written.isEmpty { update?(state, .keys(written)) }
        }
    }

    /// Performs a write; when it changed something, returns once the mirror — and every other
    /// mirror of the session — shows it (its reply was reported to the session's mirrors
    /// before `body` returned), and this mirror is loaded.
    func write(_ body: () async throws(ObsClientError) -> WriteReply<JSONValue>) async throws(ObsClientError) -> RemoteWriteResult {
        let reply: WriteReply<JSONValue>
        do {
            reply = try await body()
        } catch where error.code == .conflict {
            return .conflict
        }
        guard reply.changed else { return .unchanged(revision: reply.revision) }
        if let inbox { inbox.fanOut.drainAll() } else { drain() }
        if !state.isLoaded && !stopped {
            if let beforeWaitingForLoad { await beforeWaitingForLoad() }
            // Checked again where the waiter is registered: `withCheckedContinuation` may
            // suspend before it runs its body — a task with a task executor preference (a test
            // under `.mayBlock`) is enqueued on the main actor again, behind jobs already queued
            // there — and the watch's task may apply the snapshot, and resume the waiters it
            // finds, meanwhile. A waiter registered after that would wait forever.
            await withCheckedContinuation { (waiter: CheckedContinuation<Void, Never>) in
                if state.isLoaded || stopped {
                    waiter.resume()
                } else {
                    loadWaiters.append(waiter)
                }
            }
        }
        return .applied(revision: reply.revision)
    }

    /// Returns once the mirror shows every write acknowledged (to anyone) before the call: the
    /// revision it then shows (see the file header). Throws when the mirror stopped following
    /// the daemon, or the waiting task was cancelled.
    func sync() async throws(ObsClientError) -> UInt64 {
        var stale: UInt64?  // a subscription found gone: wait for the one that resumes it
        while true {
            if stopped { throw .cancelled }
            let current = try await monitor.current(newerThan: stale)
            let serial = current.connection.serial
            let revision: UInt64
            if !withoutSync.contains(serial) {
                let mark = monitor.newMark()
                do throws(ObsClientError) {
                    revision = try await current.connection.sync(current.subscription, mark: mark)
                } catch {
                    monitor.forget(mark: mark)
                    if error.code == .server(.unknownOp) {
                        withoutSync.insert(serial)
                    } else if error.code == .notFound || error.code == .connectionClosed || error.code == .overflowed {
                        stale = current.generation  // the subscription ended meanwhile
                    } else {
                        throw error
                    }
                    continue
                }
                guard try await monitor.waitUntilReached(mark: mark, generation: current.generation) == .done else {
                    stale = current.generation
                    continue
                }
            } else {
                // A daemon without `sync`: its revision now, then the watch's events and
                // `progress` events bring the mirror there (within about a second).
                let probe: Subscription
                do throws(ObsClientError) {
                    probe = try await current.connection.subscribe(to: repository, selecting: .keys([]))
                } catch where error.code == .connectionClosed {
                    stale = current.generation
                    continue
                }
                try? await probe.cancel()
                guard try await monitor.waitUntilConsumed(through: probe.revision, epoch: probe.epoch, generation: current.generation) == .done
                else {
                    stale = current.generation
                    continue
                }
                revision = probe.revision
            }
            if stopped { throw .cancelled }
            // The session's own writes acknowledged before the call are not echoed: their replies are queued.
            if let inbox { inbox.fanOut.drainAll() } else { drain() }
            state.markCurrent(at: revision, connection: serial)
            update?(state, .keys([]))
            return revision
        }
    }

    func stop() {
        guard !stopped else { return }
        stopped = true
        monitor.end(.cancelled)
        for task in tasks { task.cancel() }
        tasks = []
        if let inbox { inbox.fanOut.remove(inbox.id) }
        inbox = nil
        resumeLoadWaiters()
    }
}
