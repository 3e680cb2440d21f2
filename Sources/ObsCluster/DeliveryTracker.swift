// ObsCluster — how far the watch has delivered each repository, and the tasks waiting for
// it to get further.
//
// For each repository: the obsd revision delivered last, and the *position* — the etcd
// mod_revision of its revision counter (moved by every commit, and by the fences that
// settle unknown outcomes). A daemon's state of a repository is current exactly when its
// position equals the counter's mod_revision in etcd, which is what a commit compares and a
// linearizable read checks. The watch updates an entry only after the sink installed the
// revisions, so a waiter woken here finds them in the daemon's state. One more entry tracks
// how far the watch has gone in all (`leases`).

import Synchronization

final class DeliveryTracker: Sendable {
    /// The entry of no repository (a repository's name is never empty) whose position is the
    /// etcd revision the watch applied last: what a grant waits for before it is answered.
    static let leases = ""

    /// Where one repository is.
    struct Entry: Sendable, Equatable {
        var revision: UInt64 = 0
        var position: Int64 = 0
    }

    private struct Waiter {
        let id: UInt64
        let repo: String
        let position: Int64
        let minimumRevision: UInt64
        let continuation: CheckedContinuation<Bool, Never>
        /// Ends the wait at its timeout; cancelled when the wait ends sooner.
        var timer: Task<Void, Never>? = nil
    }

    private struct State {
        var entries: [String: Entry] = [:]
        var waiters: [Waiter] = []
        var nextWaiter: UInt64 = 0
        /// This daemon's commits under way, by write id, and the ones the watch has shown.
        var pending: Set<String> = []
        var seen: Set<String> = []
    }

    private let state = Mutex(State())

    /// Starts from what was loaded.
    func seed(_ entries: [String: Entry]) {
        state.withLock { $0.entries = entries }
    }

    func entry(_ repo: String) -> Entry {
        state.withLock { $0.entries[repo] ?? Entry() }
    }

    /// Every repository's entry.
    var all: [String: Entry] { state.withLock { $0.entries } }

    /// The watch delivered `repo` up to `entry` (and the write ids in `writeIDs`).
    func advance(_ repo: String, to entry: Entry, writeIDs: [String] = []) {
        let woken: [Waiter] = state.withLock { s in
            let old = s.entries[repo] ?? Entry()
            s.entries[repo] = Entry(revision: max(old.revision, entry.revision), position: max(old.position, entry.position))
            for id in writeIDs where s.pending.contains(id) { s.seen.insert(id) }
            let now = s.entries[repo]!
            var woken: [Waiter] = []
            s.waiters.removeAll { w in
                guard w.repo == repo, now.position >= w.position, now.revision >= w.minimumRevision else { return false }
                woken.append(w)
                return true
            }
            return woken
        }
        for waiter in woken {
            waiter.timer?.cancel()
            waiter.continuation.resume(returning: true)
        }
    }

    /// Waits until `repo` is delivered to at least `position` and `revision`; false after `timeout`.
    func wait(_ repo: String, position: Int64 = 0, revision: UInt64 = 0, timeout: Duration) async -> Bool {
        let id: UInt64? = state.withLock { s in
            let e = s.entries[repo] ?? Entry()
            if e.position >= position && e.revision >= revision { return nil }
            s.nextWaiter += 1
            return s.nextWaiter
        }
        guard let id else { return true }
        return await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
            let registered = state.withLock { s -> Bool in
                let e = s.entries[repo] ?? Entry()
                if e.position >= position && e.revision >= revision { return false }
                s.waiters.append(Waiter(id: id, repo: repo, position: position, minimumRevision: revision, continuation: continuation))
                return true
            }
            guard registered else { return continuation.resume(returning: true) }
            let timer = Task {
                guard (try? await Task.sleep(for: timeout)) != nil else { return }  // woken sooner
                self.expire(id)
            }
            // Kept with the waiter so a wake cancels it; already woken: not needed.
            let waiting = state.withLock { s -> Bool in
                guard let i = s.waiters.firstIndex(where: { $0.id == id }) else { return false }
                s.waiters[i].timer = timer
                return true
            }
            if !waiting { timer.cancel() }
        }
    }

    private func expire(_ id: UInt64) {
        let expired = state.withLock { s -> CheckedContinuation<Bool, Never>? in
            guard let i = s.waiters.firstIndex(where: { $0.id == id }) else { return nil }
            return s.waiters.remove(at: i).continuation
        }
        expired?.resume(returning: false)
    }

    // MARK: Write ids

    /// A commit of this daemon with `writeID` is under way: note if the watch shows it.
    func expect(_ writeID: String) { _ = state.withLock { $0.pending.insert(writeID) } }

    /// Whether the watch has shown `writeID` since `expect`.
    func hasSeen(_ writeID: String) -> Bool { state.withLock { $0.seen.contains(writeID) } }

    /// The commit with `writeID` is over.
    func forget(_ writeID: String) {
        state.withLock { s in
            s.pending.remove(writeID)
            s.seen.remove(writeID)
        }
    }
}
