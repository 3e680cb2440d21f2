// ObsCore — a write's operations owning their bytes (`WriteOps`), for what must wait or was
// built from values — a shared store's writes, the general decoder's requests, a lease's end —
// read as the one write path takes every write: ObsProtocol's `RawWriteOp`s, in place.
// A single-key write and a batch of ten thousand are the same thing here: a buffer of ops.

import ObsProtocol
import ObsStore
import ObsValues
import ObservableKit

/// A write's operations owning their bytes: keys and canonical values in one buffer.
public struct WriteOps: Sendable {
    private var bytes: [UInt8] = []
    private var ops: [(key: Range<Int>, value: Range<Int>?, isPlain: Bool, ifRevision: UInt64?, force: Bool, lease: UInt64?)] = []

    public init() {}

    /// `ops` as the protocol's values; each `set` attached to `leases[i]` (empty: none).
    public init(_ ops: [WriteOp<CanonicalJSON>], leases: [UInt64?] = []) {
        self.ops.reserveCapacity(ops.count)
        for (i, op) in ops.enumerated() {
            switch op {
            case .set(let key, let value, let ifRevision, let force):
                append(key: key, value: value, ifRevision: ifRevision, force: force, lease: i < leases.count ? leases[i] : nil)
            case .delete(let key, let ifRevision):
                append(key: key, value: nil, ifRevision: ifRevision, force: false, lease: nil)
            }
        }
    }

    /// A copy of `ops` (a write that must outlive the bytes it was read from).
    public init(copying ops: UnsafeBufferPointer<RawWriteOp>) {
        self.ops.reserveCapacity(ops.count)
        bytes.reserveCapacity(ops.reduce(0) { $0 + $1.key.count + ($1.value?.count ?? 0) })
        for op in ops {
            let keyStart = bytes.count
            bytes.append(contentsOf: op.key)
            var valueRange: Range<Int>? = nil
            if let value = op.value {
                let start = bytes.count
                bytes.append(contentsOf: value)
                valueRange = start..<bytes.count
            }
            self.ops.append((keyStart..<(keyStart + op.key.count), valueRange, op.isPlain, op.ifRevision, op.force, op.lease))
        }
    }

    /// Deletes of `keys`.
    public init(deleting keys: [Key]) {
        ops.reserveCapacity(keys.count)
        for key in keys { append(key: key, value: nil, ifRevision: nil, force: false, lease: nil) }
    }

    public var count: Int { ops.count }

    /// The leases its `set`s name.
    public var leases: Set<UInt64> { Set(ops.compactMap { $0.value == nil ? nil : $0.lease }) }

    /// Appends an operation (`value` nil: a delete).
    public mutating func append(key: Key, value: CanonicalJSON?, ifRevision: UInt64?, force: Bool, lease: UInt64?) {
        let keyStart = bytes.count
        bytes.append(contentsOf: key.string.utf8)
        let keyRange = keyStart..<bytes.count
        var valueRange: Range<Int>? = nil
        if let value {
            let start = bytes.count
            bytes.append(contentsOf: value.bytes)
            valueRange = start..<bytes.count
        }
        ops.append((keyRange, valueRange, value?.isPlain ?? true, ifRevision, force, lease))
    }

    /// Calls `body` with the operations read in place.
    public func withRawOps<R, E: Error>(_ body: (UnsafeBufferPointer<RawWriteOp>) throws(E) -> R) throws(E) -> R {
        try bytes.withUnsafeBytes { raw in
            withUnsafeTemporaryAllocation(of: RawWriteOp.self, capacity: max(1, ops.count)) { buffer in
                for (i, op) in ops.enumerated() {
                    buffer.initializeElement(
                        at: i,
                        to: RawWriteOp(
                            key: UnsafeRawBufferPointer(rebasing: raw[op.key]), value: op.value.map { UnsafeRawBufferPointer(rebasing: raw[$0]) },
                            isPlain: op.isPlain, ifRevision: op.ifRevision, force: op.force, lease: op.lease))
                }
                defer { buffer.baseAddress!.deinitialize(count: ops.count) }
                return Result { () throws(E) -> R in try body(UnsafeBufferPointer(rebasing: buffer[..<ops.count])) }
            }
        }.get()
    }
}

/// What the write rules decided for one operation (`FlatState.plan`), read in place: valid
/// until the state is mutated.
public struct OpPlan {
    /// Whether it changes its key (else it leaves the state as it is).
    public var changes: Bool
    /// The key's value before the write (nil: absent), where the table holds it.
    public var old: UnsafeRawBufferPointer?
    public var oldIsPlain: Bool
    /// The key's revision before the write (0: absent).
    public var oldRevision: UInt64
    /// Where the key lies in the table (or would): a write of one key installs it there.
    var position: FlatTable.Position
}

/// Memory for the plans of a write's operations (`OpPlan` is trivial: plans are written in
/// place, never deinitialized): kept and reused by its owner — a write allocates nothing for
/// its plans.
public struct OpPlanBuffer: ~Copyable {
    private var base: UnsafeMutablePointer<OpPlan>
    private var capacity: Int

    public init(capacity: Int = 8) {
        self.capacity = max(1, capacity)
        base = .allocate(capacity: self.capacity)
    }

    deinit { base.deallocate() }

    /// Room for the plans of `count` operations (valid until the next call).
    public mutating func room(for count: Int) -> UnsafeMutableBufferPointer<OpPlan> {
        if count > capacity {
            base.deallocate()
            capacity = max(count, capacity * 2)
            base = .allocate(capacity: capacity)
        }
        return UnsafeMutableBufferPointer(start: base, count: count)
    }
}
