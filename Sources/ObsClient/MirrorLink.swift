// ObsClient — the engine of the Observation mirrors: runs a mirror's watch and
// connection-state tasks on the main actor, receives the writes made through its session,
// merges both into a `MirrorState`, and hands each step to the mirror to publish.

import ObsProtocol
import ObservableKit

/// What changed in a mirror's state in one step.
enum MirrorUpdate {
    /// A snapshot replaced the state.
    case snapshot
    /// These keys were written (a forced write of an equal value included).
    case keys([Key])
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
    private var stopped = false

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
        let queue = LocalWriteInbox(repository: watch.repository) { [weak self] in self?.drain() }
        let fanOut = session.core.localWrites
        inbox = (fanOut, fanOut.add(queue), queue)
        tasks.append(
            Task { [weak self] in
                var events = watch.makeAsyncIterator()
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
        if let written {
            if !written.isEmpty { update?(state, .keys(written)) }
        } else {
            update?(state, .snapshot)
            resumeLoadWaiters()
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
            await withCheckedContinuation { loadWaiters.append($0) }
        }
        return .applied(revision: reply.revision)
    }

    func stop() {
        guard !stopped else { return }
        stopped = true
        for task in tasks { task.cancel() }
        tasks = []
        if let inbox { inbox.fanOut.remove(inbox.id) }
        inbox = nil
        resumeLoadWaiters()
    }
}
