// ObsStore — values as the daemon keeps them, and revisions as it delivers and stores them.
//
// A `StoredValue` is a JSON value together with its encoding, made once when the value
// is written: replies, events, snapshots and history then copy bytes instead of
// re-encoding. A `RevisionRecord` is one committed revision with its change event body
// pre-encoded, shared by every subscriber, the history and storage.

import ObsProtocol
import ObservableKit

/// A JSON value with its compact encoding.
public struct StoredValue: Sendable, Equatable {
    public let json: JSONValue
    public let bytes: [UInt8]

    public init(_ json: JSONValue) {
        self.json = json
        self.bytes = json.jsonBytes()
    }

    public init(json: JSONValue, bytes: [UInt8]) {
        self.json = json
        self.bytes = bytes
    }

    /// JSON equality — the contract's rule for "changes nothing".
    public static func == (lhs: StoredValue, rhs: StoredValue) -> Bool {
        lhs.bytes == rhs.bytes || lhs.json == rhs.json
    }
}

extension JSONSink {
    /// Writes a stored value's encoding.
    public mutating func writeStored(_ value: StoredValue) { writeRaw(value.bytes) }
}

/// One committed revision of a repository, ready to deliver and to store.
public final class RevisionRecord: Sendable {
    public let repo: String
    public let revision: UInt64
    public let changes: [Change<StoredValue>]
    /// When it was committed, in seconds since 1970 (for age-based history retention).
    public let time: Int64
    /// `,"repo":…,"rev":…,"changes":[…all…]}\n` — a change event minus its head.
    public let body: [UInt8]
    /// Each change's encoded object, kept only for multi-change revisions (which some
    /// subscribers see in part).
    let encodedChanges: [[UInt8]]
    /// The length of the changes array at the end of `body`.
    private let changesLength: Int

    public init(repo: String, changeSet: ChangeSet<StoredValue>, time: Int64) {
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
        switch selected {
        case .all:
            sink.writeRaw(body)
        case .some(let positions):
            EventEncoder.writeChangeBody(
                &sink, repo: repo, rev: revision, encodedChanges: positions.lazy.map { self.encodedChanges[$0] })
        }
    }

    private static func encode(_ change: Change<StoredValue>) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(change.key.utf8Count + (change.old?.bytes.count ?? 0) + (change.new?.bytes.count ?? 0) + 24)
        EventEncoder.writeChange(&out, change) { sink, value in sink.writeStored(value) }
        return out
    }
}
