// ObsClient — the spellings of the previous release, kept for one more as deprecated forwards:
// code written against them builds, with a warning that names what to write instead. Each
// forwards to the new API and adds nothing. (Error enum cases have no forward: the error is
// now a struct with a `code`; see ObsClientError.swift.)

import ObsProtocol
import ObservableKit

@available(*, deprecated, renamed: "ObsConnection")
public typealias ObsClient = ObsConnection

@available(*, deprecated, renamed: "RemoteWriteResult")
public typealias WriteResult = RemoteWriteResult

@available(*, deprecated, renamed: "HelloReply")
public typealias ServerInfo = HelloReply

@available(*, deprecated, renamed: "ListReply")
public typealias Listing = ListReply<JSONValue>

extension ObsConnection {
    @available(*, deprecated, renamed: "get(_:in:)")
    public func get(_ repo: String, _ key: Key) async throws(ObsClientError) -> Entry<JSONValue>? {
        try await get(key, in: repo)
    }

    @available(*, deprecated, renamed: "get(_:in:as:)")
    public func get<T: Decodable>(_ repo: String, _ key: Key, as type: T.Type) async throws(ObsClientError) -> Entry<T>? {
        try await get(key, in: repo, as: type)
    }

    @available(*, deprecated, renamed: "set(_:to:in:ifRevision:force:lease:)")
    @discardableResult
    public func set(
        _ repo: String, _ key: Key, _ value: JSONValue, ifRev: UInt64? = nil, force: Bool = false
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await set(key, to: value, in: repo, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "set(_:to:in:ifRevision:force:lease:)")
    @discardableResult
    public func set<T: Encodable>(
        _ repo: String, _ key: Key, encoding value: T, ifRev: UInt64? = nil, force: Bool = false
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await set(key, to: value, in: repo, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "delete(_:in:ifRevision:)")
    @discardableResult
    public func delete(_ repo: String, _ key: Key, ifRev: UInt64? = nil) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await delete(key, in: repo, ifRevision: ifRev)
    }

    @available(*, deprecated, renamed: "apply(_:in:)")
    @discardableResult
    public func batch(_ repo: String, _ ops: [WriteOp<JSONValue>]) async throws(ObsClientError) -> BatchReply {
        try await apply(ops, in: repo)
    }

    @available(*, deprecated, renamed: "list(_:prefix:includingValues:)")
    public func list(_ repo: String, prefix: String? = nil, values: Bool) async throws(ObsClientError) -> ListReply<JSONValue> {
        try await list(repo, prefix: prefix, includingValues: values)
    }

    @available(*, deprecated, renamed: "repositories()")
    public func repos() async throws(ObsClientError) -> [RepositoryInfo] {
        try await repositories()
    }

    /// The `stats` reply's members as sent; `statistics()` reads them as `Stats`.
    @available(*, deprecated, renamed: "statistics()")
    public func stats() async throws(ObsClientError) -> JSONObject {
        try await call(.stats)
    }

    @available(*, deprecated, renamed: "subscribe(to:selecting:initial:since:epoch:once:options:)")
    public func subscribe(
        _ repo: String, _ selection: Selection = .all, initial: Bool = false, since: UInt64? = nil, epoch: String? = nil,
        once: Bool = false, options: SubscriptionOptions = .default
    ) async throws(ObsClientError) -> Subscription {
        try await subscribe(to: repo, selecting: selection, initial: initial, since: since, epoch: epoch, once: once, options: options)
    }
}

extension ObsSession {
    @available(*, deprecated, renamed: "connection()")
    public func client() async throws(ObsClientError) -> ObsConnection { try await connection() }

    @available(*, deprecated, renamed: "get(_:in:)")
    public func get(_ repo: String, _ key: Key) async throws(ObsClientError) -> Entry<JSONValue>? {
        try await get(key, in: repo)
    }

