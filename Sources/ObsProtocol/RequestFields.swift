// ObsProtocol — a request's fields, read with the precise `bad_request` for every way one
// can be wrong: missing, ill-typed or invalid, named in the message (inside a batch,
// prefixed `ops[i]:`). `null` in an optional field means "absent". (The one other code: a
// `sync` of a subscription number no subscription can have is `not_found`.)

import ObservableKit

/// Typed access to a request's fields, producing `bad_request` failures that name the field.
struct RequestFields {
    let object: JSONObject
    let id: JSONValue
    /// Where the canonical values are (a `null` placeholder stands for them in `object`).
    let document: RequestDocument
    /// Prepended to messages, e.g. `ops[2]: `.
    var context = ""
    /// Inside `ops`: the element's position.
    var element: Int? = nil

    func fail(_ message: String) -> RequestFailure {
        RequestFailure(id: id, .badRequest, context + message)
    }

    func value(_ name: String) -> JSONValue? {
        guard let v = object[name], !v.isNull else { return nil }
        return v
    }

    func required(_ name: String) throws(RequestFailure) -> JSONValue {
        guard let v = object[name] else { throw fail("missing field \"\(name)\"") }
        return v
    }

    /// The `value` member, canonical.
    func value() throws(RequestFailure) -> CanonicalJSON {
        let captured = element.map { document.opValues.indices.contains($0) ? document.opValues[$0] : nil } ?? document.value
        guard object["value"] != nil, let captured else { throw fail("missing field \"value\"") }
        return captured
    }

    func optionalString(_ name: String) throws(RequestFailure) -> String? {
        guard let v = value(name) else { return nil }
        guard case .string(let s) = v else { throw fail("field \"\(name)\" must be a string, not \(v.typeName)") }
        return s
    }

    func optionalBool(_ name: String) throws(RequestFailure) -> Bool? {
        guard let v = value(name) else { return nil }
        guard case .bool(let b) = v else { throw fail("field \"\(name)\" must be a boolean, not \(v.typeName)") }
        return b
    }

    func optionalInt(_ name: String) throws(RequestFailure) -> Int64? {
        guard let v = value(name) else { return nil }
        guard let i = v.int64Value else { throw fail("field \"\(name)\" must be an integer, not \(v.jsonText.prefix(40))") }
        return i
    }

    /// A revision or subscription number: a non-negative integer below 2^64, read from its
    /// literal as written (UnsignedLiteral.swift).
    func optionalRevision(_ name: String) throws(RequestFailure) -> UInt64? {
        guard let v = value(name) else { return nil }
        guard let u = unsigned(name, v) else {
            throw fail("field \"\(name)\" must be a non-negative integer below 2^64, not \(written(name, v))")
        }
        return u
    }

    /// The literal member `name` was written with, when it is an unsigned field given a number
    /// in the line (a request decoded from a tree has none).
    private func literal(_ name: String) -> UnsignedLiteral? {
        guard let element else { return document.unsigned[name] }
        return document.opUnsigned.indices.contains(element) ? document.opUnsigned[element][name] : nil
    }

    /// The value `v` of member `name` as an integer in 0…2^64−1: exactly as written in the
    /// line, else (a tree) as the number it holds.
    private func unsigned(_ name: String, _ v: JSONValue) -> UInt64? {
        if let literal = literal(name) { return literal.value }
        return v.uint64Value
    }

    /// Member `name`'s value `v` for a message: a number as written.
    private func written(_ name: String, _ v: JSONValue) -> Substring {
        (literal(name)?.text ?? v.jsonText).prefix(40)
    }

    func repo() throws(RequestFailure) -> String {
        guard let v = value("repo") else { throw fail("missing field \"repo\"") }
        guard case .string(let name) = v else { throw fail("field \"repo\" must be a string, not \(v.typeName)") }
        guard ProtocolRules.isValidRepoName(name) else {
            throw fail(
                "invalid repository name \(JSONValue.string(String(name.prefix(140))).jsonText): use 1–\(ProtocolRules.maxRepoNameLength) characters of A-Z a-z 0-9 . _ -")
        }
        return name
    }

    func key(_ name: String = "key") throws(RequestFailure) -> Key {
        guard let v = value(name) else { throw fail("missing field \"\(name)\"") }
        return try Self.key(v, field: name, fail: fail)
    }

    static func key(_ v: JSONValue, field: String, fail: (String) -> RequestFailure) throws(RequestFailure) -> Key {
        guard case .string(let s) = v else { throw fail("field \"\(field)\" must be a string, not \(v.typeName)") }
        if let problem = ProtocolRules.keyProblem(s) { throw fail(problem) }
        return Key(s)
    }

