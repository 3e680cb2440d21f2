// ObsServer — a long run of a connection's messages produced as its socket takes them: a
// subscription's start whose snapshot (or replay) is large. The run is one consistent copy of
// what the subscription starts with, taken under the repository's lock like any other; what
// streams is its encoding. The outbox asks for the next piece only while it holds less than
// `Outbox.streamWindow` ready bytes, so a snapshot of gigabytes costs its entries' copy (each
// value's freed once it is encoded) and a window of encoded bytes — not three copies of it,
// and never a refusal for its size; how many such copies the daemon holds at once is bounded
// by its `StartBudget` (StartBudget.swift) — and
// the connection's flow control and overflow work on it as on any other bytes: what follows
// it (live events of the connection's subscriptions) waits behind it, counted toward the
// queue's limit.

import ObsProtocol
import ObsValues
import ObservableKit

/// Pieces of encoded messages, produced on demand on the connection's loop.
final class OutboxStream {
    /// The events the whole run holds (counted toward the queue when the run is queued).
    let events: Int
    private var head: [UInt8]
    private var entries: [(key: Key, value: CanonicalJSON)]
    private var nextEntry = 0
    private var tail: [UInt8]
    private var tailSent = 0

    /// What the run holds of the daemon's `StartBudget`, given back when it is done.
    private var budget: (StartBudget, bytes: Int)?

    /// A run that is `head`, then `entries` as the members of a JSON object (`"key":value`,
    /// comma-separated — a snapshot event's `values`), then `tail`; `budget`: the bytes it took
    /// of the daemon's budget (given back once it is sent, or dropped with its connection).
    init(head: [UInt8], entries: [(key: Key, value: CanonicalJSON)] = [], tail: [UInt8], events: Int, budget: (StartBudget, bytes: Int)? = nil) {
        self.head = head
        self.entries = entries
        self.tail = tail
        self.events = events
        self.budget = budget
    }

    deinit { giveBack() }

    private func giveBack() {
        if let (start, bytes) = budget { start.give(bytes) }
        budget = nil
    }

    /// How large a piece is, about (an entry is never split; the tail is cut at this size).
    static let pieceBytes = 256 << 10

    /// The next piece; nil once the run is done.
    func next() -> [UInt8]? {
        if nextEntry < entries.count || !head.isEmpty {
            var piece = head
            head = []
            piece.reserveCapacity(Self.pieceBytes + 1024)
            while nextEntry < entries.count, piece.count < Self.pieceBytes {
                let entry = entries[nextEntry]
                SnapshotEvent<CanonicalJSON>.encodeMember(entry.key, entry.value, first: nextEntry == 0, into: &piece)
                entries[nextEntry].value = .null  // its copy goes as soon as it is encoded
                nextEntry += 1
            }
            if nextEntry == entries.count { entries = [] }
            return piece
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
