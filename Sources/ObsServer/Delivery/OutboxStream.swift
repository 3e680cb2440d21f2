// ObsServer — a long run of a connection's messages produced as its socket takes them: a
// subscription's start whose state (a snapshot, or a catch-up's diff) or replay is large.
// The run is its head (the subscribe reply, the state event's head and its first members),
// then the rest of the state's members — read a piece at a time from the repository, under its
// lock, with the values of the start's revision (`StateSource`; RepositoryCore's readers keep
// what a write changes meanwhile) — then its tail (the state event's end, the replay, `synced`).
// The outbox asks for the next piece only while it holds less than `Outbox.streamWindow`
// ready bytes, so a snapshot of gigabytes costs a copy of its keys and a window of encoded
// bytes, never a copy of its values nor a refusal for its size; the connection's flow control
// and overflow work on it as on any other bytes: what follows it (live events of the
// connection's subscriptions) waits behind it, counted toward the queue's limit. A `since`
// replay is a copy of history records, bounded by the history's limits; how many such copies
// the daemon holds at once is bounded by its `StartBudget` (StartBudget.swift).

import ObsCore
import ObsProtocol
import ObsValues
import ObservableKit

/// The members of a start's state not yet sent, read from its repository as they are asked for.
final class StateSource {
    private let repository: Repository
    private let reader: UInt64
    private var keys: KeyList
    private var nextKey: Int
    private var sorted: Bool
    private var first: Bool
    private var closed = false

    /// `keys` (`sorted`, or not yet) from `next`, read with `reader` of `repository`;
    /// `first`: no member was sent before.
    init(repository: Repository, reader: UInt64, keys: KeyList, next: Int, sorted: Bool, first: Bool) {
        self.repository = repository
        self.reader = reader
        self.keys = keys
        self.nextKey = next
        self.sorted = sorted
        self.first = first
    }

    deinit { close() }

    /// The next members, about `bytes` of them; nil once every key is read (the reader closed).
    func next(_ bytes: Int) -> [UInt8]? {
        guard nextKey < keys.count else {
            close()
            return nil
        }
        if !sorted {
            // Outside the repository's lock: writers go on meanwhile, the reader keeps what they change.
            keys = keys.sorted()
            sorted = true
        }
        var piece: [UInt8] = []
        piece.reserveCapacity(bytes + 1024)
        nextKey = repository.readMembers(of: keys, from: nextKey, reader: reader, maxBytes: bytes, first: first, into: &piece)
        if !piece.isEmpty { first = false }
        if nextKey == keys.count {
            keys = KeyList()
            close()
        }
        return piece
    }

    private func close() {
        guard !closed else { return }
        closed = true
        repository.closeReader(reader)
    }
}

/// Pieces of encoded messages, produced on demand on the connection's loop.
final class OutboxStream {
    /// The events the whole run holds (counted toward the queue when the run is queued).
    let events: Int
    private var head: [UInt8]
    private var state: StateSource?
    private var tail: [UInt8]
    private var tailSent = 0

    /// What the run holds of the daemon's `StartBudget`, given back when it is done.
    private var budget: (StartBudget, bytes: Int)?

    /// A run that is `head`, then the members `state` reads, then `tail`; `budget`: the bytes
    /// it took of the daemon's budget (given back once it is sent, or dropped with its
    /// connection).
    init(head: [UInt8], state: StateSource? = nil, tail: [UInt8], events: Int, budget: (StartBudget, bytes: Int)? = nil) {
        self.head = head
        self.state = state
        self.tail = tail
        self.events = events
        self.budget = budget
    }

    deinit { giveBack() }

    private func giveBack() {
        if let (start, bytes) = budget { start.give(bytes) }
        budget = nil
    }

    /// How large a piece is, about (a member is never split; the tail is cut at this size).
    static let pieceBytes = 256 << 10

    /// The next piece; nil once the run is done.
    func next() -> [UInt8]? {
        if !head.isEmpty {
            defer { head = [] }
            return head
        }
        if let state {
            if let piece = state.next(Self.pieceBytes) { return piece }
            self.state = nil
        }
        guard tailSent < tail.count else {
            giveBack()
            return nil
        }
        let end = min(tail.count, tailSent + Self.pieceBytes)
        defer { tailSent = end }
        return Array(tail[tailSent..<end])
    }
}

@available(*, unavailable)
extension OutboxStream: Sendable {}

@available(*, unavailable)
extension StateSource: Sendable {}
