// ObsServer — leases across a restart of a daemon that persists (the contract: TTL leases and
// their keys survive, each TTL starting again in full when the daemon serves; keys of
// connection-bound leases are deleted with `end: "closed"` in revisions made before the first
// request; ids are never reused). Nothing is trusted but what storage recovered: the leases
// (LEAS and the log's grants and ends) and each repository's attachments, moved by the same
// log records as the writes that moved them — so an attachment is there exactly when its
// write is. From them the table is rebuilt, and every key attached to a lease that is not a
// live TTL lease is deleted: a connection-bound one's (`closed`), one that ended before the
// stop — its deletion a kill interrupted, or storage failed — with the reason it ended for.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Hub {
    /// Restores the leases storage kept and makes the deletions a restart owes. Call once,
    /// after loading and before serving; `startLeaseClocks` once serving.
    func restoreLeases(time: Int64) {
        guard shared == nil else { return }
        var repos: [UInt64: Set<String>] = [:]
        for repository in allRepositories() {
            for lease in repository.attachedLeases { repos[lease, default: []].insert(repository.name) }
        }
        for ended in leases.restore(storage.loadLeases(), repos: repos) { end(ended, time: time) }
    }

    /// Starts the TTL of every restored lease, in full: the daemon serves from now.
    func startLeaseClocks(now: UInt64) {
        leases.startClocks(now: now)
        leaseClock.deadlineMoved()
    }
}
