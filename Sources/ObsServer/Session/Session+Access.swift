// ObsServer — a session's access checks: what the policy grants its peer per repository
// (cached until the policy changes), refusals with `forbidden` (logged, rate-limited), and
// re-checking live subscriptions after a reload (those that lost read access end with a
// `revoked` event).

import ObsProtocol
import ObservableKit

extension Session {
    /// What the policy grants this peer on `repo` (cached until the policy changes).
    func permission(_ repo: String) -> Permission {
        if peer.isPrivileged { return .write }
        if let known = permissions[repo] { return known }
        let (peer, users) = (self.peer, hub.users)
        let granted = runtime.policy.permission(of: peer, on: repo) { users.groups(of: peer.uid, primary: peer.gid) }
        if permissions.count > 4096 { permissions.removeAll() }
        permissions[repo] = granted
        return granted
    }

    /// Whether the peer may do `op` to `repo`; if not, replies `forbidden` and logs it.
    func permits(_ repo: String, _ needed: Permission, op: String, id: JSONValue) -> Bool {
        if permission(repo) >= needed { return true }
        hub.stats.denied.add(1, ordering: .relaxed)
        deniedCount += 1
        // A denied client can retry in a loop: log its first denials, then every 1000th.
        if deniedCount <= 10 || deniedCount % 1000 == 0 {
            logger.notice(
                "access denied", metadata: ["repo": "\(repo)", "op": "\(op)", "peer.gid": "\(peer.gid)", "denials": "\(deniedCount)"])
        }
        fail(id: id, ProtocolError(.forbidden, "\(peer.described(by: hub.users)) may not \(needed.verb) repository \(repo)"))
        return false
    }

    /// After a reload: ends the subscriptions of repositories this peer may no longer read,
    /// each with a final `revoked` event. Runs on the connection's event loop.
    func revalidate() {
        runtime = hub.runtime.snapshot
        permissions.removeAll()
        lastWritten = nil
        for subscription in outbox.liveSubscriptions where permission(subscription.repository.name) < .read {
            var notice: [UInt8] = []
            let error = ProtocolError(.forbidden, "\(peer.described(by: hub.users)) may no longer read repository \(subscription.repository.name)")
            RevokedEvent(subscription: subscription.id, repository: subscription.repository.name, error: error).encode(into: &notice)
            if shard.revoke(subscription.id, notice: notice, of: outbox) != nil {
                logger.notice("subscription revoked by the access policy", metadata: ["repo": "\(subscription.repository.name)"])
            }
        }
        shard.markDirty(connection)
    }
}
