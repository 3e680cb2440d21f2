// Tests of the lease requests and of `progress`, decoding and encoding: `grant`, `keepalive`,
// `revoke` and a `set`'s `lease` with their precise `bad_request`s; the fast path leaving a
// `lease` to the general decoder and reading `progress`.

import ObsProtocol
import ObservableKit
import Testing

func leaseFailure(_ text: String) -> RequestFailure? {
    failure(text, with: { raw throws(RequestFailure) in try Request.decode(line: raw) })
}

@Suite struct LeaseRequestTests {
    @Test func decodesTheLeaseOperations() throws {
        #expect(try decode(#"{"id":1,"op":"grant"}"#) == Request(id: 1, command: .lease(.grant(ttl: nil))))
        #expect(try decode(#"{"id":1,"op":"grant","ttl":null}"#) == Request(id: 1, command: .lease(.grant(ttl: nil))))
        #expect(try decode(#"{"op":"grant","ttl":31536000}"#) == Request(id: .null, command: .lease(.grant(ttl: 31_536_000))))
        #expect(try decode(#"{"op":"grant","ttl":1.0}"#) == Request(id: .null, command: .lease(.grant(ttl: 1))))
        #expect(try decode(#"{"id":"k","op":"keepalive","lease":7}"#) == Request(id: "k", command: .lease(.keepalive(lease: 7))))
        #expect(try decode(#"{"op":"revoke","lease":9223372036854775807}"#) == Request(id: .null, command: .lease(.revoke(lease: UInt64(Int64.max)))))
        #expect(try decode(#"{"op":"ping"}"#) == Request(command: .ping))
    }

    @Test(arguments: [
        (#"{"id":1,"op":"grant","ttl":0}"#, #"field "ttl" must be an integer from 1 to 31536000 (seconds), not 0"#),
        (#"{"id":1,"op":"grant","ttl":31536001}"#, #"field "ttl" must be an integer from 1 to 31536000 (seconds), not 31536001"#),
        (#"{"id":1,"op":"grant","ttl":1.5}"#, #"field "ttl" must be an integer from 1 to 31536000 (seconds), not 1.5"#),
        (#"{"id":1,"op":"grant","ttl":"30"}"#, #"field "ttl" must be an integer from 1 to 31536000 (seconds), not "30""#),
        (#"{"id":1,"op":"keepalive"}"#, #"missing field "lease""#),
        (#"{"id":1,"op":"revoke","lease":null}"#, #"missing field "lease""#),
        (#"{"id":1,"op":"revoke","lease":0}"#, #"field "lease" must be a lease id (an integer from 1), not 0"#),
        (#"{"id":1,"op":"keepalive","lease":-3}"#, #"field "lease" must be a lease id (an integer from 1), not -3"#),
        (#"{"id":1,"op":"set","repo":"r","key":"k","value":1,"lease":0}"#, #"field "lease" must be a lease id (an integer from 1), not 0"#),
        (#"{"id":1,"op":"set","repo":"r","key":"k","value":1,"lease":true}"#, #"field "lease" must be a lease id (an integer from 1), not true"#),
        (
            #"{"id":1,"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":1},{"op":"set","key":"b","value":1,"lease":"7"}]}"#,
            #"ops[1]: field "lease" must be a lease id (an integer from 1), not "7""#
        ),
    ])
    func aBadLeaseFieldIsABadRequestNamingIt(text: String, message: String) throws {
        let failure = try #require(leaseFailure(text))
        #expect(failure.id == 1)
        #expect(failure.error == ProtocolError(.badRequest, message))
    }

    @Test func writesCarryTheLeaseOfEachKeyTheySet() throws {
        let set = try decode(#"{"id":1,"op":"set","repo":"r","key":"web/ready","value":true,"lease":7}"#)
        guard case .set("r", "web/ready", true, nil, false) = set.command else {
            Issue.record("set"); return
        }
        #expect(set.leases == ["web/ready": 7])
        #expect(try decode(#"{"op":"set","repo":"r","key":"k","value":1,"lease":null}"#).leases.isEmpty)
        let batch = try decode(
            #"{"op":"batch","repo":"r","ops":[{"op":"set","key":"a","value":1,"lease":3},{"op":"set","key":"b","value":2},{"op":"delete","key":"c","lease":9}]}"#)
        guard case .batch("r", let ops) = batch.command else { Issue.record("batch"); return }
        #expect(ops.count == 3)
        #expect(batch.leases == ["a": 3], "a delete detaches: its lease is not read")
    }

    @Test func theFastPathReadsALeaseAndProgressAsTheGeneralDecoderDoes() throws {
        let withLease = #"{"op":"set","repo":"r","key":"k","value":1,"lease":7}"#
        #expect(try decode(withLease).leases == ["k": 7])
        // What the fast path is not sure of goes to the general decoder, which judges it.
        for text in [#"{"op":"set","repo":"r","key":"k","value":1,"lease":0}"#, #"{"op":"set","repo":"r","key":"k","value":1,"lease":7.0}"#] {
            Array(text.utf8).withUnsafeBytes { raw in #expect(Request.scan(raw) == nil, "\(text)") }
        }
        for text in [
            withLease, #"{"op":"set","repo":"r","key":"k","value":1,"lease":null}"#, #"{"op":"subscribe","repo":"r","progress":true}"#,
            #"{"op":"get","repo":"r","key":"k","lease":3}"#,
        ] {
            try Array(text.utf8).withUnsafeBytes { raw in
                let fast = try #require(Request.scan(raw), "the fast path takes \(text)")
                #expect(fast == (try Request.decodeInGeneral(line: raw)))
            }
        }
        guard case .subscribe(let s) = try decode(#"{"op":"subscribe","repo":"r","progress":true}"#).command else {
            Issue.record("subscribe"); return
        }
        #expect(s.progress)
        #expect(failure(#"{"id":2,"op":"subscribe","repo":"r","progress":1}"#) == RequestFailure(id: 2, .badRequest, #"field "progress" must be a boolean, not number"#))
    }

    @Test func leaseRequestsAndProgressEncodeAsTheDecoderReadsThem() throws {
        for command in [LeaseCommand.grant(ttl: nil), .grant(ttl: 30), .keepalive(lease: 7), .revoke(lease: 8)] {
            var line: [UInt8] = []
            command.encodeRequest(into: &line, id: 5)
            #expect(line.last == UInt8(ascii: "\n"))
            #expect(try decode(String(decoding: line.dropLast(), as: UTF8.self)) == Request(id: 5, command: .lease(command)))
        }
        var line: [UInt8] = []
        Command.subscribe(SubscribeRequest(repo: "ui", progress: true)).encodeRequest(into: &line, id: 1)
        #expect(String(decoding: line, as: UTF8.self) == #"{"id":1,"op":"subscribe","repo":"ui","progress":true}"# + "\n")
    }
}
