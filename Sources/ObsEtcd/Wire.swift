// ObsEtcd: etcd's JSON gateway format (grpc-gateway's jsonpb of etcd's protobuf messages) —
// bytes as base64 strings, 64-bit integers as decimal strings, fields at their zero value
// left out (so `succeeded: false`, `count: 0`, a PUT event's `type` are absent).
// Encoding and decoding go through the standard JSONEncoder/JSONDecoder (FoundationEssentials
// where available: no full Foundation in the daemon).

#if canImport(FoundationEssentials)
import FoundationEssentials
#else
import Foundation
#endif

// MARK: - Scalars

/// A 64-bit integer as jsonpb writes it (a string) or as a number.
struct WireInt: Codable, Sendable {
    var value: Int64

    init(_ value: Int64) { self.value = value }

    init(from decoder: any Decoder) throws {
        let c = try decoder.singleValueContainer()
        if let s = try? c.decode(String.self) {
            if let v = Int64(s) {
                value = v
            } else if let v = UInt64(s) {
                value = Int64(bitPattern: v)  // uint64 IDs beyond Int64.max keep their bits
            } else {
                throw DecodingError.dataCorruptedError(in: c, debugDescription: "not an integer: \(s)")
            }
        } else {
            value = try c.decode(Int64.self)
        }
    }

    func encode(to encoder: any Encoder) throws {
        var c = encoder.singleValueContainer()
        try c.encode(String(value))
    }
}

/// Bytes as a base64 string.
struct WireBytes: Codable, Sendable {
    var bytes: [UInt8]

    init(_ bytes: [UInt8]) { self.bytes = bytes }

    init(from decoder: any Decoder) throws {
        let c = try decoder.singleValueContainer()
        let s = try c.decode(String.self)
        guard let data = Data(base64Encoded: s) else {
            throw DecodingError.dataCorruptedError(in: c, debugDescription: "not base64")
        }
        bytes = [UInt8](data)
    }

    func encode(to encoder: any Encoder) throws {
        var c = encoder.singleValueContainer()
        try c.encode(Data(bytes).base64EncodedString())
    }
}

extension Optional where Wrapped == WireInt {
    var int64: Int64 { self?.value ?? 0 }
    var uint64: UInt64 { UInt64(bitPattern: self?.value ?? 0) }
}

// MARK: - Requests

struct WireRangeRequest: Encodable {
    var key: WireBytes
    var range_end: WireBytes?
    var limit: WireInt?
    var revision: WireInt?
    var serializable: Bool?
    var keys_only: Bool?
    var count_only: Bool?

    init(_ r: EtcdRangeRequest) {
        key = WireBytes(r.key)
        range_end = r.rangeEnd.map(WireBytes.init)
        limit = r.limit.map(WireInt.init)
        revision = r.revision.map(WireInt.init)
        serializable = r.serializable ? true : nil
        keys_only = r.keysOnly ? true : nil
        count_only = r.countOnly ? true : nil
    }
}

struct WirePutRequest: Encodable {
    var key: WireBytes
    var value: WireBytes
    var prev_kv: Bool?
    var lease: WireInt?
}

struct WireDeleteRangeRequest: Encodable {
    var key: WireBytes
    var range_end: WireBytes?
    var prev_kv: Bool?
}

struct WireRequestOp: Encodable {
    var request_range: WireRangeRequest?
    var request_put: WirePutRequest?
    var request_delete_range: WireDeleteRangeRequest?

    init(_ op: EtcdOp) {
        switch op {
        case .put(let key, let value, let prevKV, let lease):
            request_put = WirePutRequest(
                key: WireBytes(key), value: WireBytes(value), prev_kv: prevKV ? true : nil, lease: lease != 0 ? WireInt(lease) : nil)
        case .deleteRange(let key, let rangeEnd, let prevKV):
            request_delete_range = WireDeleteRangeRequest(
                key: WireBytes(key), range_end: rangeEnd.map(WireBytes.init), prev_kv: prevKV ? true : nil)
        case .range(let r):
            var request = WireRangeRequest(r)
            request.revision = nil
            request.serializable = nil
            request_range = request
        }
    }
}

struct WireCompare: Encodable {
    var key: WireBytes
    var range_end: WireBytes?
    var result: String
    var target: String
    var value: WireBytes?
    var version: WireInt?
    var mod_revision: WireInt?
    var create_revision: WireInt?

    init(_ c: EtcdCompare) {
        key = WireBytes(c.key)
        range_end = c.rangeEnd.map(WireBytes.init)
        result = c.op.rawValue
        switch c.target {
        case .value(let v):
            target = "VALUE"
            value = WireBytes(v)
        case .version(let v):
            target = "VERSION"
            version = WireInt(v)
        case .modRevision(let v):
            target = "MOD"
            mod_revision = WireInt(v)
        case .createRevision(let v):
            target = "CREATE"
            create_revision = WireInt(v)
        }
    }
}

struct WireTxnRequest: Encodable {
    var compare: [WireCompare]
    var success: [WireRequestOp]
    var failure: [WireRequestOp]
}

struct WireCompactionRequest: Encodable {
    var revision: WireInt
    var physical: Bool?
}

struct WireEmpty: Encodable {}

struct WireWatchCreateRequest: Encodable {
    var key: WireBytes
    var range_end: WireBytes?
    var start_revision: WireInt?
    var progress_notify: Bool?
    var prev_kv: Bool?
}

/// One message on a watch stream's request body.
struct WireWatchRequest: Encodable {
    var create_request: WireWatchCreateRequest?
    var progress_request: WireEmpty?
}

// MARK: - Responses

