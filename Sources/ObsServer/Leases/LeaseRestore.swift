// ObsServer — leases across a restart of a daemon that persists (the contract: TTL leases and
// their keys survive, each TTL starting again in full when the daemon serves; keys of
// connection-bound leases are deleted with `end: "closed"` in revisions made before the first
// request; ids are never reused). The lease journal (ObsStore LeaseJournal.swift) holds what
// that takes; this file turns what it found into the lease table's state and the deletions
// to make — including those a kill interrupted: a lease's end whose deletion was not yet
// durable is made again, with the reason it had.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Hub {
    /// Restores the leases storage persisted, makes the deletions a restart owes, and
    /// rewrites the journal compact. Call once, after loading and before serving.
    func restoreLeases(now: UInt64, time: Int64) throws(StorageError) {
        guard let journal = leases.journal else { return }
        let found = journal.takeLoaded()
        var owed = OwedDeletions()
        var kept: [UInt64: [String: Set<Key>]] = [:]
        for (repo, attached) in found.attachments {
            guard let repository = existing(repo) else { continue }
            for (key, id) in attached {
                if let lease = found.live[id] {
                    attach(key, in: repository, to: id)
                    if lease.ttl != nil {
                        kept[id, default: [:]][repo, default: []].insert(key)
                    } else {
                        owed.add(key, of: repo, lease: id, owner: lease.owner, reason: .closed)
                    }
                } else if let ended = found.ended[id] {
                    // Ended, and killed before its deletion here was recorded — or after it was
                    // recorded and undone (a deletion record detaches its keys; the undo
                    // attached them again).
                    attach(key, in: repository, to: id)
                    owed.add(key, of: repo, lease: id, owner: ended.owner ?? Writer(uid: 0, gid: 0, pid: 0), reason: ended.reason)
                }
            }
        }
        for d in found.deletions {
            // Recorded, but the repository is no further than before it: not durable then.
            guard let repository = existing(d.repo), repository.withState({ $0.core.revision }) <= d.before else { continue }
            for key in d.keys {
                attach(key, in: repository, to: d.lease)
                owed.add(key, of: d.repo, lease: d.lease, owner: d.owner, reason: d.reason)
            }
        }
        leases.restore(Array(found.live.values), keys: kept, nextID: found.nextID, now: now)
        for ended in owed.leases { end(ended, time: time) }
        try leases.compactJournal(keeping: [])
        leaseClock.deadlineMoved()
    }

    private func attach(_ key: Key, in repository: Repository, to lease: UInt64) {
        repository.withState { _ = $0.core.setAttachment(key, to: lease) }
    }
}

/// The deletions a restart owes, gathered by lease and reason.
private struct OwedDeletions {
    private var byLease: [UInt64: EndedLease] = [:]

    mutating func add(_ key: Key, of repo: String, lease: UInt64, owner: Writer, reason: SharedLeaseReason) {
        var keys = byLease[lease]?.keys ?? [:]
        keys[repo, default: []].insert(key)
        let end: LeaseEnd.Reason = switch reason {
        case .expired: .expired
        case .revoked: .revoked
        case .closed: .closed
        }
        byLease[lease] = EndedLease(id: lease, owner: byLease[lease]?.owner ?? owner, end: byLease[lease]?.end ?? end, keys: keys)
    }

    /// In id order.
    var leases: [EndedLease] { byLease.keys.sorted().map { byLease[$0]! } }
}
