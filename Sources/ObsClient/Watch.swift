// ObsClient — watches that survive reconnection. A `Watch` is an async sequence of one
// selection's changes that outlives connections: after the session reconnects, it
// resubscribes with `since` = the last revision it delivered and the epoch that revision
// belongs to, so the stream continues with no gap and no duplicate. Its subscriptions ask
// for `progress`, so that position keeps up with a busy repository while the selected keys
// are quiet, and never falls out of the daemon's history for that; when the daemon cannot
// replay that far (`compacted`: its history moved on, or it is another history — it
// restarted without its data, its data was replaced), it resubscribes with a snapshot and
// says so (`resync`).

import ObsProtocol
import ObservableKit

/// An event of a `Watch`.
public enum WatchEvent: Sendable {
    /// The selected keys' complete values at `revision`: first, when the watch asked for
    /// `initial`; and with `resync: true` after a reconnection whose missed changes the
    /// daemon could not replay — replace everything you hold for this selection.
    case snapshot(revision: UInt64, values: [Key: JSONValue], resync: Bool)
    /// One revision's changes to the selected keys: each exactly once, in order — or, for a
    /// watch with `coalesce` whose reader lagged, the changes of several revisions as one
    /// event (`from` set), which leaves a reader that applies it at the state of its
    /// `revision`.
    case change(ChangeEvent<JSONValue>)

    /// The revision the event is at.
    public var revision: UInt64 {
        switch self {
        case .snapshot(let revision, _, _): return revision
        case .change(let changes): return changes.revision
        }
    }
}

extension ObsSession {
    /// Watches the keys of `repository` that `selection` includes, across reconnections.
    ///
    /// - Parameters:
    ///   - repository: the repository.
    ///   - selection: the keys: some, a prefix, or all of them.
    ///   - initial: start with a `snapshot` of the selected keys.
    ///   - since: start after this revision instead (replaying what followed it); with
    ///     `initial`, `since` wins unless the daemon cannot replay that far.
    ///   - epoch: the epoch `since` belongs to (as a subscription or an earlier watch
    ///     reported it); if the repository's history is another one, the watch starts with a
    ///     resync snapshot instead of a replay.
    ///   - options: `coalesce`, `writers`, `echo` for every subscription the watch makes
    ///     (see `SubscriptionOptions`). After a reconnection the watch resumes from the
    ///     revision of the last event it delivered, coalesced or not. With `echo: false`,
    ///     "own writes" are those of the session's connection at the time: revisions written
    ///     on an earlier connection may be replayed after a reconnection.
    /// - Returns: a sequence that ends when the consuming task is cancelled and throws
    ///   when the session closes (`sessionClosed`) or the daemon ends the subscription
    ///   for good (`forbidden` when access was revoked).
    public func watch(
        _ repository: String, selecting selection: Selection = .all, initial: Bool = false, since: UInt64? = nil,
        epoch: String? = nil, options: SubscriptionOptions = .default
    ) -> Watch {
        Watch(core: core, repository: repository, selection: selection, initial: initial, since: since, epoch: epoch, options: options)
    }
}

/// Changes to a selection of one repository, as an async sequence that survives
/// reconnection (see `ObsSession.watch(_:selecting:initial:since:epoch:options:)`). Each iterator is its own subscription.
public struct Watch: AsyncSequence, Sendable {
    public typealias Element = WatchEvent

    /// The repository watched.
    public let repository: String
    /// The keys watched.
    public let selection: Selection
    /// The options of its subscriptions.
    public let options: SubscriptionOptions
    let core: SessionCore
    let initial: Bool
    let since: UInt64?
    let epoch: String?

    init(
        core: SessionCore, repository: String, selection: Selection, initial: Bool, since: UInt64?, epoch: String?,
        options: SubscriptionOptions
    ) {
        self.core = core
        self.repository = repository
        self.selection = selection
        self.initial = initial
        self.since = since
        self.epoch = epoch
        self.options = options
    }

