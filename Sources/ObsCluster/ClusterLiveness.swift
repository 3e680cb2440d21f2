// ObsCluster — this daemon's liveness in etcd: one etcd lease of its own, with a short TTL,
// kept alive while the daemon runs. The alive keys of the leases it grants bound to its
// connections are attached to it, so they end — and every daemon deletes their keys — when
// this daemon stops (it revokes the lease on its way out), dies, or loses etcd for longer
// than the TTL (etcd lets the lease expire).
//
// The daemon's own view is the conservative one: a keep-alive sent at time t and answered
// proves the lease lives until at least t + TTL in etcd (etcd counts from when it receives
// it). Once that time passes without a newer proof — etcd unreachable, or the keep-alive
// says the lease is gone — the lease is *lost* here: the leases it kept are ended as far as
// this daemon is concerned (before etcd can end them), a new liveness lease is granted, and
// the old one is revoked as soon as etcd can be reached, so that etcd agrees.

import Logging
import ObsEtcd
import Synchronization

final class Liveness: Sendable {
    /// The TTL asked for (etcd may raise it to its minimum).
    let ttl: Duration
    private let client: EtcdClient
    private let logger: Logger

    private struct State {
        /// The liveness lease, while this daemon vouches for it.
        var lease: Int64?
        /// Until when etcd certainly keeps it (sent time of the last answered keep-alive + TTL).
        var confirmedUntil: ContinuousClock.Instant = .now
        var waiters: [UInt64: CheckedContinuation<Int64?, Never>] = [:]
        var nextWaiter: UInt64 = 0
        /// Told of each lease lost (set by `run`).
        var lost: (@Sendable (Int64) -> Void)?
    }

    private let state = Mutex(State())

    init(ttl: Duration, client: EtcdClient, logger: Logger) {
        self.ttl = ttl
        self.client = client
        self.logger = logger
    }

    /// The liveness lease, waiting up to `timeout` for one (nil: none could be had).
    func current(timeout: Duration) async -> Int64? {
        let id: UInt64? = state.withLock { s in
            if s.lease != nil { return nil }
            s.nextWaiter += 1
            return s.nextWaiter
        }
        guard let id else { return state.withLock { $0.lease } }
        return await withCheckedContinuation { (continuation: CheckedContinuation<Int64?, Never>) in
            let now = state.withLock { s -> Int64?? in
                if let lease = s.lease { return .some(lease) }
                s.waiters[id] = continuation
                return .none
            }
            if let now { return continuation.resume(returning: now) }
            Task {
                try? await Task.sleep(for: timeout)
                self.state.withLock { $0.waiters.removeValue(forKey: id) }?.resume(returning: nil)
            }
        }
    }

    /// Keeps a liveness lease until cancelled; `lost` is told of each lease lost.
    func run(lost: @escaping @Sendable (Int64) -> Void) async {
        state.withLock { $0.lost = lost }
        let interval = ttl / 3
        var backoff: Duration = .milliseconds(100)
        while !Task.isCancelled {
            guard let (lease, until) = state.withLock({ s in s.lease.map { ($0, s.confirmedUntil) } }) else {
                let sent = ContinuousClock.now
                do {
                    let granted = try await client.leaseGrant(ttl: max(1, ttl.components.seconds), timeout: .seconds(2))
                    let waiters = state.withLock { s in
                        s.lease = granted.id
                        s.confirmedUntil = sent + .seconds(granted.ttl)
                        defer { s.waiters = [:] }
                        return s.waiters.values
                    }
                    for waiter in waiters { waiter.resume(returning: granted.id) }
                    backoff = .milliseconds(100)
                } catch {
                    if Task.isCancelled { return }
                    try? await Task.sleep(for: backoff)
                    backoff = min(backoff * 2, .seconds(1))
                }
                continue
            }
            let wake = min(ContinuousClock.now + interval, until)
            guard (try? await Task.sleep(until: wake)) != nil else { return }
            if ContinuousClock.now >= until {
                declareLost(lease, why: "no keep-alive answered for \(ttl)")
                continue
            }
            let sent = ContinuousClock.now
            do {
                if let renewed = try await client.leaseKeepAlive(lease, timeout: max(sent.duration(to: until), .milliseconds(100))) {
                    state.withLock { s in if s.lease == lease { s.confirmedUntil = max(s.confirmedUntil, sent + .seconds(renewed)) } }
                } else {
                    declareLost(lease, why: "etcd says it no longer exists")
                }
            } catch {
                // Tried again next round; lost once `until` passes without an answer.
            }
        }
    }

    /// A request found the liveness lease gone in etcd.
    func gone(_ lease: Int64) {
        declareLost(lease, why: "etcd says it no longer exists")
    }

    private func declareLost(_ lease: Int64, why: String) {
        let lost = state.withLock { s -> (@Sendable (Int64) -> Void)?? in
            guard s.lease == lease else { return .none }
            s.lease = nil
            return .some(s.lost)
        }
        guard let lost else { return }
        logger.warning(
            "lost this daemon's etcd liveness lease (\(why)): its connection-bound leases are ended; granting a new one")
        lost?(lease)
        // etcd must agree: revoke it as soon as etcd can be reached (its alive keys go with it).
        let client = self.client
        Task {
            while !Task.isCancelled {
                if (try? await client.leaseRevoke(lease, timeout: .seconds(2))) != nil { return }
                try? await Task.sleep(for: .seconds(1))
            }
        }
    }

    /// On the way out: revokes the liveness lease (what it keeps alive ends now, not a TTL
    /// later); waits `timeout` at most.
    func leave(timeout: Duration) async {
        guard let lease = state.withLock({ s -> Int64? in
            defer { s.lease = nil }
            return s.lease
        }) else { return }
        _ = try? await client.leaseRevoke(lease, timeout: timeout)
    }
}
