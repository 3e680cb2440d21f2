// ObsServer — one event loop: a thread, an epoll set over the sockets it serves, tasks other
// threads hand it (through an eventfd), timers, and the tick that delivers and writes.
//
// An iteration: wait for readiness (not at all when work is waiting), let each ready
// socket's handler read (and handle requests), run the tasks posted from other threads and
// the timers that are due, let the store commit the writes made (`beforeTick`), then run
// the tick (`onTick`: the shard's delivery and one write per connection with output) if
// anything asked for one — the shape of Redis's `beforeSleep`. Everything here but `execute`
// and `stop` runs on the loop's thread.
//
// Why our own loop and not SwiftNIO's channels, for client connections: see README
// "Architecture" (measured: NIO's per-write and per-read channel machinery was the largest
// share of the daemon's CPU left at fan-out, and one `send` per connection per tick straight
// from the loop is what Redis does). SwiftNIO stays where it serves well: the etcd client.

import CLinux
import HeapModule
import ObsStore
import ObservableKit

#if canImport(Glibc)
import Glibc
#endif

/// Reacts to readiness of a descriptor the loop watches.
protocol IOHandler: AnyObject {
    /// `events`: `EPOLLIN`, `EPOLLOUT`, `EPOLLHUP`, `EPOLLERR`, `EPOLLRDHUP` bits.
    func ready(_ events: UInt32)
}

// An event loop is a task executor too: the daemon's own asynchronous work (waiting for a
// shared store) runs on the loop that asked for it, not on the global cooperative pool.
extension IOLoop: TaskExecutor {
    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        execute { [unowned self] in job.runSynchronously(on: self.asUnownedTaskExecutor()) }
    }
}

/// Identifies a scheduled timer, to cancel it.
struct TimerID: Hashable {
    fileprivate let value: UInt64
}

final class IOLoop: @unchecked Sendable {
    // @unchecked Sendable: `posted` is behind a lock (`Locked`) and the descriptors are
    // immutable; every other stored property is read and written only on the loop's thread (by
    // `runOnce`, and by the handlers, tasks and timers it calls), which `assertInLoop` checks
    // in debug builds.

    let index: Int
    private let epoll: Int32
    private let wake: Int32

    private struct Posted {
        var tasks: [@Sendable () -> Void] = []
        /// The eventfd was written and not yet drained: no further write is needed.
        var woken = false
        var stopping = false
    }

    private let posted = Locked(Posted())

    // Loop-confined from here on.

    /// Handlers by slot (the slot travels in epoll's data); freed slots are reused.
    private var handlers: [IOHandler?] = []
    private var freeSlots: [Int] = []
    private var events: UnsafeMutablePointer<epoll_event>
    private let eventCapacity = 256
    private var timers = TimerHeap()
    private var localTasks: [() -> Void] = []
    private var tickRequested = false
    /// The thread running the loop (set by `runOnce`).
    private var owner: pthread_t?
    /// Where time comes from (monotonic nanoseconds); in-process tests move it by hand.
    private let clock: @Sendable () -> UInt64
    /// The time of the current iteration.
    private(set) var now: UInt64
    /// How long a wait polls before it blocks (BusyPoll.swift); off unless the daemon's loop.
    private var busyPoll: BusyPoll
    /// The time now, from any thread (`now` is the iteration's).
    var currentTime: UInt64 { clock() }
    /// The wall clock at the current iteration, in seconds since 1970 (revisions' times): read
    /// once per iteration, not once per write.
    private(set) var wallSeconds: Int64 = WallClock.unixSeconds()
    /// Read buffer shared by the loop's connections: a connection keeps only the bytes of a
    /// line a read cut in two.
    let readBuffer: UnsafeMutableRawBufferPointer

    /// Run at the end of an iteration that asked for a tick (`requestTick`).
    var onTick: (() -> Void)?
    /// Run at the end of every iteration, before the tick (the store commits the writes the
    /// iteration made: what it reports durable is delivered by the same tick).
    var beforeTick: (() -> Void)?

