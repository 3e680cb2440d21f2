// ObsServer — what a shared store (etcd) decided, installed here: every daemon's revisions in
// the store's order, each repository's lease attachments, a history that no longer matches,
// and the ends of the leases the store keeps. The store's watch thread calls this (it is the
// store's `SharedStorageSink`); it installs into the repositories (which publish to their
// subscribers' loops), tells the shared sequencer which of its own writes came back, and
// passes what concerns leases to the lease service. It never calls into the store.

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

final class SharedDelivery: SharedStorageSink {
    /// The hub, once assembled (weak: the hub owns this object). Read once per delivery.
    private let link = Locked<WeakHub>(WeakHub())
    private let sequencer: SharedSequencer
    private let leases: any LeaseService

    init(sequencer: SharedSequencer, leases: any LeaseService) {
        self.sequencer = sequencer
        self.leases = leases
    }

    /// Once, when the hub is assembled.
    func attach(to hub: Hub) { link.withLock { $0.hub = hub } }

    private var hub: Hub? { link.withLock { $0.hub } }

    func deliver(repo name: String, revisions: [SharedRevision], attachments: [SharedAttachment], replacing: Bool) {
        guard let hub else { return }  // stopping
        // Attachments alone need a repository this daemon holds (they are of keys that exist).
        let repository: Repository
        if revisions.isEmpty {
            guard let existing = hub.repositories.existing(name) else { return }
            repository = existing
        } else {
            repository = hub.repositories.permanent(name)
        }
        let installs = revisions.map { revision -> (record: RevisionRecord, origin: UInt64, tail: [UInt8]) in
            let origin = sequencer.origin(of: revision.writeID, revision: revision.record.revision, in: repository)
            guard let end = revision.lease else { return (revision.record, origin, []) }
            sequencer.noteEnd(of: end.lease, in: repository, revision: revision.record.revision)
            return (revision.record, origin, RepositoryCore.tail(end))
        }
        let moves = repository.install(installs, attachments: attachments, replacing: replacing)
        leases.moved(moves, in: name)
    }

    func historyLost(_ reason: String) { hub?.historyLost(reason) }

    func leaseEnded(_ lease: SharedLease, reason: LeaseEnd.Reason) {
        guard let hub else { return }
        leases.ended(lease, reason: reason, in: hub)
    }

    func leasesLost(_ ids: [UInt64]) { leases.lost(ids) }
}

/// A weak reference to the hub, for `Locked`.
struct WeakHub: Sendable {
    weak var hub: Hub?
}
