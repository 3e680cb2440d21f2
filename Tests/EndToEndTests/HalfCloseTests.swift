// End-to-end: clients that shut down their sending side after their last request — shell
// scripts piping into socat or nc, healthchecks, quick clients in other languages — get
// every reply, in order, then end of file, from a daemon on its default durable settings
// (where replies wait for fsync).

import Foundation
import ObsProtocol
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct HalfCloseTests {
    static let requests = [
        #"{"id":1,"op":"set","repo":"hc","key":"k","value":1}"#,
        #"{"id":2,"op":"subscribe","repo":"hc"}"#,
        #"{"id":3,"op":"set","repo":"hc","key":"k","value":2}"#,
        #"{"id":4,"op":"get","repo":"hc","key":"k"}"#,
        #"{"id":5,"op":"batch","repo":"hc","ops":[{"op":"set","key":"a","value":true},{"op":"delete","key":"k"}]}"#,
    ]

    /// Runs `tool` with the requests on its standard input; its standard output, as messages.
    private func pipe(_ tool: String, _ arguments: [String], input: String, in directory: String) throws -> (Int32, [JSONObject]) {
        let inputPath = directory + "/\(tool).in", outputPath = directory + "/\(tool).out"
        try input.write(toFile: inputPath, atomically: true, encoding: .utf8)
        let process = try ChildProcess(which(tool)!, arguments, stdin: .file(inputPath), stdout: .file(outputPath))
        guard process.wait(timeout: .seconds(20)) != nil else {
            process.kill9()
            throw TestFailure("\(tool) did not finish: the daemon never closed")
        }
        let text = (try? String(contentsOfFile: outputPath, encoding: .utf8)) ?? ""
        let messages = try text.split(separator: "\n").map { line -> JSONObject in
            guard case .object(let o) = try JSONParser.parse(String(line)) else { throw TestFailure("not an object: \(line)") }
            return o
        }
        return (process.terminationStatus, messages)
    }

    private func expectEveryReplyInOrder(_ messages: [JSONObject], from tool: String) {
        let replies = messages.filter { $0["event"] == nil }
        #expect(replies.map { $0["id"] } == [1, 2, 3, 4, 5], "\(tool): \(messages)")
        #expect(replies.allSatisfy { $0.ok }, "\(tool): \(replies)")
        #expect(replies.last?["rev"] == .number(replies[0]["rev"]!.uint64Value! + 2))
        #expect(replies[3]["value"] == 2)
    }

    @Test(.enabled(if: which("socat") != nil, "needs socat (make test-deps installs it)"))
    func socatGetsEveryReplyThenEndOfFile() async throws {
        let d = try await TestDaemon.start()
        let (status, messages) = try pipe(
            "socat", ["-t", "30", "-", "UNIX-CONNECT:\(d.socketPath)"], input: Self.requests.joined(separator: "\n") + "\n",
            in: d.directory)
        #expect(status == 0)
        expectEveryReplyInOrder(messages, from: "socat")
    }

    @Test(.enabled(if: which("nc") != nil, "needs nc (netcat-openbsd; make test-deps installs it)"))
    func ncWithDashNGetsEveryReplyThenEndOfFile() async throws {
        let d = try await TestDaemon.start()
        // The last request without its newline: the end of the stream ends it.
        let (status, messages) = try pipe("nc", ["-U", "-N", d.socketPath], input: Self.requests.joined(separator: "\n"), in: d.directory)
        #expect(status == 0)
        expectEveryReplyInOrder(messages, from: "nc -N")
    }

    @Test func manyPipelinedRequestsThenHalfCloseAreAllAnsweredEvenPastTheQueueLimit() async throws {
        // A queue limit far below the replies: the daemon stops handling input part-way,
        // the client's end of file arrives meanwhile, and every request still gets its reply.
        let d = try await TestDaemon.start(["--queue-bytes", "8192"])
        let c = try d.connect()
        var text = ""
        for i in 1...3000 { text += #"{"id":\#(i),"op":"set","repo":"p","key":"k\#(i % 7)","value":\#(i)}"# + "\n" }
        try c.sendRaw(Array(text.utf8))
        c.shutdownSending()
        let messages = try c.receiveUntilClosed(timeout: .seconds(60))
        #expect(messages.count == 3000)
        #expect(messages.map { $0["id"]?.uint64Value ?? 0 } == Array(1...3000), "every reply, in request order")
        #expect(messages.allSatisfy { $0.ok })
        #expect(try d.connect().call(["op": "get", "repo": "p", "key": "k6"])["value"] == 2995)
    }

    @Test func aHalfClosedSubscriberGetsItsReplyAndSnapshotThenEndOfFile() async throws {
        let d = try await TestDaemon.start()
        let writer = try d.connect()
        _ = try writer.call(["op": "set", "repo": "s", "key": "k", "value": "v"])
        let c = try d.connect()
        try c.send(#"{"id":1,"op":"subscribe","repo":"s","initial":true}"#)
        c.shutdownSending()
        let messages = try c.receiveUntilClosed(timeout: .seconds(20))
        #expect(messages.count == 2 && messages[0]["id"] == 1 && messages[1]["event"] == "snapshot", "\(messages)")
        #expect(try eventually { try writer.call(["op": "stats"])["subscriptions"] == 0 }, "its subscription ended")
    }
}
