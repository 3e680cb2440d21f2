// ObsStore — revisions as the daemon delivers and stores them.
//
// A `RevisionRecord` is one committed revision with its change event body pre-encoded,
// shared by every subscriber, the history and storage. Values are `CanonicalJSON`: their
// encoding is made once when a value arrives; replies, events, snapshots and history copy
// bytes instead of re-encoding.

import ObsProtocol
import ObservableKit

/// One committed revision of a repository, ready to deliver and to store.
public final class RevisionRecord: Sendable {
    public let repo: String
    public let revision: UInt64
    public let changes: [Change<CanonicalJSON>]
    /// When it was committed, in seconds since 1970 (for age-based history retention).
    public let time: Int64
    /// `,"repo":…,"rev":…,"changes":[…all…]}\n` — a change event minus its head.
    public let body: [UInt8]
    /// Each change's encoded object, kept only for multi-change revisions (which some
    /// subscribers see in part).
    @usableFromInline let encodedChanges: [[UInt8]]
    /// The length of the changes array at the end of `body`.
    private let changesLength: Int

    public init(repo: String, changeSet: ChangeSet<CanonicalJSON>, time: Int64) {
        self.repo = repo
        self.revision = changeSet.revision
        self.changes = changeSet.changes
        self.time = time
        let encoded = changeSet.changes.map(Self.encode)
        var body: [UInt8] = []
        body.reserveCapacity(encoded.reduce(repo.utf8.count + 48) { $0 + $1.count + 1 })
        EventEncoder.writeChangeBody(&body, repo: repo, rev: changeSet.revision, encodedChanges: encoded)
        self.body = body
        self.encodedChanges = encoded.count > 1 ? encoded : []
        self.changesLength = 2 + encoded.reduce(0) { $0 + $1.count } + max(0, encoded.count - 1)
    }

    /// The keys changed, in application order.
    public var keys: [Key] { changes.map(\.key) }

    /// The changes as a JSON array, `[{"key":…,"old":…,"new":…},…]` — the stored form.
    /// It is the tail of `body`, before the closing `}\n`.
    public var changesJSON: ArraySlice<UInt8> {
        body[(body.count - 2 - changesLength)..<(body.count - 2)]
    }

    /// Writes the change event of this revision for subscription `sub`, holding the
    /// changes `selected` picks.
    public func writeEvent<S: JSONSink>(_ sink: inout S, sub: UInt64, selected: SelectedChanges) {
        EventEncoder.writeChangeHead(&sink, sub: sub)
        writeEventBody(&sink, selected: selected)
    }

    /// Writes a change event minus its head (`{"event":"change","sub":N`, which the
    /// subscriber writes itself): the part every subscriber shares.
    @inlinable
    public func writeEventBody<S: JSONSink>(_ sink: inout S, selected: SelectedChanges) {
        switch selected {
        case .all:
            sink.writeRaw(body)
        case .some(let positions):
            EventEncoder.writeChangeBody(
                &sink, repo: repo, rev: revision, encodedChanges: positions.lazy.map { self.encodedChanges[$0] })
        }
    }

    private static func encode(_ change: Change<CanonicalJSON>) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 24)
        EventEncoder.writeChange(&out, change) { sink, value in sink.writeCanonical(value) }
        return out
    }
}
