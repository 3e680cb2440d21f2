// ObsEtcdTests: what needs no cluster — endpoint URLs, prefix ends, the gateway's JSON as
// etcd 3.4.23 wrote it on this machine (recorded answers), how errors are classified, and
// how a replayed watch response is split into one element per revision.

@testable import ObsEtcd
import Testing

@Suite struct EtcdWireTests {
    @Test func endpointURLsParseAndBadOnesAreRefused() throws {
        #expect(try EtcdEndpoint(url: "http://127.0.0.1:2379") == EtcdEndpoint(host: "127.0.0.1", port: 2379))
        #expect(try EtcdEndpoint(url: "127.0.0.1:2379/") == EtcdEndpoint(host: "127.0.0.1", port: 2379))
        #expect(try EtcdEndpoint(url: "http://[::1]:2379") == EtcdEndpoint(host: "::1", port: 2379))
        #expect(try EtcdEndpoint(url: "http://[::1]:2379").description == "http://[::1]:2379")
        for bad in ["https://127.0.0.1:2379", "http://127.0.0.1", "http://:2379", "http://h:0", "h:99999"] {
            #expect(throws: EtcdError.self, "\(bad)") { try EtcdEndpoint(url: bad) }
        }
        #expect(throws: EtcdError.invalidConfiguration("no etcd endpoint given")) { try EtcdClient.Configuration(endpoints: [String]()) }
    }

    @Test func prefixEndIsTheNextKeyAfterEveryKeyWithThePrefix() {
        #expect(EtcdKey.prefixEnd(Array("/obsd/".utf8)) == Array("/obsd0".utf8))
        #expect(EtcdKey.prefixEnd([0x61, 0xff]) == [0x62])
        #expect(EtcdKey.prefixEnd([0xff, 0xff]) == [0])
        #expect(EtcdKey.prefixEnd([]) == [0])
    }

    @Test func txnAnswersDecodeWithTheirZeroValuesLeftOut() throws {
        let succeeded = #"{"header":{"cluster_id":"16536415434415923952","member_id":"8902212031087584746","revision":"3","raft_term":"2"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"3"},"prev_kv":{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="}}},{"response_put":{"header":{"revision":"3"}}}]}"#
        let result = try WireCoding.decode(WireTxnResponse.self, from: Array(succeeded.utf8)).result()
        #expect(result.succeeded && result.revision == 3)
        #expect(result.responses == [
            .put(prevKV: EtcdKeyValue(key: Array("a".utf8), value: Array("1".utf8), createRevision: 2, modRevision: 2, version: 1)),
            .put(prevKV: nil),
        ])
        // A failed compare: `succeeded` is absent; the failure branch's range answers.
        let failed = #"{"header":{"revision":"3","raft_term":"2"},"responses":[{"response_range":{"header":{"revision":"3"},"kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"3","version":"2","value":"Mg=="}],"count":"1"}}]}"#
        let other = try WireCoding.decode(WireTxnResponse.self, from: Array(failed.utf8)).result()
        #expect(!other.succeeded)
        guard case .range(let range)? = other.responses.first else {
            Issue.record("no range result")
            return
        }
        #expect(range.count == 1 && range.kvs.first?.modRevision == 3 && !range.more)
        // A cluster ID beyond Int64.max keeps its bits.
        let header = try WireCoding.decode(WireHeader.self, from: Array(#"{"cluster_id":"16536415434415923952"}"#.utf8))
        #expect(header.cluster_id.uint64 == 16_536_415_434_415_923_952)
    }

    @Test func aReplayedWatchResponseWithTwoRevisionsBecomesTwoElements() throws {
        // Recorded: a watch from revision 1 after a put at 2 and a two-put txn at 3.
        let line = #"{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="}},{"kv":{"key":"YQ==","create_revision":"2","mod_revision":"3","version":"2","value":"Mg=="},"prev_kv":{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1","value":"MQ=="}},{"kv":{"key":"Yg==","create_revision":"3","mod_revision":"3","version":"1","value":"Mg=="}},{"type":"DELETE","kv":{"key":"Yw==","mod_revision":"4"}}]}}"#
        let decoded = try WireCoding.decode(WireWatchLine.self, from: Array(line.utf8))
        let events = try #require(decoded.result?.events).map(\.event)
        let groups = EtcdWatchResponse.grouped(events)
        #expect(groups.map(\.revision) == [2, 3, 4])
        #expect(groups.map(\.events.count) == [1, 2, 1])
        #expect(groups[1].events[0].prevKV?.value == Array("1".utf8))
        #expect(groups[1].events[1].prevKV == nil, "a creation has no previous state")
        #expect(groups[2].events[0].kind == .delete && groups[2].events[0].kv.value.isEmpty)
        #expect(!groups[0].isProgress)
    }

    @Test func gatewayErrorsAreClassifiedByWhatIsKnownOfTheOutcome() throws {
        let noLeader = try WireCoding.decode(
            WireUnaryError.self, from: Array(#"{"error":"etcdserver: no leader","message":"etcdserver: no leader","code":14}"#.utf8))
        let refused = EtcdError.fromGateway(status: 503, code: noLeader.code, message: noLeader.message)
        #expect(refused == .unavailable("etcdserver: no leader") && !refused.isOutcomeUnknown && refused.isTransient)

        let streamed = try WireCoding.decode(
            WireWatchLine.self,
            from: Array(#"{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader","http_status":"Service Unavailable"}}"#.utf8))
        #expect(streamed.error?.grpc_code == 14 && streamed.error?.message == "etcdserver: no leader")

        let compacted = EtcdError.fromGateway(status: 400, code: 11, message: "etcdserver: mvcc: required revision has been compacted")
        #expect(compacted == .compacted(compactRevision: nil))

        for message in ["etcdserver: request timed out", "etcdserver: request timed out, possibly due to previous leader failure", "context deadline exceeded"] {
            let error = EtcdError.fromGateway(status: 503, code: 14, message: message)
            #expect(error.isOutcomeUnknown && error.isTransient, "\(message)")
        }
        let invalid = EtcdError.fromGateway(status: 400, code: 3, message: "etcdserver: key is not provided")
        #expect(!invalid.isOutcomeUnknown && !invalid.isTransient)
        #expect(EtcdError.timeout(outcomeUnknown: true).isOutcomeUnknown)
        #expect(!EtcdError.timeout(outcomeUnknown: false).isOutcomeUnknown)
    }

    @Test func requestsEncodeBytesAsBase64AndRevisionsAsStrings() throws {
        let txn = WireTxnRequest(
            compare: [WireCompare(.modRevision(Array("k".utf8), .equal, 7))],
            success: [WireRequestOp(.put(key: Array("k".utf8), value: [0, 255], prevKV: true))], failure: [])
        let json = String(decoding: try WireCoding.encode(txn), as: UTF8.self)
        #expect(json.contains(#""mod_revision":"7""#))
        #expect(json.contains(#""target":"MOD""#) && json.contains(#""result":"EQUAL""#))
        #expect(json.contains(#""value":"AP8=""#) && json.contains(#""prev_kv":true"#))
    }
}