    /// The operations of a batch, and the lease each `set` among them names, by key.
    func batchOps() throws(RequestFailure) -> (ops: [WriteOp<CanonicalJSON>], leases: [Key: UInt64]) {
        guard let v = value("ops") else { throw fail("missing field \"ops\"") }
        guard case .array(let elements) = v else { throw fail("field \"ops\" must be an array, not \(v.typeName)") }
        var ops: [WriteOp<CanonicalJSON>] = []
        ops.reserveCapacity(elements.count)
        var seen = Set<Key>(minimumCapacity: elements.count)
        var leases: [Key: UInt64] = [:]
        for (i, element) in elements.enumerated() {
            guard case .object(let o) = element else {
                throw fail("ops[\(i)] must be an object, not \(element.typeName)")
            }
            let f = RequestFields(object: o, id: id, document: document, context: "ops[\(i)]: ", element: i)
            guard let opValue = f.value("op") else { throw f.fail("missing field \"op\"") }
            guard case .string(let op) = opValue else { throw f.fail("field \"op\" must be a string, not \(opValue.typeName)") }
            let key = try f.key()
            guard seen.insert(key).inserted else {
                throw f.fail("key \(key.debugDescription) appears more than once in the batch")
            }
            switch op {
            case "set":
                ops.append(
                    .set(key, try f.value(), ifRevision: try f.optionalRevision("ifRev"), force: try f.optionalBool("force") ?? false))
                leases[key] = try f.optionalLease("lease")
            case "delete":
                ops.append(.delete(key, ifRevision: try f.optionalRevision("ifRev")))
            default:
                throw f.fail("op must be \"set\" or \"delete\" inside a batch, not \(JSONValue.string(op).jsonText)")
            }
        }
        return (ops, leases)
    }

    func subscribe() throws(RequestFailure) -> SubscribeRequest {
        let repo = try repo()
        let keysValue = value("keys")
        let prefix = try optionalString("prefix")
        var selection = Selection.all
        if let keysValue {
            if prefix != nil { throw fail("use at most one of \"keys\" and \"prefix\"") }
            guard case .array(let elements) = keysValue else {
                throw fail("field \"keys\" must be an array of strings, not \(keysValue.typeName)")
            }
            var keys = Set<Key>(minimumCapacity: elements.count)
            for (i, e) in elements.enumerated() {
                keys.insert(try Self.key(e, field: "keys[\(i)]", fail: fail))
            }
            selection = .keys(keys)
        } else if let prefix {
            selection = prefix.isEmpty ? .all : .prefix(prefix)
        }
        let initial = try optionalBool("initial") ?? false
        let since = try optionalRevision("since")
        if initial && since != nil {
            throw fail("\"since\" and \"initial\" cannot be used together: resume with since, or start over with initial")
        }
        // `epoch` is read only with `since` (without it, it has no meaning and is ignored).
        let epoch = since == nil ? nil : try optionalString("epoch")
        let once = try optionalBool("once") ?? false
        let coalesce = try optionalBool("coalesce") ?? false
        if once && coalesce {
            throw fail("\"coalesce\" and \"once\" cannot be used together: a once subscription ends at its first change, there is nothing to coalesce")
        }
        // `catchup: false` is the same as leaving it out.
        let catchup = try optionalBool("catchup") ?? false
        if catchup && since == nil {
            throw fail("\"catchup\" goes with \"since\": it says how to resume after that revision when the history no longer reaches back")
        }
        if catchup && once {
            throw fail("\"catchup\" and \"once\" cannot be used together: a once subscription ends at its first change, and a catch-up is not one")
        }
        return SubscribeRequest(
            repo: repo, selection: selection, initial: initial, since: since, epoch: epoch, once: once, coalesce: coalesce,
            writers: try optionalBool("writers") ?? false, echo: try optionalBool("echo") ?? true,
            progress: try optionalBool("progress") ?? false, catchup: catchup)
    }

    /// The `sub` of a `sync`: an integer (`1.0` is one). Missing, `null` or not an integer is
    /// `bad_request`; an integer no subscription can have (below 0, or above 2^64 − 1) is
    /// `not_found`, as the daemon answers for an integer that names no live subscription.
    func syncSubscription() throws(RequestFailure) -> UInt64 {
        guard let v = value("sub") else { throw fail("missing field \"sub\"") }
        if let sub = v.uint64Value { return sub }
        let integral: Bool
        switch v {
        case .int: integral = true
        case .double(let d): integral = d.isFinite && d.rounded(.towardZero) == d
        default: integral = false
        }
        guard integral else { throw fail("field \"sub\" must be an integer, not \(v.jsonText.prefix(40))") }
        throw RequestFailure(id: id, .notFound, "no subscription \(v.jsonText.prefix(40)) on this connection")
    }

    // MARK: The lease extension

    /// A lease id: an integer from 1 to 2^64−1, read as a revision is.
    func optionalLease(_ name: String) throws(RequestFailure) -> UInt64? {
        guard let v = value(name) else { return nil }
        guard let lease = unsigned(name, v), lease >= 1 else {
            throw fail("field \"\(name)\" must be a lease id (an integer from 1), not \(written(name, v))")
        }
        return lease
    }

    /// `grant`, `keepalive` or `revoke`, with its fields.
    func leaseCommand(_ op: String) throws(RequestFailure) -> LeaseCommand {
        switch op {
        case "grant":
            guard let v = value("ttl") else { return .grant(ttl: nil) }
            guard let seconds = v.int64Value, seconds >= 1, seconds <= Int64(LeaseCommand.maxTTL) else {
                throw fail("field \"ttl\" must be an integer from 1 to \(LeaseCommand.maxTTL) (seconds), not \(v.jsonText.prefix(40))")
            }
            return .grant(ttl: UInt32(seconds))
        case "keepalive", "revoke":
            guard let lease = try optionalLease("lease") else { throw fail("missing field \"lease\"") }
            return op == "keepalive" ? .keepalive(lease: lease) : .revoke(lease: lease)
        default:
            throw RequestFailure(id: id, .unknownOp, "unknown op \(JSONValue.string(op).jsonText)")
        }
    }
}
