// ObsCluster — leases in etcd: SharedStorage's lease operations.
//
// A grant is one txn: compare the id counter's mod_revision with the one the lease mirror is
// at, put the counter + 1, the lease's record (`lease/<id>`) and its alive key (`alive/<id>`)
// attached to what keeps it alive — an etcd lease of its own with the TTL for a lease with a
// TTL (so etcd ends it whatever becomes of this daemon), this daemon's liveness lease for one
// bound to a connection. Ids are therefore dense, cluster-wide and never reused while the
// prefix lasts, and the per-uid limit counts every daemon's leases (the mirror at the
// compared position holds every grant before it). A grant is answered once the watch shows
// it, so the daemon's next request finds the lease.
//
// A keep-alive renews the lease's own etcd lease (from any daemon). Ending a lease deletes its
// alive key under a compare of the key's create revision (its generation) — with the record
// marked revoked in the same txn for a `revoke` — so exactly one end wins; every daemon learns
// of it from the watch. Once the keys attached to it are deleted, the record goes
// (`leaseFinished`). A lease this daemon does not know yet (granted elsewhere a moment ago) is
// read from etcd (linearizable).

import ObsEtcd
import ObsStore
import ObsValues

extension ClusterStorage {
    public var keepsLeases: Bool { true }

    public var liveLeaseCount: Int { leases.count() }

    public func liveLease(_ id: UInt64) -> SharedLease? { leases.live(id) }

    /// How long a lease operation may wait for etcd before it is answered with the cause.
    static let leaseOperationTimeout: Duration = .seconds(4)

