// ObsStore — the two threading primitives the store needs: a blocking queue (many
// producers, one consumer that sleeps until there is work) and a dedicated thread.
// Built on pthreads, so ThreadSanitizer understands them.

import ObservableKit

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// A FIFO queue whose consumer can wait for items, with a timeout.
final class BlockingQueue<Item: Sendable>: @unchecked Sendable {
    // @unchecked Sendable: `items` and `closed` are only touched between
    // pthread_mutex_lock and pthread_mutex_unlock of `mutex`.
    private var items: [Item] = []
    private var closed = false
    private let mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
    private let condition = UnsafeMutablePointer<pthread_cond_t>.allocate(capacity: 1)

    init() {
        pthread_mutex_init(mutex, nil)
        var attributes = pthread_condattr_t()
        pthread_condattr_init(&attributes)
        #if !canImport(Darwin)
        pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
        #endif
        pthread_cond_init(condition, &attributes)
        pthread_condattr_destroy(&attributes)
    }

    deinit {
        pthread_cond_destroy(condition)
        pthread_mutex_destroy(mutex)
        condition.deallocate()
        mutex.deallocate()
    }

    private func locked<R>(_ body: () throws -> R) rethrows -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body()
    }

    /// Appends an item and wakes the consumer. Returns `false` once the queue is closed.
    @discardableResult
    func append(_ item: Item) -> Bool {
        let accepted = locked { () -> Bool in
            guard !closed else { return false }
            items.append(item)
            return true
        }
        if accepted { pthread_cond_signal(condition) }
        return accepted
    }

    /// Removes the queued items that match.
    func removeAll(where predicate: (Item) -> Bool) {
        locked { items.removeAll(where: predicate) }
    }

    /// Takes every queued item, waiting up to `timeout` for one to arrive.
    /// Returns `[]` on timeout, `nil` once the queue is closed and empty.
    func takeAll(timeout: Duration) -> [Item]? {
        locked { () -> [Item]? in
            if items.isEmpty && !closed {
                var deadline = timespec()
                #if canImport(Darwin)
                var now = timeval()
                gettimeofday(&now, nil)
                deadline.tv_sec = now.tv_sec
                deadline.tv_nsec = Int(now.tv_usec) * 1000
                #else
                clock_gettime(CLOCK_MONOTONIC, &deadline)
                #endif
                let (seconds, attoseconds) = timeout.components
                var nanos = Int(deadline.tv_nsec) + Int(attoseconds / 1_000_000_000)
                deadline.tv_sec += Int(seconds) + nanos / 1_000_000_000
                nanos %= 1_000_000_000
                deadline.tv_nsec = nanos
                while items.isEmpty && !closed {
                    if pthread_cond_timedwait(condition, mutex, &deadline) == ETIMEDOUT { break }
                }
            }
            if items.isEmpty { return closed ? nil : [] }
            var taken: [Item] = []
            swap(&taken, &items)
            return taken
        }
    }

    /// Refuses further items; the consumer drains what is queued, then gets `nil`.
    func close() {
        locked { closed = true }
        pthread_cond_broadcast(condition)
    }
}

/// A thread that runs one closure.
package final class DedicatedThread: Sendable {
    private let thread: Locked<pthread_t?>

    private final class Box {
        let body: @Sendable () -> Void
        init(_ body: @escaping @Sendable () -> Void) { self.body = body }
    }

    /// Starts `body` on a new thread.
    package init(_ body: @escaping @Sendable () -> Void) {
        let box = Unmanaged.passRetained(Box(body)).toOpaque()
        #if canImport(Darwin)
        var handle: pthread_t? = nil
        #else
        var handle = pthread_t()
        #endif
        let rc = pthread_create(&handle, nil, { raw in
            #if canImport(Darwin)
            let box = Unmanaged<Box>.fromOpaque(raw).takeRetainedValue()
            #else
            let box = Unmanaged<Box>.fromOpaque(raw!).takeRetainedValue()
            #endif
            box.body()
            return nil
        }, box)
        precondition(rc == 0, "pthread_create failed: \(rc)")
        self.thread = Locked(handle)
    }

    /// Waits for the thread to finish. Idempotent.
    package func join() {
        let handle = thread.withLock { h -> pthread_t? in
            defer { h = nil }
            return h
        }
        if let handle { pthread_join(handle, nil) }
    }
}
