// ObservableKit — the lock for small shared state of the daemon's modules (ObsStore, ObsCore,
// ObsServer), of ObservableKit itself and of the tests' support: what ThreadSanitizer checks.
//
// A value behind a mutex, in one allocation. It wraps `pthread_mutex_t` (Linux) or
// `os_unfair_lock` (Apple platforms) rather than the standard library's `Mutex`: on Linux
// `Mutex` is a futex inside the uninstrumented runtime, so ThreadSanitizer cannot see its
// happens-before edges and reports false races — and a sanitizer run we cannot trust is
// worthless. `pthread_mutex_*` is intercepted by ThreadSanitizer, so this lock is checked.

#if canImport(Darwin)
import Darwin
@usableFromInline typealias LockPrimitive = os_unfair_lock
#elseif canImport(Glibc)
import Glibc
@usableFromInline typealias LockPrimitive = pthread_mutex_t
#elseif canImport(Musl)
import Musl
@usableFromInline typealias LockPrimitive = pthread_mutex_t
#endif

@usableFromInline
final class LockStorage<Value>: ManagedBuffer<Value, LockPrimitive> {
    @inlinable
    static func make(_ value: Value) -> LockStorage<Value> {
        let buffer = create(minimumCapacity: 1) { _ in value }
        let storage = unsafeDowncast(buffer, to: LockStorage<Value>.self)
        storage.withUnsafeMutablePointerToElements { lock in
            #if canImport(Darwin)
            lock.initialize(to: os_unfair_lock())
            #else
            let rc = pthread_mutex_init(lock, nil)
            precondition(rc == 0, "pthread_mutex_init failed: \(rc)")
            #endif
        }
        return storage
    }

    @inlinable
    func lock() {
        withUnsafeMutablePointerToElements { lock in
            #if canImport(Darwin)
            os_unfair_lock_lock(lock)
            #else
            let rc = pthread_mutex_lock(lock)
            precondition(rc == 0, "pthread_mutex_lock failed: \(rc)")
            #endif
        }
    }

    @inlinable
    func unlock() {
        withUnsafeMutablePointerToElements { lock in
            #if canImport(Darwin)
            os_unfair_lock_unlock(lock)
            #else
            let rc = pthread_mutex_unlock(lock)
            precondition(rc == 0, "pthread_mutex_unlock failed: \(rc)")
            #endif
        }
    }

    deinit {
        #if !canImport(Darwin)
        withUnsafeMutablePointerToElements { _ = pthread_mutex_destroy($0) }
        #endif
    }
}

/// A value protected by a mutex. Copies share the same value and lock.
public struct Locked<Value> {
    @usableFromInline let storage: LockStorage<Value>

    @inlinable
    public init(_ value: Value) {
        storage = LockStorage.make(value)
    }

    /// Runs `body` with exclusive access to the value. Do not call back into the same lock.
    @inlinable
    public func withLock<R, E: Error>(_ body: (inout Value) throws(E) -> R) throws(E) -> R {
        storage.lock()
        defer { storage.unlock() }
        return try body(&storage.header)
    }
}

// @unchecked Sendable: `storage.header` (the value) is only read or written inside
// `withLock`, between `lock()` and `unlock()` of the mutex stored next to it, and the
// value itself is Sendable, so what `withLock` returns may cross threads.
extension Locked: @unchecked Sendable where Value: Sendable {}