    /// Starts the watch: each iterator is its own subscription.
    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(watch: self, position: since, epoch: epoch)
    }

    /// Iterates a watch, resubscribing after each reconnection.
    public struct AsyncIterator: AsyncIteratorProtocol {
        let watch: Watch
        /// Every selected change through this revision has been delivered (for a coalescing
        /// watch: the state at this revision has). Moves with the events, and with the
        /// daemon's `progress` events while the selected keys are quiet.
        public private(set) var position: UInt64?
        /// The history `position` belongs to (nil until the first subscription, unless given).
        /// It moves only together with `position`.
        public private(set) var epoch: String?
        /// The serial number of the connection of the current subscription (0 before the first).
        private(set) var connection: UInt64 = 0
        private var subscription: Subscription.AsyncIterator?
        /// The epoch of a subscription whose snapshot has not arrived: it becomes `epoch` with
        /// the snapshot's revision. Until then `position` is still in the old history, and a
        /// connection lost in between resumes from there — never from the old position in
        /// the new history, which would replay one history's changes onto another's state.
        private var snapshotEpoch: String?
        private var resyncing = false
        private var finished = false

        init(watch: Watch, position: UInt64?, epoch: String?) {
            self.watch = watch
            self.position = position
            self.epoch = epoch
        }

        /// The next event; after a reconnection, the first of the resumed subscription.
        public mutating func next() async throws -> WatchEvent? {
            while !finished {
                do throws(ObsClientError) {
                    if subscription == nil { try await open() }
                    guard let event = try await nextEvent() else {
                        finished = true  // the consuming task was cancelled
                        return nil
                    }
                    switch event {
                    case .snapshot(let revision, let values):
                        position = revision
                        if let snapshotEpoch { epoch = snapshotEpoch }
                        snapshotEpoch = nil
                        defer { resyncing = false }
                        return .snapshot(revision: revision, values: values, resync: resyncing)
                    case .change(let changes):
                        position = changes.revision
                        return .change(changes)
                    case .synced(let revision):
                        position = revision
                    case .progress(let revision):
                        if let current = position, revision > current, snapshotEpoch == nil { position = revision }
                    }
                } catch where error.code == .connectionClosed || error.code == .overflowed {
                    subscription = nil  // the session reconnects; resume from `position`
                    snapshotEpoch = nil
                } catch {
                    finished = true
                    throw error
                }
            }
            return nil
        }

        private mutating func nextEvent() async throws(ObsClientError) -> WatchItem? {
            do {
                switch try await subscription?.nextItem() {
                case nil: return nil
                case .progress(let revision)?: return .progress(revision)
                case .event(let event)?:
                    switch event {
                    case .snapshot(let revision, let values): return .snapshot(revision, values)
                    case .change(let change): return .change(change)
                    case .synced(let revision): return .synced(revision)
                    }
                }
            } catch let error as ObsClientError {
                throw error
            } catch {
                throw .cancelled
            }
        }

        /// Subscribes on the session's current connection: from `position` when there is
        /// one, else as asked; with a snapshot when the daemon cannot replay from there.
        private mutating func open() async throws(ObsClientError) {
            let client = try await watch.core.client()
            let repo = watch.repository, selection = watch.selection, options = watch.options
            let subscription: Subscription
            if let position {
                do {
                    subscription = try await client.subscribe(
                        to: repo, selecting: selection, initial: false, since: position, epoch: epoch, once: false, options: options, progress: true)
                    epoch = subscription.epoch  // the daemon replays from `position`: it is in this history
                } catch where error.code == .compacted {
                    resyncing = true
                    subscription = try await client.subscribe(
                        to: repo, selecting: selection, initial: true, since: nil, epoch: nil, once: false, options: options, progress: true)
                    snapshotEpoch = subscription.epoch
                }
            } else {
                subscription = try await client.subscribe(
                    to: repo, selecting: selection, initial: watch.initial, since: nil, epoch: nil, once: false, options: options, progress: true)
                if watch.initial {
                    snapshotEpoch = subscription.epoch
                } else {
                    (position, epoch) = (subscription.revision, subscription.epoch)
                }
            }
            connection = subscription.connection
            self.subscription = subscription.makeAsyncIterator()
        }
    }
}

/// What a watch's subscription hands its iterator: an event, or a `progress` revision.
private enum WatchItem {
    case snapshot(UInt64, [Key: JSONValue])
    case change(ChangeEvent<JSONValue>)
    case synced(UInt64)
    case progress(UInt64)
}
