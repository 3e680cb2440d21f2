// The fuzzer's seed corpus (and every crash it ever found, once added there) replayed
// through the same checks as fuzz/run.sh, on every test run, without libFuzzer.

import Foundation
import Testing
import TestSupport

@Suite(.mayBlock) struct FuzzCorpusTests {
    @Test func seedCorpusReplaysCleanly() throws {
        let corpus = URL(fileURLWithPath: #filePath)
            .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("fuzz/corpus").path
        let inputs = try FileManager.default.contentsOfDirectory(atPath: corpus).count
        #expect(inputs >= 20)
        let result = try run(BuildProducts.path("obsfuzz"), [corpus])
        #expect(result.status == 0, "obsfuzz failed:\n\(result.stdout)\(result.stderr)")
        #expect(result.stdout.contains("replayed \(inputs) inputs"))
    }

    @Test func anUnreadableCorpusFailsInsteadOfReplayingNothing() throws {
        let result = try run(BuildProducts.path("obsfuzz"), ["/nonexistent/corpus"])
        #expect(result.status == 66)
        #expect(result.stderr.contains("cannot read /nonexistent/corpus"))
    }
}
