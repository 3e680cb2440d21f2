// ObsServer — how a loop's shard routes the revisions it took to its connections' outboxes:
// a run of revisions of one key at a time, or one revision at a time.
//
// A run — consecutive single-key revisions of the same key — is routed once, and each
// subscriber gets all of the run's events together: written into memory the loop lends
// (the same memory for one connection after another, so it stays in cache) and sent at
// once, while they are still in cache. Only what the socket does not take stays in the
// connection's own outbox; a subscriber whose outbox already holds something gets the
// events appended there, behind it. Before a run, the connections with output so far —
// writers' replies — are written, so writers send again while the run goes out.
//
// One revision at a time, each subscriber's outbox gets its event, and every connection is
// written once at the end of the tick. At a large fan-out that fills each outbox with a
// whole tick's events before the socket takes any — 64 revisions to 1,000 subscribers are
// 8.6 MB, read back by the kernel after the last is written, when most of it has left the
// cache. Runs took fan-out to 1,000 from 0.079 to 0.042 µs of daemon CPU per event (0.10
// to 0.05 in the machine's slow stretches), fan-out to 10 from 0.108 to 0.091, and to one
// subscriber from 0.685 to 0.649 — a run is routed once (docs/PERFORMANCE.md).
//
// Each subscription still sees its revisions in order. A connection with two subscriptions
// that select the key gets one's events of the run, then the other's: the protocol orders
// events per subscription, not across them.

import ObsCore
import ObservableKit

extension LoopShard {
    /// The length of the run that starts at `taken`'s entry `n` (a revision of `entry`'s
    /// repository): the entries from it that change the same single key of that repository,
    /// no more than `limit` events' worth — at least 1.
    func runLength(from n: Int, of entry: RepositoryRoutes, limit: Int) -> Int {
        let first = taken.entry(n)
        let most = min(taken.count - n, max(1, limit / max(1, entry.routes.count)))
        guard most > 1, first.place.changeCount == 1, taken.entry(n + 1).tag == first.tag else { return 1 }
        var length = 1
        taken.withBytes { bytes in
            let key = RevisionView(info: first.info, place: first.place, bytes: bytes).keyBytes(0)
            while length < most {
                let next = taken.entry(n + length)
                guard next.tag == first.tag, next.place.changeCount == 1,
                    RevisionView(info: next.info, place: next.place, bytes: bytes).keyBytes(0).elementsEqual(key)
                else { break }
                length += 1
            }
        }
        return length
    }

    /// Routes one revision to this loop's subscribers of its repository (`entry`); the events
    /// queued.
    func deliver(_ revision: RevisionView, to entry: RepositoryRoutes) -> Int {
        entry.revision = revision.revision
        // What `visit` counts and collects goes into the shard's fields: a local function
        // capturing local variables had them boxed on the heap — two allocations per
        // revision — once it was passed on through the routes' thunks.
        routedCount = 0
        defer { if !routedEnded.isEmpty { routedEnded.removeAll(keepingCapacity: true) } }
        func visit(_: ObserverID, _ routed: borrowing Unmanaged<Subscription>, _ selected: SelectedChanges) {
            routed._withUnsafeGuaranteedRef { subscription in
                guard revision.revision > subscription.after else { return }
                subscription.withConnection { connection, outbox in
                    guard take(outbox.deliver(revision, selected: selected, to: subscription), connection) else { return }
                    if !connection.isDirty { self.markDirty(connection) }
                }
            }
        }
        entry.isRouting = true
        if revision.changeCount == 1 {
            entry.routes.route(CollectionOfOne(revision.key(0)), visit)
        } else {
            entry.routes.route((0..<revision.changeCount).map { revision.key($0) }, visit)
        }
        entry.isRouting = false
        for subscription in routedEnded { unroute(subscription) }
        return routedCount
    }

    /// Routes the run of `taken`'s entries `run` (one key's, from `runLength`) to this loop's
    /// subscribers of `entry`'s repository, each subscriber's events together; the events queued.
    func deliverRun(_ run: Range<Int>, to entry: RepositoryRoutes) -> Int {
        routedCount = 0
        defer { if !routedEnded.isEmpty { routedEnded.removeAll(keepingCapacity: true) } }
        let taken = self.taken  // read in place: nothing changes it while the run is routed
        taken.withBytes { bytes in
            func view(_ i: Int) -> RevisionView {
                let e = taken.entry(i)
                return RevisionView(info: e.info, place: e.place, bytes: bytes)
            }
            entry.revision = view(run.upperBound - 1).revision
            func visit(_: ObserverID, _ routed: borrowing Unmanaged<Subscription>, _ selected: SelectedChanges) {
                routed._withUnsafeGuaranteedRef { subscription in
                    subscription.withConnection { connection, outbox in
                        let lent = outbox.borrow(&runMemory)
                        var queued = false
                        for i in run {
                            let revision = view(i)
                            guard revision.revision > subscription.after else { continue }
                            queued = take(outbox.deliver(revision, selected: .all, to: subscription), connection) || queued
                        }
                        if lent { runBytesSent += outbox.sendLent(to: connection.fd, returning: &runMemory) }
                        // The tick's last write of it does what follows a write (a partial
                        // one waits for the socket; a drained one may resume its input).
                        if queued, !connection.isDirty { self.markDirty(connection) }
                    }
                }
            }
            entry.isRouting = true
            entry.routes.route(CollectionOfOne(view(run.lowerBound).key(0)), visit)
            entry.isRouting = false
        }
        for subscription in routedEnded { unroute(subscription) }
        return routedCount
    }

    /// Counts what `outbox.deliver` did; whether it queued anything.
    private func take(_ delivery: Outbox.Delivery, _ connection: Connection) -> Bool {
        switch delivery {
        case .delivered:
            routedCount += 1
        case .skipped:
            return false
        case .ended(let subscription):  // the outbox's reference: it may be the last
            routedCount += 1
            routedEnded.append(subscription)
        case .overflowed(let victims):
            routedEnded.append(contentsOf: victims)
            connection.overflowed()
        }
        return true
    }
}
