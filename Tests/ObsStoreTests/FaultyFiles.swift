// A write-ahead log's file operations for tests: the system's own calls, except those a test
// told to fail — with the errno a sick disk would give — so a full disk at a segment
// roll-over, or a cut that fails with EIO, happens at exactly the call the test means; and
// one call a test told to wait, so that what is queued meanwhile makes one group.

import Dispatch
@testable import ObsStore
import ObservableKit
import SystemPackage

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

    private let faults = Locked<[Fault]>([])
    private let failed = Locked<[Call]>([])
    /// The call to hold once it is made, and whether one is held now.
    private let gate = Locked<(matches: (@Sendable (Call) -> Bool)?, holding: Bool)>((nil, false))
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

    /// Throws the errno a test told `call` to fail with; if it does not fail and a test
    /// holds it, returns once the test releases it.
    private func intercept(_ call: Call) throws(Errno) {
        try fails(call)
        let held = gate.withLock { gate -> Bool in
            guard let matches = gate.matches, matches(call) else { return false }
            gate = (nil, true)
            return true
        }
        if held {
            released.wait()
            gate.withLock { $0.holding = false }
        }
    }

    /// Throws the errno a test told `call` to fail with, if it did.
    private func fails(_ call: Call) throws(Errno) {
        let code = faults.withLock { faults -> Int32? in
            guard let i = faults.firstIndex(where: { $0.times > 0 && $0.matches(call) }) else { return nil }
            faults[i].times -= faults[i].times == Int.max ? 0 : 1
            return faults[i].errno
        }
        guard let code else { return }
        failed.withLock { $0.append(call) }
        throw Errno(rawValue: code)
    }

    func open(
        _ path: FilePath, _ mode: FileDescriptor.AccessMode, options: FileDescriptor.OpenOptions, permissions: FilePermissions
    ) throws(Errno) -> FileDescriptor {
        try intercept(.open(path: path.string, creating: options.contains(.create)))
        return try system.open(path, mode, options: options, permissions: permissions)
    }

    func write(_ fd: FileDescriptor, _ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(Errno) -> Int {
        try intercept(.pwrite(offset: Int(offset), count: bytes.count))
        return try system.write(fd, bytes, at: offset)
    }

    func fdatasync(_ fd: FileDescriptor) throws(Errno) {
        try intercept(.fdatasync)
        try system.fdatasync(fd)
    }

    func truncate(_ fd: FileDescriptor, to length: Int64) throws(Errno) {
        try intercept(.ftruncate(length: Int(length)))
        try system.truncate(fd, to: length)
    }
}
