// ObsClient — typed values: any `Codable` type read, written and watched as JSON values.
// Encoding and decoding go through the standard JSONEncoder/JSONDecoder (FoundationEssentials
// on Linux, no ICU); failures are errors that name the key and the type, never a silent nil.

#if canImport(FoundationEssentials)
import FoundationEssentials
#else
import Foundation
#endif
import ObsProtocol
import ObservableKit

extension JSONValue {
    /// The JSON value `value` encodes to.
    public init<T: Encodable>(encoding value: T) throws(ObsClientError) {
        let data: Data
        do {
            data = try JSONEncoder().encode(value)
        } catch {
            throw .unencodable(type: "\(T.self)", reason: "\(error)")
        }
        do {
            self = try data.withUnsafeBytes { bytes in try JSONParser.parse(bytes) }
        } catch {
            throw .unencodable(type: "\(T.self)", reason: "the encoder's output is not valid JSON: \(error)")
        }
    }

    /// This value decoded as `T`; `key` names the value in the error.
    public func decode<T: Decodable>(as type: T.Type = T.self, key: ObservableKit.Key? = nil) throws(ObsClientError) -> T {
        do {
            return try JSONDecoder().decode(T.self, from: Data(jsonBytes()))
        } catch {
            throw .undecodable(key: key, type: "\(T.self)", reason: Self.explain(error))
        }
    }

    private static func explain(_ error: any Error) -> String {
        guard let error = error as? DecodingError else { return "\(error)" }
        switch error {
        case .typeMismatch(_, let context), .valueNotFound(_, let context), .keyNotFound(_, let context), .dataCorrupted(let context):
            let path = context.codingPath.map { $0.intValue.map { "[\($0)]" } ?? ".\($0.stringValue)" }.joined()
            return path.isEmpty ? context.debugDescription : "\(path): \(context.debugDescription)"
        @unknown default:
            return "\(error)"
        }
    }
}

extension ObsConnection {
    /// The value of `key` in `repository` decoded as `T`, with its revision; nil if the key
    /// does not exist.
    public func get<T: Decodable>(_ key: Key, in repository: String, as type: T.Type) async throws(ObsClientError) -> Entry<T>? {
        guard let entry = try await get(key, in: repository) else { return nil }
        return Entry(value: try entry.value.decode(as: T.self, key: key), revision: entry.revision)
    }

    /// Sets `key` in `repository` to the JSON encoding of `value` (see `set(_:to:in:ifRevision:force:lease:)`).
    @discardableResult
    public func set<T: Encodable>(
        _ key: Key, to value: T, in repository: String, ifRevision: UInt64? = nil, force: Bool = false, lease: Lease.ID? = nil
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await set(key, to: try JSONValue(encoding: value), in: repository, ifRevision: ifRevision, force: force, lease: lease)
    }
}

extension ObsSession {
    /// The value of `key` in `repository` decoded as `T`, with its revision; nil if the key
    /// does not exist.
    public func get<T: Decodable>(_ key: Key, in repository: String, as type: T.Type) async throws(ObsClientError) -> Entry<T>? {
        try await connection().get(key, in: repository, as: type)
    }

    /// Sets `key` in `repository` to the JSON encoding of `value`.
    @discardableResult
    public func set<T: Encodable>(
        _ key: Key, to value: T, in repository: String, ifRevision: UInt64? = nil, force: Bool = false, lease: Lease.ID? = nil
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await connection().set(key, to: value, in: repository, ifRevision: ifRevision, force: force, lease: lease)
    }

