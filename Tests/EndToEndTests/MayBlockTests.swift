// The `.mayBlock` trait (TestSupport/BlockingThreads.swift): a test body's blocking calls run
// on threads of their own, so they never hold Swift's cooperative pool that the code under
// test and every other test of the process share.

import Dispatch
import Foundation
import Testing
import TestSupport

@Suite(.mayBlock) struct MayBlockTests {
    /// One more child task than the cooperative pool has threads, each blocking until all of
    /// them have started: on the pool (without the trait) at most as many as it has threads
    /// ever run at once, and the wait times out; with it, every child gets a thread.
    @Test func moreBlockingChildrenThanThePoolHasThreadsAllRunAtOnce() async throws {
        let children = ProcessInfo.processInfo.activeProcessorCount + 1
        let arrived = DispatchSemaphore(value: 0)
        let released = DispatchSemaphore(value: 0)
        let allArrived = try await withThrowingTaskGroup(of: Bool.self) { group in
            for _ in 0..<children {
                group.addTask {
                    arrived.signal()
                    return released.wait(timeout: .now() + 60) == .success
                }
            }
            // The group's own body blocks too, as a test's would.
            var count = 0
            while count < children, arrived.wait(timeout: .now() + 60) == .success { count += 1 }
            for _ in 0..<children { released.signal() }
            var results: [Bool] = []
            for try await result in group { results.append(result) }
            return count == children && results.allSatisfy { $0 }
        }
        #expect(allArrived, "\(children) blocking children did not all run at once")
    }

    /// The body runs on the trait's executor, not on the pool: a detached task (no executor
    /// preference) still runs while the body blocks waiting for it.
    @Test func aDetachedTaskRunsWhileTheBodyBlocksForIt() async throws {
        let ran = DispatchSemaphore(value: 0)
        let blockers = ProcessInfo.processInfo.activeProcessorCount
        let sawIt = try await withThrowingTaskGroup(of: Bool.self) { group in
            for _ in 0..<blockers {
                group.addTask {
                    // Each passes the detached task's signal on to the next.
                    let saw = ran.wait(timeout: .now() + 60) == .success
                    ran.signal()
                    return saw
                }
            }
            Task.detached { ran.signal() }
            var all = true
            for try await saw in group { all = all && saw }
            return all
        }
        #expect(sawIt, "the detached task never ran while the body's children blocked")
    }
}