    /// A loop; `busyPoll` nanoseconds the most its waits poll before they block (0: never;
    /// only with the monotonic clock: polling waits for `clock` to move).
    init(index: Int, clock: @escaping @Sendable () -> UInt64 = IOLoop.monotonicNow, busyPoll: UInt64 = 0) throws(SocketError) {
        self.index = index
        self.clock = clock
        self.now = clock()
        self.busyPoll = BusyPoll(limit: busyPoll)
        epoll = epoll_create1(Int32(EPOLL_CLOEXEC))
        guard epoll >= 0 else { throw SocketError.from(errno, "cannot create an epoll set") }
        wake = eventfd(0, Int32(EFD_NONBLOCK | EFD_CLOEXEC))
        guard wake >= 0 else {
            let e = errno
            close(epoll)
            throw SocketError.from(e, "cannot create an eventfd")
        }
        events = .allocate(capacity: eventCapacity)
        readBuffer = .allocate(byteCount: 256 << 10, alignment: 16)
        var event = epoll_event()
        event.events = EPOLLIN.rawValue
        event.data.u64 = UInt64.max
        epoll_ctl(epoll, EPOLL_CTL_ADD, wake, &event)
    }

    deinit {
        close(wake)
        close(epoll)
        events.deallocate()
        readBuffer.deallocate()
    }

    // MARK: Any thread

    /// Runs `task` on the loop, soon; from any thread.
    func execute(_ task: @escaping @Sendable () -> Void) {
        let write = posted.withLock { p -> Bool in
            p.tasks.append(task)
            defer { p.woken = true }
            return !p.woken
        }
        if write { signal() }
    }

    /// Makes `run` return after the current iteration; from any thread.
    func stop() {
        posted.withLock { $0.stopping = true }
        signal()
    }

    private func signal() {
        var one: UInt64 = 1
        _ = Glibc.write(wake, &one, 8)
    }

    /// Whether the caller runs on the loop's thread.
    var inLoop: Bool {
        guard let owner else { return false }
        return pthread_equal(owner, pthread_self()) != 0
    }

    func assertInLoop(file: StaticString = #fileID, line: UInt = #line) {
        assert(owner == nil || inLoop, "not on event loop \(index)", file: file, line: line)
    }

    // MARK: The loop's thread

    /// Runs iterations until `stop`.
    func run() {
        while !posted.withLock({ $0.stopping }) { runOnce(maxWait: 1000) }
        runTasks()
    }

    /// Runs one iteration, waiting at most `maxWait` milliseconds for readiness (0: not at
    /// all). Returns whether it did anything (in-process tests run a loop until it is idle).
    @discardableResult
    func runOnce(maxWait: Int32 = 0) -> Bool {
        owner = pthread_self()
        var timeout = maxWait
        if tickRequested || !localTasks.isEmpty || posted.withLock({ !$0.tasks.isEmpty }) {
            timeout = 0
        } else if let next = timers.nextDeadline {
            let wait = next > now ? Int32(clamping: (next - now + 999_999) / 1_000_000) : 0
            timeout = timeout < 0 ? wait : min(timeout, wait)
        }
        let n = timeout == 0 ? epoll_wait(epoll, events, Int32(eventCapacity), 0) : wait(timeout)
        now = clock()
        var wall = timespec()
        clock_gettime(CLOCK_REALTIME_COARSE, &wall)
        wallSeconds = Int64(wall.tv_sec)
        var worked = n > 0
        if n > 0 {
            for i in 0..<Int(n) {
                let event = events[i]
                if event.data.u64 == UInt64.max {
                    var count: UInt64 = 0
                    _ = Glibc.read(wake, &count, 8)
                    continue
                }
                let slot = Int(event.data.u64)
                if slot < handlers.count, let handler = handlers[slot] { handler.ready(event.events) }
            }
        }
        worked = runTasks() || worked
        while let task = timers.popDue(now: now) {
            task()
            worked = true
        }
        beforeTick?()
        if tickRequested {
            tickRequested = false
            onTick?()
            worked = true
        }
        return worked
    }

    /// Waits for readiness for at most `timeout` milliseconds (-1: no limit), polling first
    /// for as long as `busyPoll` says (BusyPoll.swift).
    private func wait(_ timeout: Int32) -> Int32 {
        guard busyPoll.limit > 0 else { return epoll_wait(epoll, events, Int32(eventCapacity), timeout) }
        let start = clock()
        var n: Int32 = 0
        if busyPoll.window > 0 {
            let window = timeout < 0 ? busyPoll.window : min(busyPoll.window, UInt64(timeout) * 1_000_000)
            repeat {
                n = epoll_wait(epoll, events, Int32(eventCapacity), 0)
            } while n == 0 && clock() &- start < window
        }
        if n == 0 { n = epoll_wait(epoll, events, Int32(eventCapacity), timeout) }
        busyPoll.waited(clock() &- start, woken: n > 0)
        return n
    }