    /// Watches `key` of `repository` as `T`, across reconnections: first its current value,
    /// then every change, each with the old and the new value (nil when the key does not exist).
    ///
    /// - Parameters:
    ///   - key: the key.
    ///   - repository: its repository.
    ///   - type: the type its values decode as; a value that does not ends the sequence
    ///     with `undecodable`.
    ///   - options: the subscription options (see ``SubscriptionOptions``): with
    ///     `coalesce`, a reader that lags gets the latest value rather than every one; with
    ///     `writers`, each change carries `by`.
    public func watch<T: Decodable & Sendable>(
        _ key: Key, in repository: String, as type: T.Type, options: SubscriptionOptions = .default
    ) -> TypedWatch<T> {
        TypedWatch(base: watch(repository, selecting: .keys([key]), initial: true, options: options), key: key)
    }
}

/// A key's value changing, as `T`.
public struct TypedChange<T: Sendable>: Sendable {
    /// The key.
    public let key: Key
    /// The repository revision of the change (or of the snapshot).
    public let revision: UInt64
    /// The value before (nil: the key did not exist); for a coalesced change, the value the
    /// watch last delivered.
    public let old: T?
    /// The value after (nil: the key does not exist).
    public let new: T?
    /// The key's state as first read, or re-read after a reconnection whose changes could
    /// not be replayed, rather than one change.
    public let isSnapshot: Bool
    /// Who wrote the change, when the watch asked for `writers` (nil for a snapshot).
    public let by: Writer?
    /// For a change coalesced from several revisions, the first of them; for a catch-up, the
    /// first revision it covers.
    public let from: UInt64?
    /// The key's changes since the watch's position, as one, after a reconnection past the
    /// daemon's history (a ``WatchEvent/catchUp(_:)`` that listed the key): `old` is the value
    /// the watch last delivered, `new` the value at `revision`.
    public let isCatchUp: Bool

    public init(
        key: Key, revision: UInt64, old: T?, new: T?, isSnapshot: Bool, by: Writer? = nil, from: UInt64? = nil, isCatchUp: Bool = false
    ) {
        self.key = key
        self.revision = revision
        self.old = old
        self.new = new
        self.isSnapshot = isSnapshot
        self.by = by
        self.from = from
        self.isCatchUp = isCatchUp
    }
}

/// One key's values as `T`, across reconnections (see `ObsSession.watch(_:in:as:options:)`).
/// A value that does not decode as `T` ends the sequence with `undecodable`.
public struct TypedWatch<T: Decodable & Sendable>: AsyncSequence, Sendable {
    public typealias Element = TypedChange<T>
    let base: Watch
    let key: Key

    /// Starts the watch: each iterator is its own subscription.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator(), key: key) }

    /// Iterates a typed watch.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: Watch.AsyncIterator
        let key: Key
        var current: T?
        /// The key's value as last delivered (nil: absent), to tell a catch-up that left it as
        /// it was.
        var currentJSON: JSONValue?

        init(base: Watch.AsyncIterator, key: Key) {
            self.base = base
            self.key = key
        }

        /// The next value of the key; throws `undecodable` for one that is not a `T`.
        public mutating func next() async throws -> TypedChange<T>? {
            while let event = try await base.next() {
                switch event {
                case .snapshot(let revision, let values, _):
                    let old = current
                    current = try values[key].map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
                    currentJSON = values[key]
                    return TypedChange(key: key, revision: revision, old: old, new: current, isSnapshot: true)
                case .change(let changes):
                    guard let change = changes.change(for: key) else { continue }
                    let old = try change.old.map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
                    current = try change.new.map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
                    currentJSON = change.new
                    return TypedChange(
                        key: key, revision: changes.revision, old: old, new: current, isSnapshot: false, by: changes.by,
                        from: changes.from)
                case .catchUp(let diff):
                    let value = diff.entries.first { $0.key == key }?.value
                    guard value != nil || diff.deleted.contains(key), value != currentJSON else { continue }
                    let old = current
                    current = try value.map { value throws(ObsClientError) in try value.decode(as: T.self, key: key) }
                    currentJSON = value
                    return TypedChange(
                        key: key, revision: diff.revision, old: old, new: current, isSnapshot: false, from: Swift.min(diff.from + 1, diff.revision),
                        isCatchUp: true)
                }
            }
            return nil
        }
    }
}
