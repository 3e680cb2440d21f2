// ObsEtcd: watches — one HTTP/1.1 stream per watch on `POST /v3/watch`, whose request body
// stays open (chunked) so the client can ask for progress; the answers are newline-delimited
// JSON. A channel handler frames and decodes them on the event loop, probes a silent stream,
// and hands messages to the iterator through NIO's back-pressured async sequence, so a slow
// consumer stops the socket being read instead of growing a buffer. The iterator reopens a
// broken stream on the next endpoint from the revision after the last one it delivered.

import NIOCore
import NIOHTTP1
import Synchronization

/// The changes to a key or range, as an async sequence of ``EtcdWatchResponse``s.
///
/// - **One revision per element.** etcd sends a live change in one response per revision (a
///   transaction of three puts arrives as one response with three events), but a *replayed*
///   response — from a `startRevision` in the past, or after the watch reopened — can hold
///   several revisions (measured: a watch from revision 1 got revisions 2 and 3 in one
///   response). The watch splits responses by `mod_revision`, so each element holds exactly
///   the events of one revision, in order.
/// - **No gap, no duplicate across a member's loss.** When the stream breaks (member killed or
///   restarted, connection lost, member without a leader, stream silent), the watch reopens
///   on the next endpoint from the revision after the last one delivered, and keeps trying —
///   with a backoff, every endpoint in turn — for up to `watchMaxOutage` (default: forever).
///   The iterator's `next()` simply waits meanwhile.
/// - **Silence.** Every member is asked to refuse watches while it knows no leader
///   (`hasleader`, forwarded by the gateway as `Grpc-Metadata-Hasleader: true`). A member that
///   loses its leader for three election timeouts cancels such watches; measured through the
///   gateway: with this client's open request body the member then closes the connection
///   (the watch reopens elsewhere at once), but a client whose request body had ended (curl
///   `-d`) was left with an open, silent stream — no error, no event. And a member that hangs
///   (SIGSTOP, a dead network path) says nothing at all. So the watch also sends a
///   `progress_request` whenever the stream has been quiet for `watchProbeInterval`, and
///   takes a stream that answers nothing within `watchProbeTimeout` as dead: a hung member is
///   left within interval + timeout (3 s by default), one cut off from the leader within about
///   3 election timeouts (≈ 4.5 s with etcd's default 1 s).
/// - **Compaction ends it.** When the start revision (or the resume revision after an outage)
///   is compacted, the sequence throws ``EtcdError/compacted(compactRevision:)``: read the
///   state afresh and watch from there.
/// - `prevKV` gives each event the key's previous state — except, silently, where that state
///   is compacted.
///
/// Progress reports (``EtcdWatchResponse/isProgress``) are delivered only with
/// `reportProgress`. Their revision is the member's revision when it answered. On etcd
/// 3.4.23 (Debian's) that is **not** a promise that every change up to it has been
/// delivered: the member answers outside the event stream and can run ahead of events still
/// on their way (etcd issue 15220, fixed in later 3.4 and 3.5 releases, which answer only
/// when the watcher is in sync). Take a report as a sign of life and the member's position,
/// not as "synced"; the watch itself never resumes from a progress revision.
/// Ending the iteration (or cancelling its task) closes the stream; a cancelled `next()`
/// throws ``EtcdError/cancelled(outcomeUnknown:)``.
public struct EtcdWatch: AsyncSequence, Sendable {
    /// One revision's events, or a progress report.
    public typealias Element = EtcdWatchResponse

    struct Request: Sendable {
        var key: [UInt8]
        var rangeEnd: [UInt8]?
        var startRevision: Int64?
        var prevKV: Bool
        var reportProgress: Bool
    }

    let client: EtcdClient
    let request: Request

    /// An iteration of the watch: it opens its stream on the first `next()`.
    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(state: WatchState(client: client, request: request))
    }

    /// The iterator of a watch. Use it from one task.
    public struct AsyncIterator: AsyncIteratorProtocol {
        let state: WatchState

        /// The next revision's events (or progress report); waits, across reopened streams,
        /// until there is one. Throws ``EtcdError`` when the watch cannot go on.
        public mutating func next() async throws -> EtcdWatchResponse? {
            try await state.next()
        }
    }
}

extension EtcdWatchResponse {
    /// The events of one etcd watch response, one element per revision: runs of equal
    /// `mod_revision`, in order (a replayed response can hold several revisions).
    static func grouped(_ events: [EtcdEvent]) -> [EtcdWatchResponse] {
        var groups: [EtcdWatchResponse] = []
        var start = 0
        while start < events.count {
            let revision = events[start].kv.modRevision
            var end = start + 1
            while end < events.count && events[end].kv.modRevision == revision { end += 1 }
            groups.append(EtcdWatchResponse(revision: revision, events: Array(events[start..<end])))
            start = end
        }
        return groups
    }
}

/// What the stream handler hands to the iterator.
enum WatchMessage: Sendable {
    case created(revision: Int64)
    case events([EtcdEvent])
    case progress(revision: Int64)
}

typealias WatchMessages = NIOThrowingAsyncSequenceProducer<
    WatchMessage, any Error, NIOAsyncSequenceProducerBackPressureStrategies.HighLowWatermark, WatchDelegate
>

/// The state of one watch's iteration: where it is, and the stream it reads.
final class WatchState {
    private let client: EtcdClient
    private let request: EtcdWatch.Request
    /// Where a reopened stream starts: the revision after the last delivered (nil until the
    /// first stream says where "now" is).
    private var nextRevision: Int64?
    private var pending: [EtcdWatchResponse] = []
    private var pendingIndex = 0
    private var channel: (any Channel)?
    private var messages: WatchMessages.AsyncIterator?
    private var finished = false

