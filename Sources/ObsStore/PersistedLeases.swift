// ObsStore — the leases as storage keeps them: every lease not ended, with its owner and TTL,
// the leases that ended while keys may still be attached to them (a restart deletes those
// keys with the reason the lease ended for), and the next id. Built at start-up from the
// snapshot's LEAS block and the log's grant and end frames after it; written into every
// snapshot. Which keys are attached to which lease is kept with each repository
// (`LoadedRepository.attachments`), moved by the same log records as the writes.

import ObsValues
import ObservableKit

/// The leases a data directory holds.
public struct PersistedLeases: Sendable, Equatable {
    /// A lease that had not ended.
    public struct Lease: Sendable, Equatable {
        public let id: UInt64
        public let owner: Writer
        /// Seconds; nil: bound to a connection (which a restart has ended).
        public let ttl: Int64?

        public init(id: UInt64, owner: Writer, ttl: Int64?) {
            self.id = id
            self.owner = owner
            self.ttl = ttl
        }
    }

    /// A lease that ended: why, and who held it (its keys' deletion is written by it).
    public struct Ended: Sendable, Equatable {
        public let reason: LeaseEnd.Reason
        public let owner: Writer

        public init(reason: LeaseEnd.Reason, owner: Writer) {
            self.reason = reason
            self.owner = owner
        }
    }

    /// The id the next grant hands out (ids are never reused while the data persists).
    public var nextID: UInt64 = 1
    /// Leases not ended, by id.
    public var live: [UInt64: Lease] = [:]
    /// Leases that ended, by id.
    public var ended: [UInt64: Ended] = [:]

    public init(nextID: UInt64 = 1, live: [UInt64: Lease] = [:], ended: [UInt64: Ended] = [:]) {
        self.nextID = nextID
        self.live = live
        self.ended = ended
    }

    /// Lease `lease` was granted.
    public mutating func granted(_ lease: Lease) {
        live[lease.id] = lease
        ended[lease.id] = nil
        nextID = max(nextID, lease.id + 1)
    }

    /// Lease `id` ended.
    public mutating func ended(_ id: UInt64, _ reason: LeaseEnd.Reason, owner: Writer) {
        live[id] = nil
        ended[id] = Ended(reason: reason, owner: owner)
        nextID = max(nextID, id + 1)
    }

    /// Forgets the ended leases no key is attached to any more (`referenced`: the leases
    /// some key is attached to).
    public mutating func forgetEnded(except referenced: Set<UInt64>) {
        ended = ended.filter { referenced.contains($0.key) }
    }
}