    public func grantLease(owner: Writer, ttl: Int64?, limit: Int?) async -> Result<SharedLease, SharedGrantFailure> {
        let deadline = ContinuousClock.now + Self.leaseOperationTimeout
        func remaining() -> Duration { min(max(ContinuousClock.now.duration(to: deadline), .milliseconds(1)), configuration.requestTimeout) }
        // A lease with a TTL is kept alive by an etcd lease of its own.
        var own: EtcdLease? = nil
        if let ttl {
            do {
                own = try await client.leaseGrant(ttl: ttl, timeout: remaining())
            } catch {
                return .failure(.store(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot grant leases now (\(error)); nothing was granted")))
            }
        }
        let nonce = String(Epoch.random().prefix(16))
        var lastCause = "no attempt"
        var backoff: Duration = .milliseconds(50)
        while ContinuousClock.now < deadline {
            let keeper: Int64
            if let own {
                keeper = own.id
            } else if let current = await liveness.current(timeout: remaining()) {
                keeper = current
            } else {
                lastCause = "this daemon holds no liveness lease in etcd"
                break
            }
            let (id, position) = leases.next
            if let limit, leases.count(uid: owner.uid) >= limit {
                revokeLater(own)
                return .failure(.tooMany(limit: limit))
            }
            let record = LeaseRecord(id: id, owner: owner, ttl: own?.ttl, daemon: daemonID, grant: nonce)
            do {
                let result = try await client.txn(
                    compare: [.modRevision(layout.leaseCounterKey, .equal, position)],
                    success: [
                        .put(key: layout.leaseCounterKey, value: Codec.counter(id)), .put(key: layout.leaseKey(id), value: Codec.lease(record)),
                        .put(key: layout.aliveKey(id), value: [], lease: keeper),
                    ],
                    failure: [.range(EtcdRangeRequest(key: layout.leaseCounterKey))], timeout: remaining())
                health.succeeded()
                if result.succeeded { return .success(await granted(record, generation: result.revision)) }
                // Another daemon's grant took the id: take the next once the watch shows it.
                guard case .range(let counter)? = result.responses.first else { break }
                _ = await tracker.wait(DeliveryTracker.leases, position: counter.kvs.first?.modRevision ?? 0, timeout: remaining())
            } catch let error as EtcdError {
                if error.isLeaseNotFound, own == nil {
                    liveness.gone(keeper)  // expired meanwhile: a new one is granted
                    continue
                }
                if error.isOutcomeUnknown, let found = await grantedEarlier(id, nonce: nonce, timeout: remaining()) {
                    return .success(await granted(found.record, generation: found.generation))
                }
                guard error.isTransient || error.isOutcomeUnknown else {
                    revokeLater(own)
                    return .failure(.store(SharedFailure(.refused, "etcd refused the grant: \(error); nothing was granted")))
                }
                lastCause = error.description
                health.failed()
                try? await Task.sleep(for: min(backoff, remaining()))
                backoff = min(backoff * 2, .milliseconds(500))
            } catch {
                break
            }
        }
        revokeLater(own)
        return .failure(.store(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot grant leases now (\(lastCause)); nothing was granted")))
    }

    /// A grant made: answered once the watch shows it (so the mirror has it).
    private func granted(_ record: LeaseRecord, generation: Int64) async -> SharedLease {
        _ = await tracker.wait(DeliveryTracker.leases, position: generation, timeout: .seconds(2))
        return leases.live(record.id) ?? SharedLease(id: record.id, owner: record.owner, ttl: record.ttl, generation: generation)
    }

    /// After a grant's unknown outcome: whether lease `id` is the one with `nonce`.
    private func grantedEarlier(_ id: UInt64, nonce: String, timeout: Duration) async -> (record: LeaseRecord, generation: Int64)? {
        guard let (record, alive, _) = try? await read(id, timeout: timeout), record.grant == nonce, let alive else { return nil }
        return (record, alive.created)
    }

    /// Lease `id`'s record and alive key now (linearizable, at one revision).
    private func read(_ id: UInt64, timeout: Duration) async throws -> (LeaseRecord, LeaseMirror.Alive?, revision: Int64)? {
        let result = try await client.txn(
            success: [.range(EtcdRangeRequest(key: layout.leaseKey(id))), .range(EtcdRangeRequest(key: layout.aliveKey(id)))], timeout: timeout)
        guard result.responses.count == 2, case .range(let records) = result.responses[0], case .range(let alive) = result.responses[1],
            let kv = records.kvs.first
        else { return nil }
        let record = try Codec.lease(from: kv.value)
        return (record, alive.kvs.first.map { LeaseMirror.Alive(etcdLease: $0.lease, created: $0.createRevision) }, result.revision)
    }

    private func revokeLater(_ own: EtcdLease?) {
        guard let own else { return }
        let client = self.client
        Task { _ = try? await client.leaseRevoke(own.id, timeout: .seconds(3)) }
    }

    public func lease(_ id: UInt64) async -> Result<SharedLease?, SharedFailure> {
        if let lease = leases.live(id) { return .success(lease) }
        if leases.knows(id) { return .success(nil) }  // ended, or no longer vouched for here
        do {
            guard let (record, alive, revision) = try await read(id, timeout: configuration.requestTimeout), let alive else { return .success(nil) }
            leases.learn(record, alive, at: revision)
            return .success(leases.live(id))
        } catch {
            return .failure(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot say whether lease \(id) is live (\(error))"))
        }
    }

    public func keepAlive(_ lease: SharedLease) async -> Result<Bool, SharedFailure> {
        guard let alive = leases.alive(lease.id), alive.created == lease.generation else { return .success(false) }
        guard lease.ttl != nil else { return .success(true) }
        do {
            return .success(try await client.leaseKeepAlive(alive.etcdLease, timeout: configuration.requestTimeout) != nil)
        } catch {
            return .failure(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot keep lease \(lease.id) alive now (\(error))"))
        }
    }

    public func endLease(_ lease: SharedLease, reason: LeaseEnd.Reason) async -> Result<Bool, SharedFailure> {
        let deadline = ContinuousClock.now + Self.leaseOperationTimeout
        let alive = leases.alive(lease.id)
        var success: [EtcdOp] = [.deleteRange(key: layout.aliveKey(lease.id))]
        if reason == .revoked, var record = leases.record(lease.id) {
            record.revoked = true
            success.append(.put(key: layout.leaseKey(lease.id), value: Codec.lease(record)))
        }
        var lastCause = "no attempt"
        var backoff: Duration = .milliseconds(50)
        var unknown = false
        while ContinuousClock.now < deadline {
            do {
                let result = try await client.txn(
                    compare: [.createRevision(layout.aliveKey(lease.id), .equal, lease.generation)], success: success,
                    timeout: min(ContinuousClock.now.duration(to: deadline), configuration.requestTimeout))
                health.succeeded()
                if result.succeeded, let own = alive, lease.ttl != nil {
                    // Its own etcd lease keeps nothing now: free it.
                    revokeLater(EtcdLease(id: own.etcdLease, ttl: 0))
                }
                // A repeat of a txn whose outcome was unknown finds it applied: the end is ours.
                return .success(result.succeeded || unknown)
            } catch let error as EtcdError {
                guard error.isTransient || error.isOutcomeUnknown else {
                    return .failure(SharedFailure(.refused, "etcd refused to end lease \(lease.id): \(error)"))
                }
                unknown = unknown || error.isOutcomeUnknown
                lastCause = error.description
                health.failed()
                try? await Task.sleep(for: min(backoff, max(ContinuousClock.now.duration(to: deadline), .zero)))
                backoff = min(backoff * 2, .milliseconds(500))
            } catch {
                break
            }
        }
        return .failure(SharedFailure(.unavailable, "no quorum: the etcd cluster cannot end lease \(lease.id) now (\(lastCause))"))
    }

    public func leaseFinished(_ id: UInt64) {
        let (client, layout) = (self.client, self.layout)
        Task {
            for attempt in 0..<5 {
                if attempt > 0 { try? await Task.sleep(for: .seconds(1)) }
                // Only an ended lease's record (its alive key gone) is forgotten.
                let done = try? await client.txn(
                    compare: [.version(layout.aliveKey(id), .equal, 0)], success: [.deleteRange(key: layout.leaseKey(id))], timeout: .seconds(3))
                if done != nil { return }
            }
        }
    }

    /// On the way out: this daemon's liveness lease is revoked, so the leases bound to its
    /// connections end now — every other daemon deletes their keys — rather than a TTL later.
    public func leave() async {
        tasks.withLock { tasks in
            for task in tasks { task.cancel() }
            tasks = []
        }
        await liveness.leave(timeout: .seconds(1))
    }
}
