// A write-ahead log's file operations for tests: the system's own calls, except those a test
// told to fail — with the errno a sick disk would give — so a full disk at a segment
// roll-over, or a cut that fails with EIO, happens at exactly the call the test means; and
// one call a test told to wait, so that what is queued meanwhile makes one group.

import Dispatch
@testable import ObsStore
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

final class FaultyFiles: FileOperations {
    /// A call the log makes, as a fault sees it.
    enum Call: Sendable, Equatable {
        case open(path: String, creating: Bool)
        case pwrite(offset: Int, count: Int)
        case fdatasync
        case ftruncate(length: Int)
    }

    private struct Fault {
        let matches: @Sendable (Call) -> Bool
        let errno: Int32
        var times: Int
    }

    private let faults = Mutex<[Fault]>([])
    private let failed = Mutex<[Call]>([])
    /// The call to hold once it is made, and whether one is held now.
    private let gate = Mutex<(matches: (@Sendable (Call) -> Bool)?, holding: Bool)>((nil, false))
    private let released = DispatchSemaphore(value: 0)
    private let system = SystemFileOperations()

    /// Makes the next `times` calls that `matches` fail with `errno` (`Int.max`: until `heal`).
    /// Faults are tried in the order they were added; a call fails by the first that matches.
    func fail(_ times: Int = 1, errno: Int32, when matches: @escaping @Sendable (Call) -> Bool) {
        faults.withLock { $0.append(Fault(matches: matches, errno: errno, times: times)) }
    }

    /// No call fails from now on.
    func heal() { faults.withLock { $0 = [] } }

    /// The calls failed on cue so far, in order.
    var failedCalls: [Call] { failed.withLock { $0 } }

    /// Makes the next call that `matches` (and does not fail) wait until `release`.
    func hold(when matches: @escaping @Sendable (Call) -> Bool) { gate.withLock { $0 = (matches, false) } }

    /// Whether a call is waiting for `release`.
    var holding: Bool { gate.withLock { $0.holding } }

    /// Lets the held call go on (the system call, with faults added meanwhile not applied).
    func release() { released.signal() }

    /// Whether `call` fails (then `errno` is set as the system call would set it); if it does
    /// not and a test holds it, returns once the test releases it.
    private func intercept(_ call: Call) -> Bool {
        if fails(call) { return true }
        let held = gate.withLock { gate -> Bool in
            guard let matches = gate.matches, matches(call) else { return false }
            gate = (nil, true)
            return true
        }
        if held {
            released.wait()
            gate.withLock { $0.holding = false }
        }
        return false
    }

    /// Whether `call` fails; if it does, `errno` is set as the system call would set it.
    private func fails(_ call: Call) -> Bool {
        let code = faults.withLock { faults -> Int32? in
            guard let i = faults.firstIndex(where: { $0.times > 0 && $0.matches(call) }) else { return nil }
            faults[i].times -= faults[i].times == Int.max ? 0 : 1
            return faults[i].errno
        }
        guard let code else { return false }
        failed.withLock { $0.append(call) }
        errno = code
        return true
    }

    func open(_ path: String, _ flags: Int32, _ mode: mode_t) -> Int32 {
        intercept(.open(path: path, creating: flags & O_CREAT != 0)) ? -1 : system.open(path, flags, mode)
    }

    func pwrite(_ fd: Int32, _ buffer: UnsafeRawPointer, _ count: Int, _ offset: off_t) -> Int {
        intercept(.pwrite(offset: Int(offset), count: count)) ? -1 : system.pwrite(fd, buffer, count, offset)
    }

    func fdatasync(_ fd: Int32) -> Int32 { intercept(.fdatasync) ? -1 : system.fdatasync(fd) }

    func ftruncate(_ fd: Int32, _ length: off_t) -> Int32 {
        intercept(.ftruncate(length: Int(length))) ? -1 : system.ftruncate(fd, length)
    }
}
