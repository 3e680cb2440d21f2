// ObsProtocol — requests as a client writes them: a `Command` as one line with its `id`,
// each optional field only when it differs from its default; a `Request` adds the `lease`
// its writes name.

import ObservableKit

extension Request {
    /// The request line: the command with `id`, and `lease` on each `set` (inside a `batch`
    /// too) whose key `leases` names (client side).
    public func encode<S: JSONSink & ~Copyable>(into sink: inout S) {
        command.encodeRequest(into: &sink, id: id, leases: leases)
    }
}

extension Command {
    /// The request line with `id` and `op`, ended by `\n` (client side); with `leases`, each
    /// `set` of a key it names carries that `lease`.
    public func encodeRequest<S: JSONSink & ~Copyable>(into sink: inout S, id: JSONValue, leases: [Key: UInt64] = [:]) {
        if case .lease(let command) = self { return command.encodeRequest(into: &sink, id: id) }
        sink.writeMember("{\"id\":", id)
        sink.writeMember(",\"op\":", op)
        switch self {
        case .hello(let proto, let client):
            if let proto {
                sink.writeRaw(",\"protocol\":")
                sink.writeDecimal(proto)
            }
            if let client { sink.writeMember(",\"client\":", client) }
        case .ping, .repos, .stats, .lease:
            break
        case .get(let repo, let key):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
        case .set(let repo, let key, let value, let ifRev, let force):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
            sink.writeRaw(",\"value\":")
            sink.writeCanonical(value)
            if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
            if force { sink.writeMember(",\"force\":", true) }
            if let lease = leases[key] { sink.writeMember(",\"lease\":", lease) }
        case .delete(let repo, let key, let ifRev):
            sink.writeMember(",\"repo\":", repo)
            sink.writeMember(",\"key\":", key.string)
            if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
        case .batch(let repo, let ops):
            sink.writeMember(",\"repo\":", repo)
            sink.writeRaw(",\"ops\":[")
            for (i, op) in ops.enumerated() {
                if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                switch op {
                case .set(let key, let value, let ifRev, let force):
                    sink.writeMember("{\"op\":\"set\",\"key\":", key.string)
                    sink.writeRaw(",\"value\":")
                    sink.writeCanonical(value)
                    if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
                    if force { sink.writeMember(",\"force\":", true) }
                    if let lease = leases[key] { sink.writeMember(",\"lease\":", lease) }
                case .delete(let key, let ifRev):
                    sink.writeMember("{\"op\":\"delete\",\"key\":", key.string)
                    if let ifRev { sink.writeMember(",\"ifRev\":", ifRev) }
                }
                sink.writeByte(UInt8(ascii: "}"))
            }
            sink.writeByte(UInt8(ascii: "]"))
        case .list(let repo, let prefix, let values):
            sink.writeMember(",\"repo\":", repo)
            if let prefix { sink.writeMember(",\"prefix\":", prefix) }
            if values { sink.writeMember(",\"values\":", true) }
        case .subscribe(let s):
            sink.writeMember(",\"repo\":", s.repo)
            switch s.selection {
            case .all: break
            case .keys(let keys):
                sink.writeRaw(",\"keys\":[")
                for (i, key) in keys.sorted().enumerated() {
                    if i > 0 { sink.writeByte(UInt8(ascii: ",")) }
                    sink.writeJSONString(key)
                }
                sink.writeByte(UInt8(ascii: "]"))
            case .prefix(let p): sink.writeMember(",\"prefix\":", p)
            }
            if s.initial { sink.writeMember(",\"initial\":", true) }
            if let since = s.since {
                sink.writeMember(",\"since\":", since)
                if let epoch = s.epoch { sink.writeMember(",\"epoch\":", epoch) }
            }
            if s.once { sink.writeMember(",\"once\":", true) }
            if s.coalesce { sink.writeMember(",\"coalesce\":", true) }
            if s.writers { sink.writeMember(",\"writers\":", true) }
            if !s.echo { sink.writeMember(",\"echo\":", false) }
            if s.progress { sink.writeMember(",\"progress\":", true) }
            if s.catchup { sink.writeMember(",\"catchup\":", true) }
        case .unsubscribe(let sub), .sync(let sub):
            sink.writeMember(",\"sub\":", sub)
        }
        sink.writeRaw("}\n")
    }
}
