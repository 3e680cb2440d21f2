// ObsProtocol — one operation of a write as the daemon's one write path takes it: a `set` or
// `delete` of one key read where its bytes lie — the request's line and the request
// scanner's buffer for what clients send (ScannedRequest.swift), an owned buffer otherwise
// (ObsCore's `WriteOps`). A single-key write is one of these; a batch, a buffer of them.

/// A `set` (`value` given) or `delete` (`value` nil) of one key, read in place: valid while the
/// bytes it points into are.
public struct RawWriteOp {
    /// The key's UTF-8 bytes (a valid key).
    public var key: UnsafeRawBufferPointer
    /// The new value's canonical encoding; nil: a `delete`.
    public var value: UnsafeRawBufferPointer?
    /// Whether the new value is plain (see `CanonicalJSON`).
    public var isPlain: Bool
    public var ifRevision: UInt64?
    public var force: Bool
    /// The lease a `set` names (nil: none — the key is attached to no lease after it).
    public var lease: UInt64?

    @inlinable
    public init(key: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer?, isPlain: Bool, ifRevision: UInt64?, force: Bool, lease: UInt64? = nil) {
        self.key = key
        self.value = value
        self.isPlain = isPlain
        self.ifRevision = ifRevision
        self.force = force
        self.lease = lease
    }
}
