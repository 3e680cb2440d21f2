// Test support: test bodies that may block a thread run on threads of their own (the
// `.mayBlock` trait and the task executor behind it).
//
// Every suite of the package runs in one process, and Swift's cooperative pool has as many
// threads as the machine has CPUs — two here. Tests that call a daemon over a blocking socket
// (`WireConnection`, `TestDaemon`, the etcd cluster's helpers) hold a pool thread for as long
// as each call waits; on a busy machine two of them starved every other test of the process,
// the client library's tasks included, for a minute (a CI run: a lease test measured 66 s for
// a 3 s TTL, all of it spent waiting for a thread). A suite marked `.mayBlock` runs each of
// its test cases with this executor as its task executor preference: its body, its awaits'
// continuations and its child tasks run on threads that may block, one more whenever all are
// busy, and the cooperative pool stays free for the code under test.

import Foundation
import ObservableKit
import Testing

/// A task executor with as many threads as jobs that wait at once: a job is handed to an idle
/// thread, or to a new one when none is idle. Threads are kept for the process's life.
public final class BlockingThreadsExecutor: TaskExecutor {
    /// The one instance the `.mayBlock` trait uses.
    public static let shared = BlockingThreadsExecutor()

    private struct State {
        var jobs: [UnownedJob] = []
        var next = 0
        var idle = 0
        var threads = 0
    }

    private let state = Locked(State())
    /// Signalled once for each job handed to an idle thread.
    private let wake = DispatchSemaphore(value: 0)

    private init() {}

    public func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        let handedToIdle = state.withLock { state -> Bool in
            state.jobs.append(job)
            guard state.idle > 0 else {
                state.threads += 1
                return false
            }
            state.idle -= 1
            return true
        }
        if handedToIdle {
            wake.signal()
        } else {
            let thread = Thread { [self] in work() }
            thread.name = "mayBlock"
            thread.start()
        }
    }

    /// How many threads the executor has started (for its own test).
    public var threadCount: Int { state.withLock { $0.threads } }

    /// A thread's loop: every wake-up (or its start) matches one job enqueued before it, so
    /// the queue is never empty when a thread takes from it.
    private func work() {
        while true {
            let job = state.withLock { state -> UnownedJob? in
                guard state.next < state.jobs.count else { return nil }
                let job = state.jobs[state.next]
                state.next += 1
                if state.next == state.jobs.count {
                    state.jobs.removeAll(keepingCapacity: true)
                    state.next = 0
                }
                return job
            }
            job?.runSynchronously(on: asUnownedTaskExecutor())
            state.withLock { $0.idle += 1 }
            wake.wait()
        }
    }
}

/// Runs each test case of a suite (or a test) on `BlockingThreadsExecutor`, so the blocking
/// calls its body makes never hold a thread of Swift's cooperative pool.
public struct MayBlockTrait: SuiteTrait, TestTrait, TestScoping {
    public var isRecursive: Bool { true }

    public func scopeProvider(for test: Test, testCase: Test.Case?) -> Self? {
        testCase == nil ? nil : self
    }

    public func provideScope(
        for test: Test, testCase: Test.Case?, performing function: @Sendable () async throws -> Void
    ) async throws {
        try await withTaskExecutorPreference(BlockingThreadsExecutor.shared) {
            try await function()
        }
    }
}

extension Trait where Self == MayBlockTrait {
    /// The suite's or test's body makes blocking calls (sockets, processes, sleeps): it runs on
    /// threads of its own instead of Swift's cooperative pool, which the code under test needs.
    public static var mayBlock: Self { MayBlockTrait() }
}
