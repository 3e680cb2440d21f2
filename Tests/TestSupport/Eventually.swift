// Test support: waiting for a condition with a deadline that cannot lie.
//
// Tests share Swift's cooperative thread pool (two threads on a two-CPU machine), and
// several of them block a thread while they wait for a daemon. A waiting test can then be
// starved past its own deadline between two checks; a loop that stops at the deadline
// without looking again would report the state it saw long ago as if the daemon had kept
// it for the whole wait. These helpers always check once more after the deadline.

#if canImport(Glibc)
import Glibc
#endif

/// Whether `condition` holds within `timeout`, checking every `interval` (blocking the
/// thread between checks) and once more after the deadline.
public func eventually(
    timeout: Duration = .seconds(20), every interval: Duration = .milliseconds(5), _ condition: () throws -> Bool
) rethrows -> Bool {
    let deadline = ContinuousClock.now + timeout
    while ContinuousClock.now < deadline {
        if try condition() { return true }
        usleep(UInt32(interval.components.attoseconds / 1_000_000_000_000 + interval.components.seconds * 1_000_000))
    }
    return try condition()
}

/// Whether `condition` holds within `timeout`, checking every `interval` (suspending between
/// checks) and once more after the deadline.
public func eventually(
    timeout: Duration = .seconds(20), every interval: Duration = .milliseconds(5), _ condition: () async throws -> Bool
) async rethrows -> Bool {
    let deadline = ContinuousClock.now + timeout
    while ContinuousClock.now < deadline {
        if try await condition() { return true }
        try? await Task.sleep(for: interval)
    }
    return try await condition()
}