    init(client: EtcdClient, request: EtcdWatch.Request) {
        self.client = client
        self.request = request
        self.nextRevision = request.startRevision
    }

    deinit {
        channel?.close(promise: nil)
    }

    func next() async throws -> EtcdWatchResponse? {
        while true {
            if pendingIndex < pending.count {
                defer { pendingIndex += 1 }
                return pending[pendingIndex]
            }
            pending.removeAll(keepingCapacity: true)
            pendingIndex = 0
            if finished { return nil }
            if Task.isCancelled { throw end(.cancelled(outcomeUnknown: false)) }
            if messages == nil { try await open() }

            let message: WatchMessage?
            do {
                message = try await messages?.next()
            } catch let error as EtcdError where !Self.isRetryable(error) {
                throw end(error)
            } catch {
                if Task.isCancelled { throw end(.cancelled(outcomeUnknown: false)) }
                client.watchStreamsLost.add(1, ordering: .relaxed)
                drop()
                continue
            }
            guard let message else {
                if Task.isCancelled { throw end(.cancelled(outcomeUnknown: false)) }
                client.watchStreamsLost.add(1, ordering: .relaxed)
                drop()
                continue
            }
            switch message {
            case .created:
                continue
            case .events(let events):
                for group in EtcdWatchResponse.grouped(events) {
                    pending.append(group)
                    nextRevision = max(nextRevision ?? 0, group.revision + 1)
                }
            case .progress(let revision):
                // Not a resume point: etcd 3.4.23 answers a progress request with the member's
                // current revision even while events below it are still on their way to this
                // watcher (etcd issue 15220, fixed in later releases), so resuming after it
                // could skip them.
                if request.reportProgress { pending.append(EtcdWatchResponse(revision: revision, events: [])) }
            }
        }
    }

    /// Errors after which the watch reopens elsewhere: the member or the path to it failed,
    /// not the request.
    static func isRetryable(_ error: EtcdError) -> Bool {
        switch error {
        case .unavailable, .timeout, .connectionLost: true
        case .server(let code, _): code == 14
        case .compacted, .invalidResponse, .cancelled, .invalidConfiguration: false
        }
    }

    private func end(_ error: EtcdError) -> EtcdError {
        finished = true
        drop()
        return error
    }

    private func drop() {
        channel?.close(promise: nil)
        channel = nil
        messages = nil
    }

    /// Opens a stream on the first endpoint that takes it, starting with the client's
    /// preferred one; retries every endpoint with a backoff until `watchMaxOutage`.
    private func open() async throws {
        let configuration = client.configuration
        let count = configuration.endpoints.count
        let outageStart = ContinuousClock.now
        var delay = Duration.milliseconds(50)
        var lastError = EtcdError.unavailable("no endpoint tried")
        while true {
            let first = client.preferredEndpoint()
            for offset in 0..<count {
                let index = (first + offset) % count
                do {
                    try await attempt(index)
                    return
                } catch let error as EtcdError where Self.isRetryable(error) {
                    lastError = error
                } catch let error as EtcdError {
                    throw end(error)
                } catch {
                    lastError = .unavailable("\(error)")
                }
                if Task.isCancelled { throw end(.cancelled(outcomeUnknown: false)) }
            }
            if let limit = configuration.watchMaxOutage, ContinuousClock.now - outageStart >= limit {
                throw end(.unavailable("cannot reopen the watch: \(lastError)"))
            }
            // A backoff between rounds over every endpoint, not a wait for a condition.
            try? await Task.sleep(for: delay)
            if Task.isCancelled { throw end(.cancelled(outcomeUnknown: false)) }
            delay = min(delay * 2, .seconds(1))
        }
    }

    /// One stream on endpoint `index`, up to its `created` answer.
    private func attempt(_ index: Int) async throws {
        let configuration = client.configuration
        let create = WireWatchRequest(
            create_request: WireWatchCreateRequest(
                key: WireBytes(request.key), range_end: request.rangeEnd.map(WireBytes.init),
                start_revision: nextRevision.map(WireInt.init), progress_notify: nil, prev_kv: request.prevKV ? true : nil))
        var line = try WireCoding.encode(create)
        line.append(UInt8(ascii: "\n"))
        let gatewayRequest = GatewayRequest(path: "/v3/watch", body: line, requireLeader: configuration.requireLeader)
        let endpoint = configuration.endpoints[index]
        let delegate = WatchDelegate()
        let produced = WatchMessages.makeSequence(
            backPressureStrategy: .init(lowWatermark: 8, highWatermark: 64), finishOnDeinit: true, delegate: delegate)
        let source = produced.source
        let probe = WatchStreamHandler.Probe(
            interval: configuration.watchProbeInterval.timeAmount, timeout: configuration.watchProbeTimeout.timeAmount)
        let channel: any Channel
        do {
            channel = try await client.pool.connectStream(index, connectTimeout: configuration.connectTimeout.timeAmount) {
                channel in
                let handler = WatchStreamHandler(request: gatewayRequest, endpoint: endpoint, source: source, probe: probe)
                try channel.pipeline.syncOperations.addHandler(handler)
                delegate.attach(NIOLoopBound(handler, eventLoop: channel.eventLoop), on: channel.eventLoop)
            }
        } catch let failure as TransportFailure {
            throw EtcdError.unavailable("\(failure)")
        }
        let iterator = produced.sequence.makeAsyncIterator()
        do {
            guard case .created(let revision)? = try await iterator.next() else {
                throw EtcdError.invalidResponse("a watch stream that did not begin with its creation")
            }
            if nextRevision == nil { nextRevision = revision + 1 }
        } catch {
            channel.close(promise: nil)
            throw error
        }
        self.channel = channel
        self.messages = iterator
        client.watchStreamsOpened.add(1, ordering: .relaxed)
    }
}
