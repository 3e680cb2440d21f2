// ObsServer — a loop's replies waiting for durability: each held in its connection's outbox
// slot until storage makes the state it reports durable (then released, in order), or replaced
// by the error if storage fails and the state is undone (a subscription that began there ends).

import ObsProtocol
import ObsStore

extension LoopShard {
    // MARK: Durability waits (on the loop)

    /// Holds a reply in its slot until its state is durable; the line's `awaitDurable` said
    /// it is pending, and registered this loop for the news.
    func wait(_ waiter: Waiter, on line: some DurableLine) {
        loop.assertInLoop()
        waiters[line.lineID, default: []].append(waiter)
    }

    /// For a connection that sends replies in the middle of a read (Connection.sendEarly):
    /// where the storage mode made it cheap (`earlyCommit`), what this loop wrote is made
    /// durable now, and the replies whose states now are are released — the news handled,
    /// the revisions left for the tick, which handles news first too. Elsewhere nothing
    /// happens: held replies wait for the tick.
    func commitEarly() {
        loop.assertInLoop()
        guard let earlyCommit else { return }
        earlyCommit()
        handle(takeNews())
    }

    /// Releases (or fails) the waiting replies the news is about.
    func handle(_ news: [DurabilityNews]) {
        for item in news {
            switch item {
            case .durable(let line, let sequence): release(line, through: sequence)
            case .failed(let line, let undone, let error):
                fail(line, undone: undone, error)
                checkSyncs(failed: (line, undone, error))
            }
        }
    }

    /// Sends the waiting replies whose states are now durable, in order.
    fileprivate func release(_ line: any DurableLine, through sequence: StateSequence) {
        guard var queue = waiters.removeValue(forKey: line.lineID) else { return }
        var released = 0
        for waiter in queue {
            guard waiter.sequence <= sequence else { break }
            released += 1
            if let group = waiter.group {
                group.remaining -= 1
                guard group.remaining == 0, !group.failed else { continue }
            }
            if let stream = waiter.stream {
                waiter.connection.outbox.fill(waiter.slot, with: stream)
            } else {
                waiter.connection.outbox.fill(waiter.slot, with: waiter.bytes, events: waiter.events)
            }
            markDirty(waiter.connection)
        }
        queue.removeFirst(released)
        if !queue.isEmpty { waiters[line.lineID] = queue }
    }

    /// Replaces the waiting replies whose states were undone by the error; a subscription that
    /// began on undone state ends with it (it saw values that are gone).
    fileprivate func fail(_ line: any DurableLine, undone: ClosedRange<StateSequence>, _ error: StorageError) {
        guard let queue = waiters.removeValue(forKey: line.lineID) else { return }
        var kept: [Waiter] = []
        for waiter in queue {
            guard undone.contains(waiter.sequence) else {
                kept.append(waiter)
                continue
            }
            if let subscription = waiter.subscription { end(subscription.id, of: waiter.connection.outbox) }
            if let group = waiter.group {
                guard !group.failed else { continue }
                group.failed = true
            }
            let reply = waiter.failure?(error) ?? Replies.storageFailure(id: waiter.id, error, in: line.subject)
            waiter.connection.outbox.fill(waiter.slot, with: reply)
            markDirty(waiter.connection)
        }
        if !kept.isEmpty { waiters[line.lineID] = kept }
    }
}
