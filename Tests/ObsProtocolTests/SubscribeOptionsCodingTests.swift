// Tests of the client side of the subscribe options `coalesce`, `writers`, `echo`: how a
// client encodes them (each only when it differs from the default), and how it decodes
// what they add to change events (`from`, `by`), refusing malformed values.

import ObsProtocol
import ObservableKit
import Testing

@Suite struct SubscribeOptionsCodingTests {
    func requestLine(_ request: SubscribeRequest) -> String {
        var encoded: [UInt8] = []
        Command.subscribe(request).encodeRequest(into: &encoded, id: 1)
        return String(decoding: encoded, as: UTF8.self)
    }

    func decodeMessage(_ text: String) throws(ProtocolViolation) -> ServerMessage {
        let bytes = Array(text.utf8)
        let result = bytes.withUnsafeBytes { raw in Result { () throws(ProtocolViolation) in try ServerMessage.decode(line: raw) } }
        return try result.get()
    }

    @Test func optionsAreSentOnlyWhenTheyDifferFromTheDefault() {
        #expect(requestLine(SubscribeRequest(repo: "ui")) == #"{"id":1,"op":"subscribe","repo":"ui"}"# + "\n")
        #expect(
            requestLine(SubscribeRequest(repo: "ui", coalesce: true, writers: true, echo: false))
                == #"{"id":1,"op":"subscribe","repo":"ui","coalesce":true,"writers":true,"echo":false}"# + "\n")
        #expect(requestLine(SubscribeRequest(repo: "ui", echo: true)) == #"{"id":1,"op":"subscribe","repo":"ui"}"# + "\n")
        #expect(
            requestLine(SubscribeRequest(repo: "ui", selection: .keys(["b", "a"]), since: 4, epoch: "e", writers: true))
                == #"{"id":1,"op":"subscribe","repo":"ui","keys":["a","b"],"since":4,"epoch":"e","writers":true}"# + "\n")
    }

    @Test func aCoalescedEventCarriesFromAndBy() throws {
        let line =
            #"{"event":"change","sub":3,"repo":"ui","rev":50,"from":44,"by":{"uid":1000,"gid":100,"pid":4242},"#
            + #""changes":[{"key":"a","old":1,"new":2},{"key":"b","new":"x"},{"key":"c","old":true}]}"#
        guard case .event(.change(let event)) = try decodeMessage(line) else {
            Issue.record("a change event"); return
        }
        #expect(event.subscription == 3 && event.repository == "ui" && event.revision == 50)
        #expect(event.from == 44)
        #expect(event.by == Writer(uid: 1000, gid: 100, pid: 4242))
        #expect(event.changes == [Change(key: "a", old: 1, new: 2), Change(key: "b", old: nil, new: "x"), Change(key: "c", old: true, new: nil)])
    }

    @Test func anEventWithoutTheOptionsHasNeither() throws {
        guard case .event(.change(let event)) = try decodeMessage(
            #"{"event":"change","sub":1,"repo":"ui","rev":2,"changes":[{"key":"a","new":1}]}"#)
        else { Issue.record("a plain change event"); return }
        #expect(event.from == nil && event.by == nil && event.lease == nil)
    }

    @Test func theWriterAcceptsTheFullRangeOfItsFieldsAndIgnoresOthers() throws {
        let line = #"{"event":"change","sub":1,"repo":"ui","rev":2,"by":{"pid":-1,"uid":4294967295,"gid":0,"x":"y"},"changes":[]}"#
        guard case .event(.change(let event)) = try decodeMessage(line), event.from == nil else { Issue.record("change"); return }
        let by = event.by
        #expect(by == Writer(uid: UInt32.max, gid: 0, pid: -1))
        #expect(by?.jsonValue == ["uid": 4_294_967_295, "gid": 0, "pid": -1])
        #expect(by?.description == "uid 4294967295 gid 0 pid -1")
    }

    @Test(arguments: [
        #""by":{"uid":1,"gid":2}"#,  // no pid
        #""by":{"uid":-1,"gid":2,"pid":3}"#,  // uid below 0
        #""by":{"uid":4294967296,"gid":2,"pid":3}"#,  // uid above UInt32
        #""by":{"uid":"1","gid":2,"pid":3}"#,  // a string
        #""by":[1,2,3]"#,
        #""by":null"#,
        #""from":0"#,  // no revision 0
        #""from":51"#,  // after rev
        #""from":"44""#,
        #""from":-1"#,
    ])
    func malformedFromOrByIsAProtocolViolation(member: String) {
        let line = #"{"event":"change","sub":1,"repo":"ui","rev":50,"# + member + #","changes":[{"key":"a","new":1}]}"#
        #expect(throws: ProtocolViolation.self) { _ = try decodeMessage(line) }
    }
}