struct WireHeader: Decodable {
    var cluster_id: WireInt?
    var member_id: WireInt?
    var revision: WireInt?
    var raft_term: WireInt?
}

struct WireKeyValue: Decodable {
    var key: WireBytes?
    var create_revision: WireInt?
    var mod_revision: WireInt?
    var version: WireInt?
    var value: WireBytes?
    var lease: WireInt?

    var kv: EtcdKeyValue {
        EtcdKeyValue(
            key: key?.bytes ?? [], value: value?.bytes ?? [], createRevision: create_revision.int64,
            modRevision: mod_revision.int64, version: version.int64, lease: lease.int64)
    }
}

struct WireRangeResponse: Decodable {
    var header: WireHeader?
    var kvs: [WireKeyValue]?
    var more: Bool?
    var count: WireInt?

    func result(headerRevision: Int64? = nil) -> EtcdRangeResult {
        EtcdRangeResult(
            kvs: (kvs ?? []).map(\.kv), more: more ?? false, count: count.int64,
            revision: headerRevision ?? header?.revision.int64 ?? 0)
    }
}

struct WirePutResponse: Decodable {
    var header: WireHeader?
    var prev_kv: WireKeyValue?
}

struct WireDeleteRangeResponse: Decodable {
    var header: WireHeader?
    var deleted: WireInt?
    var prev_kvs: [WireKeyValue]?
}

struct WireResponseOp: Decodable {
    var response_range: WireRangeResponse?
    var response_put: WirePutResponse?
    var response_delete_range: WireDeleteRangeResponse?
}

struct WireTxnResponse: Decodable {
    var header: WireHeader?
    var succeeded: Bool?
    var responses: [WireResponseOp]?

    func result() throws -> EtcdTxnResult {
        let revision = header?.revision.int64 ?? 0
        let ops = try (responses ?? []).map { op -> EtcdOpResult in
            if let put = op.response_put { return .put(prevKV: put.prev_kv?.kv) }
            if let del = op.response_delete_range {
                return .deleteRange(deleted: del.deleted.int64, prevKVs: (del.prev_kvs ?? []).map(\.kv))
            }
            if let range = op.response_range { return .range(range.result(headerRevision: revision)) }
            throw EtcdError.invalidResponse("a txn response operation of an unknown kind")
        }
        return EtcdTxnResult(succeeded: succeeded ?? false, responses: ops, revision: revision)
    }
}

struct WireCompactionResponse: Decodable {
    var header: WireHeader?
}

struct WireStatusResponse: Decodable {
    var header: WireHeader?
    var version: String?
    var dbSize: WireInt?
    var leader: WireInt?
    var raftIndex: WireInt?
    var raftTerm: WireInt?
    var raftAppliedIndex: WireInt?
    var errors: [String]?
}

struct WireEvent: Decodable {
    /// "DELETE" (or 1); absent for PUT.
    var type: EventType?
    var kv: WireKeyValue?
    var prev_kv: WireKeyValue?

    struct EventType: Decodable {
        var isDelete: Bool

        init(from decoder: any Decoder) throws {
            let c = try decoder.singleValueContainer()
            if let s = try? c.decode(String.self) {
                isDelete = s == "DELETE"
            } else {
                isDelete = try c.decode(Int.self) == 1
            }
        }
    }

    var event: EtcdEvent {
        EtcdEvent(kind: type?.isDelete == true ? .delete : .put, kv: kv?.kv ?? EtcdKeyValue(key: [], value: [], createRevision: 0, modRevision: 0, version: 0), prevKV: prev_kv?.kv)
    }
}

struct WireWatchResponse: Decodable {
    var header: WireHeader?
    var watch_id: WireInt?
    var created: Bool?
    var canceled: Bool?
    var compact_revision: WireInt?
    var cancel_reason: String?
    var events: [WireEvent]?
}

/// An error in the gateway's streaming form: `{"error": {"grpc_code", "http_code", "message"}}`.
struct WireStreamError: Decodable {
    var grpc_code: Int?
    var http_code: Int?
    var message: String?
}

/// One line of a watch stream.
struct WireWatchLine: Decodable {
    var result: WireWatchResponse?
    var error: WireStreamError?
}

/// A unary error answer: `{"error": "...", "message": "...", "code": N}`. A failure after
/// the gateway began a streamed answer uses the streaming form instead.
struct WireUnaryError: Decodable {
    var message: String?
    var code: Int?
    var streamError: WireStreamError?

    enum CodingKeys: String, CodingKey { case error, message, code }

    init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        message = try? c.decodeIfPresent(String.self, forKey: .message)
        code = try? c.decodeIfPresent(Int.self, forKey: .code)
        streamError = try? c.decodeIfPresent(WireStreamError.self, forKey: .error)
        if message == nil { message = (try? c.decodeIfPresent(String.self, forKey: .error)) ?? streamError?.message }
        if code == nil { code = streamError?.grpc_code }
    }
}

// MARK: - Coding

enum WireCoding {
    static func encode(_ value: some Encodable) throws -> [UInt8] {
        do {
            return Array(try JSONEncoder().encode(value))
        } catch {
            throw EtcdError.invalidResponse("cannot encode a request: \(error)")
        }
    }

    static func decode<T: Decodable>(_ type: T.Type, from bytes: some Collection<UInt8>) throws -> T {
        do {
            return try JSONDecoder().decode(type, from: Data(bytes))
        } catch {
            let text = String(decoding: bytes.prefix(200), as: UTF8.self)
            throw EtcdError.invalidResponse("\(T.self): \(error) in \(text)")
        }
    }
}
