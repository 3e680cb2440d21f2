// ObsCluster — start-up: the epoch (created by the first daemon that finds none under the
// prefix, deleting any tombstones an older epoch left), then every repository — counters,
// values, lease attachments, the change log and the tombstones — and every lease, read at
// one etcd revision, from which the watch continues.

import ObsEtcd
import ObsProtocol
import ObsStore
import ObservableKit

/// What a daemon starts from.
struct ClusterSnapshot: Sendable {
    let epoch: String
    /// Whether this daemon created the epoch (the prefix was empty).
    let createdEpoch: Bool
    /// The etcd revision everything was read at; the watch starts after it.
    let revision: Int64
    let repositories: [LoadedRepository]
    /// Every counter's revision and position (a counter can exist at revision 0 after a fence).
    let positions: [String: DeliveryTracker.Entry]
    /// Every key attached to a lease, by repository.
    let attachments: [String: [SharedAttachment]]
    /// Every repository's tombstone floor key, as read (absent: none, or unreadable).
    let tombFloors: [String: TombFloor]
    let leases: LeaseSnapshot
}

/// Every lease under the prefix at one revision.
struct LeaseSnapshot: Sendable {
    var records: [LeaseRecord] = []
    var alive: [UInt64: LeaseMirror.Alive] = [:]
    /// The last id handed out, and the counter's mod revision.
    var counter: (id: UInt64, position: Int64) = (0, 0)
}

enum ClusterLoader {
    /// Reads (or creates) the epoch and reads every repository at one revision.
    /// - Parameter historyLimit: revisions of history to load per repository.
    static func load(client: EtcdClient, layout: KeyLayout, historyLimit: Int, timeout: Duration) async throws -> ClusterSnapshot {
        let (epoch, created) = try await epoch(client: client, layout: layout, timeout: timeout)
        let counters = try await client.range(layout.counterPrefix, rangeEnd: EtcdKey.prefixEnd(layout.counterPrefix), timeout: timeout)
        let at = counters.revision
        let check = try await client.range(layout.epochKey, revision: at, timeout: timeout)
        guard check.kvs.first.map({ String(decoding: $0.value, as: UTF8.self) }) == epoch else {
            throw EtcdError.invalidResponse("the epoch under the prefix changed while it was read; reading again")
        }
        let data = try await client.range(layout.dataPrefix, rangeEnd: EtcdKey.prefixEnd(layout.dataPrefix), revision: at, timeout: timeout)
        let log = try await client.range(layout.logPrefix, rangeEnd: EtcdKey.prefixEnd(layout.logPrefix), revision: at, timeout: timeout)
        let tombs = try await client.range(layout.tombPrefix, rangeEnd: EtcdKey.prefixEnd(layout.tombPrefix), revision: at, timeout: timeout)
        let tombFloors = try await Self.tombFloors(client: client, layout: layout, at: at, timeout: timeout)
        let leases = try await Self.leases(client: client, layout: layout, at: at, timeout: timeout)

        var positions: [String: DeliveryTracker.Entry] = [:]
        for kv in counters.kvs {
            guard case .counter(let repo) = layout.classify(kv.key), let revision = Codec.counter(from: kv.value) else {
                throw Malformed(description: "\(String(decoding: kv.key, as: UTF8.self)) is not an obsd revision counter")
            }
            positions[repo] = DeliveryTracker.Entry(revision: revision, position: kv.modRevision)
        }
        var entries: [String: [Key: Entry<CanonicalJSON>]] = [:]
        let attachments = Self.attachments(in: data, layout: layout)
        for kv in data.kvs {
            guard case .data(let repo) = layout.classify(kv.key), let key = layout.key(ofDataKey: kv.key, repo: repo) else { continue }
            do {
                entries[repo, default: [:]][key] = try Codec.data(from: kv.value)
            } catch {
                throw Malformed(description: "\(String(decoding: kv.key, as: UTF8.self)): \(error)")
            }
        }
        var logs: [String: [RevisionRecord]] = [:]
        for kv in log.kvs {
            guard case .log(let repo) = layout.classify(kv.key) else { continue }
            do {
                logs[repo, default: []].append(try Codec.log(from: kv.value, repo: repo).record)
            } catch {
                throw Malformed(description: "\(String(decoding: kv.key, as: UTF8.self)): \(error)")
            }
        }

        // The last deletion of each key the tomb keys name (a key re-created by a daemon that
        // keeps no tombstones may be named again, or exist: the newest counts, if it is absent).
        var deletions: [String: [Key: UInt64]] = [:]
        for kv in tombs.kvs {
            guard case .tomb(let repo) = layout.classify(kv.key), let (revision, key) = layout.tombstone(ofTombKey: kv.key, repo: repo) else { continue }
            if revision > deletions[repo]?[key] ?? 0 { deletions[repo, default: [:]][key] = revision }
        }

        var repositories: [LoadedRepository] = []
        for (repo, position) in positions.sorted(by: { $0.key < $1.key }) where position.revision > 0 {
            let values = entries[repo] ?? [:]
            if let newer = values.first(where: { $0.value.revision > position.revision }) {
                throw Malformed(description: "repository \(repo): key \(newer.key.string.debugDescription) is at revision \(newer.value.revision), beyond the counter's \(position.revision)")
            }
            let state = FlatTable(revision: position.revision, entries: values)
            let history = contiguousTail(logs[repo] ?? [], endingAt: position.revision, limit: historyLimit)
            // Deletions etcd does not hold (before tombstones were kept, or committed by a
            // daemon that kept none) are unknown: the floor is then the revision.
            let floor = TombFloor.floor(of: tombFloors[repo], at: position.revision)
            let remembered = (deletions[repo] ?? [:]).lazy.filter { $0.value > floor && $0.value <= position.revision && values[$0.key] == nil }
            let tombstones = Tombstones(remembered.map { (key: $0.key, revision: $0.value) }, limit: .max, floor: floor)
            repositories.append(LoadedRepository(name: repo, epoch: epoch, state: state, history: history, tombstones: tombstones))
        }
        return ClusterSnapshot(
            epoch: epoch, createdEpoch: created, revision: at, repositories: repositories, positions: positions, attachments: attachments,
            tombFloors: tombFloors, leases: leases)
    }

