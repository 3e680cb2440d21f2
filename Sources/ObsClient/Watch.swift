// ObsClient — watches that survive reconnection. A `Watch` is an async sequence of one
// selection's changes that outlives connections: after the session reconnects, it
// resubscribes with `since` = the last revision it delivered, the epoch that revision
// belongs to, and `catchup`, so the stream continues with no gap and no duplicate. Its
// subscriptions ask for `progress`, so that position keeps up with a busy repository while
// the selected keys are quiet. It never starts over on its own: when the daemon's history
// no longer reaches back to the position, the daemon sends the keys that changed since, as
// they are now (a `catchUp` event); when the position is in another history (the daemon
// restarted without its data, its data was replaced) or the daemon no longer knows the
// deletions since, a snapshot, which the watch says is one (`resync`). Only a daemon without
// catch-up answers `compacted`: then the watch resubscribes with a snapshot, as it did
// before catch-up existed.

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
    /// After a reconnection whose missed revisions the daemon's history no longer holds (in
    /// the same history): the selected keys that changed after the watch's position, as they
    /// are at the event's `revision`. Set each of its `values`, remove each of its `deleted`,
    /// and you hold the selected state at `revision`; a key it does not list did not change.
    /// Their earlier values are not known (a key it lists may even hold the value it had).
    case catchUp(CatchUpEvent<JSONValue>)

    /// The revision the event is at.
    public var revision: UInt64 {
        switch self {
        case .snapshot(let revision, _, _): return revision
        case .change(let changes): return changes.revision
        case .catchUp(let diff): return diff.revision
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
    ///   - since: start after this revision instead (replaying what followed it, or — past
    ///     the daemon's history — with a ``WatchEvent/catchUp(_:)``); `initial` is then not
    ///     used.
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
        /// Told where the watch is, for a mirror's `sync` (set by the mirror).
        var monitor: WatchMonitor?
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
            monitor?.consumed(position: position, epoch: epoch)  // the consumer applied what it was handed
            while !finished {
                do throws(ObsClientError) {
                    if subscription == nil { try await open() }
                    guard let event = try await nextEvent() else {
                        finish(.cancelled)  // the consuming task was cancelled
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
                    case .catchUp(let diff):
                        position = diff.revision
                        if diff.isEmpty {  // nothing selected changed: nothing to hand on
                            monitor?.consumed(position: position, epoch: epoch)
                            continue
                        }
                        return .catchUp(diff)
                    case .synced(let revision):
                        position = revision
                        monitor?.consumed(position: position, epoch: epoch)
                    case .progress(let revision), .syncMark(_, let revision):
                        if let current = position, revision > current, snapshotEpoch == nil { position = revision }
                        monitor?.consumed(position: position, epoch: epoch)
                        if case .syncMark(let mark, _) = event { monitor?.reached(mark: mark) }
                    }
                } catch where error.code == .connectionClosed || error.code == .overflowed {
                    subscription = nil  // the session reconnects; resume from `position`
                    snapshotEpoch = nil
                    monitor?.lost()
                } catch {
                    finish(error)
                    throw error
                }
            }
            return nil
        }

        private mutating func finish(_ error: ObsClientError) {
            finished = true
            monitor?.end(error)
        }

        private mutating func nextEvent() async throws(ObsClientError) -> WatchItem? {
            do {
                switch try await subscription?.nextItem() {
                case nil: return nil
                case .progress(let revision)?: return .progress(revision)
                case .syncMark(let mark, let revision)?: return .syncMark(mark, revision)
                case .event(let event)?:
                    switch event {
                    case .snapshot(let revision, let values): return .snapshot(revision, values)
                    case .change(let change): return .change(change)
                    case .synced(let revision): return .synced(revision)
                    case .catchUp(let diff): return .catchUp(diff)
                    }
                }
            } catch let error as ObsClientError {
                throw error
            } catch {
                throw .cancelled
            }
        }

        /// Subscribes on the session's current connection: from `position` with `catchup` when
        /// there is one, else as asked; with a snapshot when the daemon has no catch-up and
        /// cannot replay from there.
        private mutating func open() async throws(ObsClientError) {
            let client = try await watch.core.client()
            let repo = watch.repository, selection = watch.selection, options = watch.options
            let subscription: Subscription
            if let position {
                do {
                    subscription = try await client.subscribe(
                        to: repo, selecting: selection, initial: false, since: position, epoch: epoch, catchUp: true, once: false,
                        options: options, progress: true)
                    if subscription.catchUp == .snapshot {
                        // Another history, or the deletions since are no longer known: a snapshot
                        // follows, to be handed on as a resync.
                        resyncing = true
                        snapshotEpoch = subscription.epoch
                    } else {
                        epoch = subscription.epoch  // a replay or a diff from `position`: it is in this history
                    }
                } catch where error.code == .compacted {
                    // A daemon without catch-up: start again from its complete state.
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
            monitor?.opened(subscription.client, subscription: subscription.id)
            monitor?.consumed(position: position, epoch: epoch)
        }
    }
}

/// What a watch's subscription hands its iterator: an event, a `progress` revision, or a sync mark.
private enum WatchItem {
    case snapshot(UInt64, [Key: JSONValue])
    case change(ChangeEvent<JSONValue>)
    case catchUp(CatchUpEvent<JSONValue>)
    case synced(UInt64)
    case progress(UInt64)
    case syncMark(UInt64, UInt64)
}
