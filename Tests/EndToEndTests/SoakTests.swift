// A short soak in every test run: `obsbench soak` (the same code as `make soak`, scaled
// down) against the real daemon — churning connections, slow readers cut off, fast
// subscribers gap-free, and every descriptor given back once the clients are gone.

import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

@Suite(.mayBlock, .timeLimit(.minutes(3))) struct SoakTests {
    @Test func churnSlowReadersAndFastSubscribersForFifteenSeconds() async throws {
        let d = try await TestDaemon.start(["--queue-bytes", "131072", "--overflow-grace", "1"])
        let arguments = [
            "soak", "--socket", d.socketPath, "--pid", "\(d.pid)", "--seconds", "15", "--warmup", "9", "--sample", "3",
            "--churners", "200", "--writers", "2", "--rate", "250", "--fast", "2", "--slow", "2",
            // Debug builds over fifteen seconds: the memory check is only a bound on runaway growth.
            "--max-rss-growth", "1.0",
        ]
        let result = try await runOffTheCooperativePool(BuildProducts.path("obsbench"), arguments)
        #expect(result.status == 0, "obsbench soak failed:\n\(result.stdout)\(result.stderr)")
        #expect(result.stdout.contains("soak ok"))
    }
}

/// Runs a long command on a thread of its own, so the wait does not hold a cooperative thread.
func runOffTheCooperativePool(_ executable: String, _ arguments: [String]) async throws -> CommandResult {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try run(executable, arguments) }) }.start()
    }
}
