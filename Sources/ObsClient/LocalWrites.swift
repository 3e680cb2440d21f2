// ObsClient — writes made on a session's connections, told to its mirrors from their
// replies. A mirror subscribes with `echo: false` (by default): the daemon sends it no
// event for a revision written on its own connection — and that connection is the
// session's, shared by every mirror and every `session.set` of the process. So the client
// reports each write that changed something, with its revision, the moment its reply is
// read (on the event loop, before any later message of that connection is routed), and
// the session hands it to its mirrors; each mirror merges it by revision (MirrorState).

import ObsProtocol
import ObservableKit
import Synchronization

/// A write that changed a repository, as its reply reported it.
struct LocalWrite: Sendable {
    /// A key's value after the write; nil for a deletion.
    struct Effect: Sendable {
        let key: Key
        let new: JSONValue?
    }

    let repository: String
    /// The revision the write made.
    let revision: UInt64
    /// What it did to each key it named (for a batch, every operation: one that changed
    /// nothing leaves the value it names, which is the current one).
    let effects: [Effect]
    /// The connection it was made on (`ObsClient.serial`).
    let connection: UInt64
}

/// Where a client reports its writes: the session's mirrors.
final class LocalWriteFanOut: Sendable {
    private let listeners = ObserverSet<LocalWriteInbox>()

    /// Hands `write` to every inbox of its repository (on the caller's thread, no lock held).
    func publish(_ write: LocalWrite) {
        listeners.forEach { _, inbox in
            if inbox.repository == write.repository { inbox.deliver(write) }
        }
    }

    func add(_ inbox: LocalWriteInbox) -> ObserverID { listeners.insert(inbox) }
    func remove(_ id: ObserverID) { listeners.remove(id) }

    /// Has every mirror apply the writes queued for it now, so that when a write through one
    /// mirror returns, every mirror of the session shows it.
    @MainActor func drainAll() {
        listeners.forEach { _, inbox in inbox.drain() }
    }
}

/// One mirror's queue of its session's writes, filled on any thread and emptied on the
/// main actor by `drain`, which is scheduled when the queue stops being empty.
final class LocalWriteInbox: Sendable {
    let repository: String
    private let queue = Locked<[LocalWrite]>([])
    /// Applies the queued writes to the mirror (it calls `take()`).
    let drain: @MainActor @Sendable () -> Void

    init(repository: String, drain: @escaping @MainActor @Sendable () -> Void) {
        self.repository = repository
        self.drain = drain
    }

    func deliver(_ write: LocalWrite) {
        let wasEmpty = queue.withLock { queue in
            queue.append(write)
            return queue.count == 1
        }
        if wasEmpty { Task { @MainActor [drain] in drain() } }
    }

    /// The writes queued so far, oldest first; the queue is left empty.
    func take() -> [LocalWrite] {
        queue.withLock { queue in
            defer { queue = [] }
            return queue
        }
    }
}

/// Serial numbers of client connections, increasing in the order they were made.
enum ConnectionSerial {
    private static let counter = Atomic<UInt64>(0)
    static func next() -> UInt64 { counter.add(1, ordering: .relaxed).newValue }
}
