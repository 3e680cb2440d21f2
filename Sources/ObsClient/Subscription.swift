// ObsClient — a live subscription on one connection: its number, where it started, and its
// events as an async sequence. Iterating it keeps its connection open.

import ObsProtocol
import ObservableKit

/// A live subscription: an async sequence of its events.
public struct Subscription: AsyncSequence, Sendable {
    public typealias Element = SubscriptionEvent

    /// The subscription number on its connection.
    public let id: UInt64
    public let repository: String
    /// The repository revision when the subscription began.
    public let revision: UInt64
    /// The history its revisions belong to: resume with `since` and this epoch.
    public let epoch: String
    /// The options it was made with.
    public let options: SubscriptionOptions
    /// For a subscription made with `catchUp`: how the daemon brings it up to ``revision``
    /// before `synced` — `.replay` (the replayed changes), `.diff`
    /// (one ``SubscriptionEvent/catchUp(_:)``) or `.snapshot` (one
    /// ``SubscriptionEvent/snapshot(revision:values:)`` that replaces everything held). Nil
    /// without `catchUp`, and from a daemon without catch-up, which replays as a plain `since`
    /// (or fails with `compacted`).
    public let catchUp: CatchUpMode?
    /// The serial number of the connection it is on.
    var connection: UInt64 { client.serial }
    private let events: AsyncThrowingStream<SubscriptionItem, any Error>
    private let stream: SubscriptionStream
    /// The connection it is on.
    let client: ObsConnection

    init(
        id: UInt64, repository: String, revision: UInt64, epoch: String, catchUp: CatchUpMode? = nil, options: SubscriptionOptions,
        events: AsyncThrowingStream<SubscriptionItem, any Error>, stream: SubscriptionStream, client: ObsConnection
    ) {
        self.id = id
        self.repository = repository
        self.revision = revision
        self.epoch = epoch
        self.catchUp = catchUp
        self.options = options
        self.events = events
        self.stream = stream
        self.client = client
    }

    /// Unsubscribes. The sequence finishes after the events that preceded the reply.
    public func cancel() async throws(ObsClientError) {
        try await client.unsubscribe(id)
    }

    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(base: events.makeAsyncIterator(), stream: stream, client: client)
    }

    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncThrowingStream<SubscriptionItem, any Error>.AsyncIterator
        let stream: SubscriptionStream
        /// Keeps the connection open while the subscription is iterated.
        let client: ObsConnection

        public mutating func next() async throws -> SubscriptionEvent? {
            while let item = try await nextItem() {
                if case .event(let event) = item { return event }
            }
            return nil
        }

        /// The next event, `progress` revision or sync mark (a `Watch` resumes from the latter two too).
        mutating func nextItem() async throws -> SubscriptionItem? {
            let item = try await base.next()
            if item != nil { stream.consumed() }
            return item
        }
    }
}