    /// Every repository's tombstone floor key at revision `at` (one that cannot be read is left
    /// out: its deletions are then unknown, and the next commit puts it again).
    static func tombFloors(client: EtcdClient, layout: KeyLayout, at: Int64, timeout: Duration) async throws -> [String: TombFloor] {
        let found = try await client.range(layout.tombFloorPrefix, rangeEnd: EtcdKey.prefixEnd(layout.tombFloorPrefix), revision: at, timeout: timeout)
        var floors: [String: TombFloor] = [:]
        for kv in found.kvs {
            guard case .tombFloor(let repo) = layout.classify(kv.key), let floor = Codec.tombFloor(from: kv.value) else { continue }
            floors[repo] = floor
        }
        return floors
    }

    /// Every lease under the prefix at revision `at`.
    static func leases(client: EtcdClient, layout: KeyLayout, at: Int64, timeout: Duration) async throws -> LeaseSnapshot {
        let records = try await client.range(layout.leasePrefix, rangeEnd: EtcdKey.prefixEnd(layout.leasePrefix), revision: at, timeout: timeout)
        let alive = try await client.range(layout.alivePrefix, rangeEnd: EtcdKey.prefixEnd(layout.alivePrefix), revision: at, timeout: timeout)
        let counter = try await client.range(layout.leaseCounterKey, revision: at, timeout: timeout)
        var snapshot = LeaseSnapshot()
        for kv in records.kvs {
            do {
                snapshot.records.append(try Codec.lease(from: kv.value))
            } catch {
                throw Malformed(description: "\(String(decoding: kv.key, as: UTF8.self)): \(error)")
            }
        }
        for kv in alive.kvs {
            guard case .alive(let id) = layout.classify(kv.key) else { continue }
            snapshot.alive[id] = LeaseMirror.Alive(etcdLease: kv.lease, created: kv.createRevision)
        }
        if let kv = counter.kvs.first { snapshot.counter = (Codec.counter(from: kv.value) ?? 0, kv.modRevision) }
        return snapshot
    }

    /// The keys attached to a lease among the values `data` read, by repository.
    static func attachments(in data: EtcdRangeResult, layout: KeyLayout) -> [String: [SharedAttachment]] {
        var attachments: [String: [SharedAttachment]] = [:]
        for kv in data.kvs {
            guard let lease = Codec.lease(ofData: kv.value), case .data(let repo) = layout.classify(kv.key),
                let key = layout.key(ofDataKey: kv.key, repo: repo)
            else { continue }
            attachments[repo, default: []].append(SharedAttachment(key: key, lease: lease))
        }
        return attachments
    }

    /// The epoch under the prefix, created (128 random bits) if there is none — and with it,
    /// any tombstones left under the prefix go: deletions of another history.
    static func epoch(client: EtcdClient, layout: KeyLayout, timeout: Duration) async throws -> (String, created: Bool) {
        let fresh = Epoch.random()
        let result = try await client.txn(
            compare: [.version(layout.epochKey, .equal, 0)],
            success: [
                .put(key: layout.epochKey, value: Array(fresh.utf8)),
                .deleteRange(key: layout.tombPrefix, rangeEnd: EtcdKey.prefixEnd(layout.tombPrefix)),
                .deleteRange(key: layout.tombFloorPrefix, rangeEnd: EtcdKey.prefixEnd(layout.tombFloorPrefix)),
            ],
            failure: [.range(EtcdRangeRequest(key: layout.epochKey))], timeout: timeout)
        if result.succeeded { return (fresh, true) }
        guard case .range(let found)? = result.responses.first, let kv = found.kvs.first else {
            throw EtcdError.invalidResponse("the epoch key neither absent nor present")
        }
        let epoch = String(decoding: kv.value, as: UTF8.self)
        guard Epoch.isValid(epoch) else { throw Malformed(description: "\(String(decoding: layout.epochKey, as: UTF8.self)) is not an epoch") }
        return (epoch, false)
    }

    /// The longest run of consecutive revisions ending at `revision`, at most `limit` long.
    static func contiguousTail(_ records: [RevisionRecord], endingAt revision: UInt64, limit: Int) -> [RevisionRecord] {
        let sorted = records.sorted { $0.revision < $1.revision }
        guard limit > 0, let last = sorted.last, last.revision == revision else { return [] }
        var start = sorted.count - 1
        while start > 0, sorted.count - start < limit, sorted[start - 1].revision + 1 == sorted[start].revision { start -= 1 }
        return Array(sorted[start...])
    }
}
