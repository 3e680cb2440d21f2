// ObsServer — subscribing to a repository: what a subscription starts with (its snapshot or
// its replay from the history) and where it goes live, taken under the repository's lock so
// the two meet at exactly one revision; and the count of subscribers per loop that tells the
// repository where to post its revisions.

import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization

extension Repository {
    // MARK: Subscribing

    /// Takes what `subscription` starts with and — unless its one `once` change is in the
    /// replay — makes it live on its connection and routes it on its loop, all under the
    /// lock, so its snapshot or replay and its first event meet at one revision.
    ///
    /// - Throws: `compacted` when `since` cannot be served from the history (another
    ///   epoch, a revision this daemon does not have, or one no longer retained).
    func subscribe(_ subscription: Subscription, _ request: SubscribeRequest, now: Int64) throws(ProtocolError) -> SubscriptionStart {
        try state.withLock { (s) throws(ProtocolError) in
            let revision = s.data.revision
            var replay: [Revision] = []
            if let since = request.since {
                if let seen = request.epoch, seen != epoch {
                    throw ProtocolError(
                        .compacted,
                        "epoch \(JSONValue.string(String(seen.prefix(80))).jsonText) is not repository \(name)'s history (its epoch is \(epoch)): revision \(since) of that history means nothing here; subscribe with initial: true"
                    )
                }
                guard since <= revision else {
                    throw ProtocolError(
                        .compacted,
                        "since \(since) is ahead of repository \(name)'s revision \(revision): this daemon does not have that history; subscribe with initial: true"
                    )
                }
                guard let records = s.history.records(after: since, current: revision, now: now) else {
                    let oldest = s.history.oldestRevision(now: now).map { "starts at revision \($0)" } ?? "is empty"
                    throw ProtocolError(
                        .compacted,
                        "history of repository \(name) \(oldest); since \(since) is older: subscribe with initial: true")
                }
                replay = records.filter { Self.selects(request.selection, $0) && subscription.wants($0) }
            }
            let snapshot = request.initial ? Self.entries(of: s.data, request.selection) : nil
            // A `once` subscription whose change is in the replay ends there, unregistered.
            let live = !(subscription.once && !replay.isEmpty) && subscription.outbox.register(subscription)
            if live {
                subscription.after = revision
                subscription.completeThrough = revision
                let shard = subscription.outbox.shard
                shard.route(subscription, for: request.selection)
                if let i = s.subscriberLoops.firstIndex(where: { $0.shard === shard }) {
                    s.subscriberLoops[i].count += 1
                } else {
                    s.subscriberLoops.append((shard, 1))
                }
                subscribers.add(1, ordering: .relaxed)
            }
            return SubscriptionStart(revision: revision, sequence: s.current, snapshot: snapshot, replay: replay, registered: live)
        }
    }

    /// A subscription on `shard` ended (the shard stopped routing it).
    func subscriberLeft(_ shard: LoopShard) {
        state.withLock { s in
            guard let i = s.subscriberLoops.firstIndex(where: { $0.shard === shard }) else { return }
            s.subscriberLoops[i].count -= 1
            if s.subscriberLoops[i].count == 0 { s.subscriberLoops.remove(at: i) }
        }
        subscribers.subtract(1, ordering: .relaxed)
    }

    // MARK: Helpers

    /// Whether a revision touches a key the selection picks.
    private static func selects(_ selection: Selection, _ revision: Revision) -> Bool {
        if case .all = selection { return true }
        return revision.record.changes.contains { selection.matches($0.key) }
    }

    /// The selected entries, unsorted.
    static func entries(of data: KeyedState<CanonicalJSON>, _ selection: Selection) -> [(key: Key, value: CanonicalJSON)] {
        switch selection {
        case .keys(let keys):
            return keys.compactMap { key in data[key].map { (key, $0.value) } }
        case .prefix(let prefix) where !prefix.isEmpty:
            return data.entries.compactMap { $0.key.hasBytePrefix(prefix) ? ($0.key, $0.value.value) : nil }
        case .all, .prefix:
            return data.entries.map { ($0.key, $0.value.value) }
        }
    }
}
