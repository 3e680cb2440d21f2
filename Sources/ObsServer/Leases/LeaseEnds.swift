// ObsServer — what happens when a lease ends (revoked, expired, or its connection closed):
// in each repository where it may hold keys, those still attached to it are deleted in one
// revision through the hub's sequencer — the same write path as any write (durability
// gating, history, `since`, coalescing, `writers`, `echo`), whichever lease service ended
// it — and the clock that expires the lease table's leases with a TTL (`LocalLeases`).
//
// Storage may fail a deletion (a full disk): the repository undoes it, which attaches its
// keys to the ended lease again; it — like any undo that leaves a key attached to a lease
// that has ended meanwhile — is made again a second later, as often as storage fails it. The
// end's own frame, if storage failed it, is written again the same way.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

/// A lease's deletions, repository by repository.
struct LeaseDeletion: Sendable {
    let repository: Repository
    let outcome: WriteOutcome

    /// A revoke's reply: the revision that deleted the lease's keys, per repository.
    static func revisions(of deletions: [LeaseDeletion]) -> [String: UInt64] {
        Dictionary(deletions.map { ($0.repository.name, $0.outcome.revision) }, uniquingKeysWith: max)
    }
}

extension Hub {
    /// Deletes what `ended` holds; `done` gets the deletions (repositories where nothing was
    /// attached any more make none), from any thread, once all are decided.
    func end(_ ended: EndedLease, time: Int64, done: @escaping @Sendable ([LeaseDeletion]) -> Void = { _ in }) {
        let targets = ended.repos.sorted { $0.utf8.lexicographicallyPrecedes($1.utf8) }.compactMap(repositories.existing)
        guard !targets.isEmpty else { return done([]) }
        let collected = Locked<(left: Int, deletions: [LeaseDeletion])>((targets.count, []))
        for repository in targets {
            sequencer.end(ended, in: repository, time: time) { outcome in
                let finished = collected.withLock { c -> [LeaseDeletion]? in
                    if let outcome { c.deletions.append(LeaseDeletion(repository: repository, outcome: outcome)) }
                    c.left -= 1
                    return c.left == 0 ? c.deletions : nil
                }
                if let finished { done(finished) }
            }
        }
    }
}

/// Expires the lease table's leases with a TTL (`LocalLeases`): a timer on one loop, set for the earliest deadline — an idle
/// lease costs nothing until it is due. A lease ends at its deadline, never earlier; the loop
/// runs the timer as soon as it is due (well within the contract's second).
final class LeaseClock: @unchecked Sendable {
    // @unchecked Sendable: `timer` and `scheduledFor` are touched only on `loop` (`due` and
    // `check` run there: `deadlineMoved` hops to it); `hub` is set once, before it serves.
    // unowned(unsafe): the hub owns this clock and outlives the loops that run it.
    private unowned(unsafe) var hub: Hub!
    private let loop: IOLoop
    private let table: LeaseTable
    private var timer: TimerID?
    private var scheduledFor: UInt64 = .max

    init(loop: IOLoop, table: LeaseTable) {
        self.loop = loop
        self.table = table
    }

    func attach(to hub: Hub) { self.hub = hub }

    /// A lease with a TTL was granted or kept alive, or the clocks started (from any loop):
    /// the timer may need to fire sooner.
    func deadlineMoved() {
        loop.execute { [self] in check() }
    }

    /// Test-only: how early a self-test's failpoint (`lease.expire=early(ms)`, Failpoints.swift)
    /// makes every TTL end; 0 in every other run.
    static let earliness: UInt64 = Failpoints.shared?.earliness("lease.expire") ?? 0

    private func check() {
        guard let deadline = table.nextDeadline else { return }
        let next = deadline > Self.earliness ? deadline - Self.earliness : 0
        guard next < scheduledFor else { return }
        if let timer { loop.cancel(timer) }
        scheduledFor = next
        let delay = next > loop.now ? next - loop.now : 0
        timer = loop.schedule(in: delay) { [self] in due() }
    }

    /// How long after a failed deletion, or end, it is made again.
    static let retryDelay: UInt64 = 1_000_000_000

    /// Deletes what `ended` holds in a second — storage failed its deletion, and the keys are
    /// attached to it again meanwhile — as often as storage fails it. (From any thread.)
    func retry(_ ended: EndedLease) {
        loop.execute { [self] in
            _ = loop.schedule(in: Self.retryDelay) { [self] in hub.end(ended, time: loop.wallSeconds) }
        }
    }

    /// Writes the frames of these ends again in a second. (From any thread.)
    func rewrite(_ ends: [(UInt64, LeaseEnd.Reason, Writer)]) {
        loop.execute { [self] in
            _ = loop.schedule(in: Self.retryDelay) { [self] in table.rewriteEnds(ends) }
        }
    }

    private func due() {
        timer = nil
        scheduledFor = .max
        for ended in table.expire(now: loop.now &+ Self.earliness) { hub.end(ended, time: loop.wallSeconds) }
        check()
    }
}