    @available(*, deprecated, renamed: "get(_:in:as:)")
    public func get<T: Decodable>(_ repo: String, _ key: Key, as type: T.Type) async throws(ObsClientError) -> Entry<T>? {
        try await get(key, in: repo, as: type)
    }

    @available(*, deprecated, renamed: "set(_:to:in:ifRevision:force:lease:)")
    @discardableResult
    public func set(
        _ repo: String, _ key: Key, _ value: JSONValue, ifRev: UInt64? = nil, force: Bool = false
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await set(key, to: value, in: repo, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "set(_:to:in:ifRevision:force:lease:)")
    @discardableResult
    public func set<T: Encodable>(
        _ repo: String, _ key: Key, encoding value: T, ifRev: UInt64? = nil, force: Bool = false
    ) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await set(key, to: value, in: repo, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "delete(_:in:ifRevision:)")
    @discardableResult
    public func delete(_ repo: String, _ key: Key, ifRev: UInt64? = nil) async throws(ObsClientError) -> WriteReply<JSONValue> {
        try await delete(key, in: repo, ifRevision: ifRev)
    }

    @available(*, deprecated, renamed: "apply(_:in:)")
    @discardableResult
    public func batch(_ repo: String, _ ops: [WriteOp<JSONValue>]) async throws(ObsClientError) -> BatchReply {
        try await apply(ops, in: repo)
    }

    @available(*, deprecated, renamed: "watch(_:selecting:initial:since:epoch:options:)")
    public func watch(
        _ repo: String, _ selection: Selection, initial: Bool = false, since: UInt64? = nil, epoch: String? = nil,
        options: SubscriptionOptions = .default
    ) -> Watch {
        watch(repo, selecting: selection, initial: initial, since: since, epoch: epoch, options: options)
    }

    @available(*, deprecated, renamed: "watch(_:in:as:options:)")
    public func watch<T: Decodable & Sendable>(
        _ repo: String, key: Key, as type: T.Type, options: SubscriptionOptions = .default
    ) -> TypedWatch<T> {
        watch(key, in: repo, as: type, options: options)
    }
}

extension RemoteRepository {
    @available(*, deprecated, renamed: "set(_:to:ifRevision:force:)")
    @discardableResult
    public func set(_ key: Key, _ value: JSONValue, ifRev: UInt64? = nil, force: Bool = false) async throws(ObsClientError) -> RemoteWriteResult {
        try await set(key, to: value, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "set(_:to:ifRevision:force:)")
    @discardableResult
    public func set<T: Encodable>(_ key: Key, encoding value: T, ifRev: UInt64? = nil) async throws(ObsClientError) -> RemoteWriteResult {
        try await set(key, to: value, ifRevision: ifRev)
    }

    @available(*, deprecated, renamed: "delete(_:ifRevision:)")
    @discardableResult
    public func delete(_ key: Key, ifRev: UInt64?) async throws(ObsClientError) -> RemoteWriteResult {
        try await delete(key, ifRevision: ifRev)
    }
}

extension RemoteValue {
    @available(*, deprecated, renamed: "init(_:in:as:options:session:)")
    public convenience init(
        _ repository: String, _ key: Key, as type: Value.Type = Value.self, options: SubscriptionOptions = .mirror, session: ObsSession
    ) {
        self.init(key, in: repository, as: type, options: options, session: session)
    }

    @available(*, deprecated, renamed: "set(_:ifRevision:force:)")
    @discardableResult
    public func set(_ value: Value, ifRev: UInt64?, force: Bool = false) async throws(ObsClientError) -> RemoteWriteResult {
        try await set(value, ifRevision: ifRev, force: force)
    }

    @available(*, deprecated, renamed: "delete(ifRevision:)")
    @discardableResult
    public func delete(ifRev: UInt64?) async throws(ObsClientError) -> RemoteWriteResult {
        try await delete(ifRevision: ifRev)
    }
}
