// ObsServer — what happens when a lease ends (revoked, expired, or its connection closed):
// in each repository where it still holds keys, they are deleted in one revision through the
// hub's sequencer — the same write path as any write (durability gating, history, `since`,
// coalescing, `writers`, `echo`) — and the clock that expires leases with a TTL. A deletion
// storage fails (and its repository undoes) is made again a second later, the keys attached
// to the ended lease meanwhile (and in the lease journal, so a restart makes it too).

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

/// A lease's deletions, repository by repository.
struct LeaseDeletion: Sendable {
    let repository: Repository
    let outcome: WriteOutcome
}

extension Hub {
    /// Deletes what `ended` held; `done` gets the deletions (repositories where nothing was
    /// attached any more make none), from any thread, once all are decided.
    func end(_ ended: EndedLease, time: Int64, done: @escaping @Sendable ([LeaseDeletion]) -> Void = { _ in }) {
        let targets = ended.keys.sorted { $0.key.utf8.lexicographicallyPrecedes($1.key.utf8) }.compactMap { repo, keys in
            existing(repo).map { ($0, keys) }
        }
        guard !targets.isEmpty else { return done([]) }
        let collected = Mutex<(left: Int, deletions: [LeaseDeletion])>((targets.count, []))
        for (repository, keys) in targets {
            sequencer.end(ended, keys: keys, in: repository, time: time) { outcome in
                let finished = collected.withLock { c -> [LeaseDeletion]? in
                    if let outcome { c.deletions.append(LeaseDeletion(repository: repository, outcome: outcome)) }
                    c.left -= 1
                    return c.left == 0 ? c.deletions : nil
                }
                if let finished { done(finished) }
            }
        }
    }

    /// A connection closed: its connection-bound leases end (`closed`).
    func connectionClosed(_ connection: ConnectionID, time: Int64) {
        if sharedLeases != nil { return sharedConnectionClosed(connection) }
        for ended in leases.connectionClosed(connection) { end(ended, time: time) }
    }
}

/// Expires leases with a TTL: a timer on one loop, set for the earliest deadline — an idle
/// lease costs nothing until it is due. A lease ends at its deadline, never earlier; the loop
/// runs the timer as soon as it is due (well within the contract's second).
final class LeaseClock: @unchecked Sendable {
    // @unchecked Sendable: `timer` and `scheduledFor` are touched only on `loop` (`due` and
    // `check` run there: `deadlineMoved` hops to it); `hub` is set once, before it serves.
    // unowned(unsafe): the hub owns this clock and outlives the loops that run it.
    private unowned(unsafe) var hub: Hub!
    private let loop: IOLoop
    private var timer: TimerID?
    private var scheduledFor: UInt64 = .max

    init(loop: IOLoop) {
        self.loop = loop
    }

    func attach(to hub: Hub) { self.hub = hub }

    /// A lease with a TTL was granted or kept alive (from any loop): the timer may need to
    /// fire sooner.
    func deadlineMoved() {
        loop.execute { [self] in check() }
    }

    /// Test-only: how early a self-test's failpoint (`lease.expire=early(ms)`, Failpoints.swift)
    /// makes every TTL end; 0 in every other run.
    static let earliness: UInt64 = Failpoints.shared?.earliness("lease.expire") ?? 0

    private func check() {
        guard let deadline = hub.leases.nextDeadline else { return }
        let next = deadline > Self.earliness ? deadline - Self.earliness : 0
        guard next < scheduledFor else { return }
        if let timer { loop.cancel(timer) }
        scheduledFor = next
        let delay = next > loop.now ? next - loop.now : 0
        timer = loop.schedule(in: delay) { [self] in due() }
    }

    /// How long after a failed deletion it is made again.
    static let retryDelay: UInt64 = 1_000_000_000

    /// A lease's end whose deletion storage failed (and its repository undid): makes it again
    /// in a second — its keys are attached to the lease again meanwhile — as often as storage
    /// fails it. (From any thread.)
    func retry(_ ended: EndedLease) {
        loop.execute { [self] in
            _ = loop.schedule(in: Self.retryDelay) { [self] in hub.end(ended, time: loop.wallSeconds) }
        }
    }

    private func due() {
        timer = nil
        scheduledFor = .max
        for ended in hub.leases.expire(now: loop.now &+ Self.earliness) { hub.end(ended, time: loop.wallSeconds) }
        check()
    }
}
