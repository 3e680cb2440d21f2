// ObsEtcd: the values the etcd v3 client speaks in — key-values, compares, operations, their
// results, watch events and member status. Keys and values are bytes (`[UInt8]`), as in etcd;
// revisions are etcd's 64-bit signed integers.

/// One key's state in etcd (`mvccpb.KeyValue`).
public struct EtcdKeyValue: Sendable, Hashable {
    /// The key's bytes.
    public var key: [UInt8]
    /// The value's bytes (empty for a deleted key in a delete event).
    public var value: [UInt8]
    /// The revision of the key's creation (since it last did not exist).
    public var createRevision: Int64
    /// The revision of the key's last change.
    public var modRevision: Int64
    /// How many times the key changed since its creation (1 after the first put).
    public var version: Int64
    /// The lease the key is attached to, 0 for none.
    public var lease: Int64

    /// A key-value with its revisions.
    public init(key: [UInt8], value: [UInt8], createRevision: Int64, modRevision: Int64, version: Int64, lease: Int64 = 0) {
        self.key = key
        self.value = value
        self.createRevision = createRevision
        self.modRevision = modRevision
        self.version = version
        self.lease = lease
    }
}

/// Key helpers.
public enum EtcdKey {
    /// The `rangeEnd` that selects every key starting with `prefix` (etcd's `GetPrefixRangeEnd`):
    /// the prefix with its last byte below 0xff incremented and what follows dropped; `[0]`
    /// (every key) when the prefix is empty or all 0xff.
    public static func prefixEnd(_ prefix: [UInt8]) -> [UInt8] {
        var end = prefix
        while let last = end.last {
            if last < 0xff {
                end[end.count - 1] = last + 1
                return end
            }
            end.removeLast()
        }
        return [0]
    }

    /// The UTF-8 bytes of `string`.
    public static func bytes(_ string: String) -> [UInt8] { Array(string.utf8) }
}

/// A read of one key or a range (`RangeRequest`).
public struct EtcdRangeRequest: Sendable, Hashable {
    /// The key, or the first key of the range.
    public var key: [UInt8]
    /// nil: the key alone; `[0]`: every key from `key` on; otherwise up to, not including, this key.
    public var rangeEnd: [UInt8]?
    /// Read the state at this revision (nil: the latest). Compacted revisions fail with
    /// `EtcdError.compacted`.
    public var revision: Int64?
    /// Answered by the member from its own state without consulting the leader (may be stale,
    /// works without quorum); false: linearizable.
    public var serializable: Bool
    /// At most this many keys (nil: all).
    public var limit: Int64?
    /// Only keys, no values.
    public var keysOnly: Bool
    /// Only the count.
    public var countOnly: Bool

    /// A read; by default of one key, linearizable, at the latest revision, without limit.
    public init(
        key: [UInt8], rangeEnd: [UInt8]? = nil, revision: Int64? = nil, serializable: Bool = false, limit: Int64? = nil,
        keysOnly: Bool = false, countOnly: Bool = false
    ) {
        self.key = key
        self.rangeEnd = rangeEnd
        self.revision = revision
        self.serializable = serializable
        self.limit = limit
        self.keysOnly = keysOnly
        self.countOnly = countOnly
    }
}

/// The answer to a range.
public struct EtcdRangeResult: Sendable, Hashable {
    /// The keys found, in key order.
    public var kvs: [EtcdKeyValue]
    /// Whether `limit` cut the answer short.
    public var more: Bool
    /// How many keys the range holds (regardless of `limit`).
    public var count: Int64
    /// The store's revision when the member answered (the response header's).
    public var revision: Int64
}

/// A condition of a transaction (`Compare`): the key's value, version, mod or create revision
/// compared with a constant. A key that does not exist has version, create and mod revision 0
/// (and compares on its value are false).
public struct EtcdCompare: Sendable, Hashable {
    /// What to compare, and the constant to compare it with.
    public enum Target: Sendable, Hashable {
        /// The key's value (false for a missing key, whatever the operator).
        case value([UInt8])
        /// The key's version (0: missing).
        case version(Int64)
        /// The revision of the key's last change (0: missing).
        case modRevision(Int64)
        /// The revision of the key's creation (0: missing).
        case createRevision(Int64)
    }

    /// The comparison.
    public enum Operator: String, Sendable, Hashable {
        case equal = "EQUAL"
        case notEqual = "NOT_EQUAL"
        /// The key's side is greater than the constant.
        case greater = "GREATER"
        /// The key's side is less than the constant.
        case less = "LESS"
    }

    /// The key compared.
    public var key: [UInt8]
    /// Compare every key of a range (all must hold); nil: the key alone.
    public var rangeEnd: [UInt8]?
    /// How the key's side and the constant compare.
    public var op: Operator
    /// What is compared, and the constant.
    public var target: Target

    /// `key`'s `target` compared by `op` (`.init(key: k, .equal, .version(0))`: k is absent).
    public init(key: [UInt8], rangeEnd: [UInt8]? = nil, _ op: Operator, _ target: Target) {
        self.key = key
        self.rangeEnd = rangeEnd
        self.op = op
        self.target = target
    }