    @discardableResult
    private func runTasks() -> Bool {
        let tasks = posted.withLock { p -> [@Sendable () -> Void] in
            p.woken = false
            var tasks: [@Sendable () -> Void] = []
            swap(&tasks, &p.tasks)
            return tasks
        }
        for task in tasks { task() }
        var worked = !tasks.isEmpty
        while !localTasks.isEmpty {
            var local: [() -> Void] = []
            swap(&local, &localTasks)
            for task in local { task() }
            worked = true
        }
        return worked
    }

    /// Asks for a tick at the end of this iteration (or the next one).
    func requestTick() {
        tickRequested = true
    }

    /// Runs `task` on the loop after what is running now (loop thread only).
    func executeSoon(_ task: @escaping () -> Void) {
        assertInLoop()
        localTasks.append(task)
    }

    // MARK: Descriptors

    /// Watches `fd` for `events` (EPOLLIN, EPOLLOUT, …); returns the registration's slot.
    func register(_ fd: Int32, _ handler: IOHandler, events: UInt32) throws(SocketError) -> Int {
        let slot: Int
        if let free = freeSlots.popLast() {
            slot = free
            handlers[slot] = handler
        } else {
            slot = handlers.count
            handlers.append(handler)
        }
        var event = epoll_event()
        event.events = events
        event.data.u64 = UInt64(slot)
        guard epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event) == 0 else {
            let e = errno
            handlers[slot] = nil
            freeSlots.append(slot)
            throw SocketError.from(e, "cannot watch a socket")
        }
        return slot
    }

    /// Changes what `fd` (registered at `slot`) is watched for.
    func modify(_ fd: Int32, slot: Int, events: UInt32) {
        var event = epoll_event()
        event.events = events
        event.data.u64 = UInt64(slot)
        epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &event)
    }

    /// Stops watching `fd` (before it is closed).
    func deregister(_ fd: Int32, slot: Int) {
        epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nil)
        handlers[slot] = nil
        freeSlots.append(slot)
    }

    // MARK: Timers

    /// Runs `task` on the loop once `delay` nanoseconds have passed.
    @discardableResult
    func schedule(in delay: UInt64, _ task: @escaping () -> Void) -> TimerID {
        TimerID(value: timers.schedule(at: now &+ delay, task))
    }

    func cancel(_ timer: TimerID) {
        timers.cancel(timer.value)
    }

    static func monotonicNow() -> UInt64 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return UInt64(ts.tv_sec) * 1_000_000_000 + UInt64(ts.tv_nsec)
    }
}

/// A deadline (monotonic nanoseconds) and what it is for, ordered by time (then id).
struct Deadline: Comparable, Sendable {
    let time: UInt64
    let id: UInt64

    static func < (a: Deadline, b: Deadline) -> Bool { (a.time, a.id) < (b.time, b.id) }
}

/// Timers by deadline: a heap (swift-collections); a cancelled timer's task is dropped, its
/// entry stays until it comes up.
struct TimerHeap {
    private var heap = Heap<Deadline>()
    private var tasks: [UInt64: () -> Void] = [:]
    private var nextID: UInt64 = 0

    var nextDeadline: UInt64? {
        mutating get {
            while let top = heap.min, tasks[top.id] == nil { heap.removeMin() }
            return heap.min?.time
        }
    }

    mutating func schedule(at deadline: UInt64, _ task: @escaping () -> Void) -> UInt64 {
        nextID += 1
        tasks[nextID] = task
        heap.insert(Deadline(time: deadline, id: nextID))
        return nextID
    }

    mutating func cancel(_ id: UInt64) {
        tasks[id] = nil
    }

    /// The task of a timer due at `now`, removed; nil when none is due.
    mutating func popDue(now: UInt64) -> (() -> Void)? {
        while let top = heap.min, top.time <= now {
            heap.removeMin()
            if let task = tasks.removeValue(forKey: top.id) { return task }
        }
        return nil
    }
}
