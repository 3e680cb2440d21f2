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
    let origin: ConnectionID?
    /// The encoded event, when made with the revision (immutable after that: read by any loop).
    private let encoded: Encoded?

    private struct Encoded: Sendable {
        /// The body with every change.
        let body: [UInt8]
        /// Where each change's object lies in `body`, for subscribers that select some of a
        /// revision's changes (empty for a revision of one change).
        let changes: [Range<Int>]
    }

    /// - Parameters:
    ///   - encode: whether to encode its event now (someone subscribes).
    ///   - origin: the connection that wrote it.
    init(_ record: RevisionRecord, encode: Bool, origin: ConnectionID? = nil) {
        self.record = record
        self.origin = origin
        self.encoded = encode ? Self.encode(record) : nil
    }

    var revision: UInt64 { record.revision }
    /// Its keys, in application order (without building an array).
    var keys: LazyMapSequence<[Change<CanonicalJSON>], Key> { record.changes.lazy.map(\.key) }

    /// Writes a change event minus its head (`{"event":"change","sub":N`, which each
    /// subscriber writes itself), holding the changes `selected` picks.
    func writeEventBody<S: JSONSink>(_ sink: inout S, selected: SelectedChanges) {
        let e = encoded ?? Self.encode(record)
        switch selected {
        case .all:
            sink.writeRaw(e.body)
        case .some(let positions):
            e.body.withUnsafeBytes { body in
                EventEncoder.writeChangeBody(&sink, repo: record.repo, rev: record.revision, count: positions.count) { sink, i in
                    sink.writeBytes(UnsafeRawBufferPointer(rebasing: body[e.changes[positions[i]]]))
                }
            }
        }
    }

    /// Writes the whole change event for subscription `sub` (with `by` for `writers`).
    func writeEvent<S: JSONSink>(_ sink: inout S, sub: UInt64, writers: Bool, selected: SelectedChanges) {
        EventEncoder.writeChangeHead(&sink, sub: sub)
        if writers, let writer = record.writer { EventEncoder.writeBy(&sink, writer) }
        writeEventBody(&sink, selected: selected)
    }

    /// One buffer, each change object written in place (its range kept when there are several).
    private static func encode(_ record: RevisionRecord) -> Encoded {
        let several = record.changes.count > 1
        var body: [UInt8] = []
        body.reserveCapacity(record.changes.reduce(record.repo.utf8.count + 48) { $0 + RevisionRecord.byteSize(of: $1) })
        var changes: [Range<Int>] = []
        if several { changes.reserveCapacity(record.changes.count) }
        EventEncoder.writeChangeBody(&body, repo: record.repo, rev: record.revision, count: record.changes.count) { body, i in
            let start = body.count
            EventEncoder.writeChange(&body, record.changes[i]) { sink, value in sink.writeCanonical(value) }
            if several { changes.append(start..<body.count) }
        }
        return Encoded(body: body, changes: changes)
    }
}