    /// `key`'s value compared with `value`.
    public static func value(_ key: [UInt8], _ op: Operator, _ value: [UInt8]) -> Self { .init(key: key, op, .value(value)) }
    /// `key`'s version compared with `version` (0: the key does not exist).
    public static func version(_ key: [UInt8], _ op: Operator, _ version: Int64) -> Self { .init(key: key, op, .version(version)) }
    /// `key`'s mod revision compared with `revision`.
    public static func modRevision(_ key: [UInt8], _ op: Operator, _ revision: Int64) -> Self {
        .init(key: key, op, .modRevision(revision))
    }
    /// `key`'s create revision compared with `revision`.
    public static func createRevision(_ key: [UInt8], _ op: Operator, _ revision: Int64) -> Self {
        .init(key: key, op, .createRevision(revision))
    }
}

/// One operation of a transaction (`RequestOp`).
public enum EtcdOp: Sendable, Hashable {
    /// Set `key` to `value`; `prevKV`: answer the key's previous state; `lease`: attach the
    /// key to that lease (etcd deletes it when the lease ends), 0 for none. A put of a key
    /// attached to a lease that does not exist fails the whole transaction (code 5, "requested
    /// lease not found").
    case put(key: [UInt8], value: [UInt8], prevKV: Bool = false, lease: Int64 = 0)
    /// Delete `key` (or the range up to `rangeEnd`); `prevKV`: answer the deleted keys.
    case deleteRange(key: [UInt8], rangeEnd: [UInt8]? = nil, prevKV: Bool = false)
    /// Read, at the transaction's revision. Its `revision` and `serializable` are ignored by etcd.
    case range(EtcdRangeRequest)
}

/// The result of one operation of a transaction (`ResponseOp`), in the order of the operations.
public enum EtcdOpResult: Sendable, Hashable {
    /// The key's state before the put, when asked for and the key existed.
    case put(prevKV: EtcdKeyValue?)
    /// How many keys were deleted, and their states when asked for.
    case deleteRange(deleted: Int64, prevKVs: [EtcdKeyValue])
    /// What a range operation read.
    case range(EtcdRangeResult)
}

/// The answer to a transaction.
public struct EtcdTxnResult: Sendable, Hashable {
    /// Whether every compare held (so `success` ran; otherwise `failure` did).
    public var succeeded: Bool
    /// One result per operation of the branch that ran.
    public var responses: [EtcdOpResult]
    /// The store's revision after the transaction: a transaction that wrote raises it by
    /// exactly 1, whatever the number of its puts and deletes; one that wrote nothing leaves it.
    public var revision: Int64
}

/// One change seen by a watch (`mvccpb.Event`).
public struct EtcdEvent: Sendable, Hashable {
    /// What happened to the key.
    public enum Kind: Sendable, Hashable {
        /// Created or changed (an identical value counts: etcd does not compare).
        case put
        /// Deleted.
        case delete
    }

    /// What happened.
    public var kind: Kind
    /// The key after the change. For a delete: the key, and `modRevision` the revision of the
    /// delete; the value is empty.
    public var kv: EtcdKeyValue
    /// The key before the change, when the watch asked for it (`prevKV`) and etcd still had it:
    /// etcd leaves it out, silently, when the previous revision is compacted, and for a key
    /// that did not exist.
    public var prevKV: EtcdKeyValue?

    /// An event.
    public init(kind: Kind, kv: EtcdKeyValue, prevKV: EtcdKeyValue?) {
        self.kind = kind
        self.kv = kv
        self.prevKV = prevKV
    }
}

/// What a watch delivers: the events of exactly one revision, or a progress report.
public struct EtcdWatchResponse: Sendable, Hashable {
    /// For events: their revision (every event's `kv.modRevision`). For progress: the member's
    /// revision when it answered (see ``EtcdWatch`` for what that does and does not promise).
    public var revision: Int64
    /// The events of `revision`, in the order etcd applied them (empty for progress).
    public var events: [EtcdEvent]
    /// A progress report, not a change.
    public var isProgress: Bool { events.isEmpty }

    /// The events of one revision, or a progress report when `events` is empty.
    public init(revision: Int64, events: [EtcdEvent]) {
        self.revision = revision
        self.events = events
    }
}

/// A member's view of the cluster (`StatusResponse`): what health checks need.
public struct EtcdStatus: Sendable, Hashable {
    /// Which endpoint answered (index into the client's endpoints).
    public var endpoint: Int
    /// The etcd version of the member.
    public var version: String
    /// The member's ID.
    public var memberID: UInt64
    /// The leader's ID as the member knows it; 0: the member knows no leader.
    public var leader: UInt64
    /// The current raft term (it rises with every election).
    public var raftTerm: UInt64
    /// The raft log's last index at the member.
    public var raftIndex: UInt64
    /// The last index the member applied.
    public var raftAppliedIndex: UInt64
    /// The store's revision at the member.
    public var revision: Int64
    /// The size of the member's database file in bytes.
    public var dbSize: Int64
    /// Alarms and conditions the member reports, e.g. "etcdserver: no leader".
    public var errors: [String]
    /// Whether this member is the leader.
    public var isLeader: Bool { leader != 0 && leader == memberID }
}
