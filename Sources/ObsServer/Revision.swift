// ObsServer — a committed revision as the daemon shows it: the stored record, and the body
// of its change event (`,"repo":…,"rev":…,"changes":[…]}\n`), encoded once when the revision
// is made if anyone subscribes to its repository, and shared by every subscriber on every
// loop. A revision nobody watches is never encoded; a replay of one encodes it then.

import ObsProtocol
import ObsStore
import ObservableKit

final class Revision: Sendable {
    let record: RevisionRecord
    /// The connection whose write made it (its outbox), for `echo: false`; nil for revisions
    /// loaded from storage.
    let origin: ObjectIdentifier?
    /// The encoded event, when made with the revision (immutable after that: read by any loop).
    private let encoded: Encoded?

    private struct Encoded: Sendable {
        /// The body with every change.
        let body: [UInt8]
        /// Each change's object, for subscribers that select some of a revision's changes.
        let changes: [[UInt8]]
    }

    /// - Parameters:
    ///   - encode: whether to encode its event now (someone subscribes).
    ///   - origin: the connection that wrote it.
    init(_ record: RevisionRecord, encode: Bool, origin: ObjectIdentifier? = nil) {
        self.record = record
        self.origin = origin
        self.encoded = encode ? Self.encode(record) : nil
    }

    var revision: UInt64 { record.revision }
    var keys: [Key] { record.keys }

    /// Writes a change event minus its head (`{"event":"change","sub":N`, which each
    /// subscriber writes itself), holding the changes `selected` picks.
    func writeEventBody<S: JSONSink>(_ sink: inout S, selected: SelectedChanges) {
        let e = encoded ?? Self.encode(record)
        switch selected {
        case .all:
            sink.writeRaw(e.body)
        case .some(let positions):
            EventEncoder.writeChangeBody(&sink, repo: record.repo, rev: record.revision, encodedChanges: positions.lazy.map { e.changes[$0] })
        }
    }

    /// Writes the whole change event for subscription `sub` (with `by` for `writers`).
    func writeEvent<S: JSONSink>(_ sink: inout S, sub: UInt64, writers: Bool, selected: SelectedChanges) {
        EventEncoder.writeChangeHead(&sink, sub: sub)
        if writers, let writer = record.writer { EventEncoder.writeBy(&sink, writer) }
        writeEventBody(&sink, selected: selected)
    }

    private static func encode(_ record: RevisionRecord) -> Encoded {
        let changes = record.changes.map { change -> [UInt8] in
            var out: [UInt8] = []
            out.reserveCapacity(change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 24)
            EventEncoder.writeChange(&out, change) { sink, value in sink.writeCanonical(value) }
            return out
        }
        var body: [UInt8] = []
        body.reserveCapacity(changes.reduce(record.repo.utf8.count + 48) { $0 + $1.count + 1 })
        EventEncoder.writeChangeBody(&body, repo: record.repo, rev: record.revision, encodedChanges: changes)
        return Encoded(body: body, changes: changes.count > 1 ? changes : [])
    }
}
