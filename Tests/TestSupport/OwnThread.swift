// Test support: blocking work on a thread of its own.
//
// Swift's cooperative pool has as many threads as the machine has CPUs (two here), and every
// test of a process shares it. A loop of blocking socket calls run as a task holds one of
// those threads for as long as it runs: two such loops and no other test's task — nor the
// daemon clients' tasks a test awaits — runs until they end (a fresh clone's `make test`
// on a busy machine: three storm writers as detached tasks, and a mirror test beside them
// timed out waiting for work that never got a thread). A `.mayBlock` suite's body and child
// tasks already run off the pool (BlockingThreads.swift); an unstructured `Task` does not
// inherit that, so a blocking loop in one still goes here.

import Foundation

/// Runs `body` on a new thread and returns what it returns; the caller suspends meanwhile,
/// holding no thread of the pool.
public func onOwnThread<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try body() }) }.start()
    }
}
