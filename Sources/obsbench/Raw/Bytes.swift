// obsbench — `Bytes`: a growable byte buffer in manually managed memory, and decimal
// digits written straight into it. The load generator's buffers (requests waiting to be
// written, the tail of a frame that a read cut in two) grow a few times at start and are
// then reused for the whole run: nothing is allocated per request or per event.

#if canImport(Glibc)
import Glibc
#endif

/// A growable run of bytes; its owner frees it (`release()`) exactly once.
struct Bytes {
    private(set) var base: UnsafeMutablePointer<UInt8>
    private(set) var capacity: Int
    /// Bytes in use, from `base`.
    var count = 0

    init(capacity: Int) {
        self.capacity = max(capacity, 16)
        base = .allocate(capacity: self.capacity)
    }

    func release() { base.deallocate() }

    /// Makes room for `extra` more bytes after `count`.
    @inline(__always)
    mutating func reserve(_ extra: Int) {
        if count &+ extra > capacity { grow(to: count &+ extra) }
    }

    private mutating func grow(to needed: Int) {
        var newCapacity = capacity * 2
        while newCapacity < needed { newCapacity *= 2 }
        let newBase = UnsafeMutablePointer<UInt8>.allocate(capacity: newCapacity)
        newBase.update(from: base, count: count)
        base.deallocate()
        base = newBase
        capacity = newCapacity
    }

    @inline(__always)
    mutating func append(_ bytes: UnsafePointer<UInt8>, count n: Int) {
        reserve(n)
        (base + count).update(from: bytes, count: n)
        count &+= n
    }

    mutating func append(_ bytes: [UInt8]) {
        bytes.withUnsafeBufferPointer { if let b = $0.baseAddress { append(b, count: $0.count) } }
    }
}

/// The number of decimal digits of `value` (≥ 0).
@inline(__always)
func decimalDigits(_ value: Int) -> Int {
    var n = 1
    var rest = value
    while rest >= 10 {
        rest /= 10
        n &+= 1
    }
    return n
}

/// Writes `value` (≥ 0) as `digits` decimal digits at `out`.
@inline(__always)
func writeDecimal(_ value: Int, digits: Int, at out: UnsafeMutablePointer<UInt8>) {
    var rest = value
    var i = digits &- 1
    while i >= 0 {
        out[i] = UInt8(truncatingIfNeeded: 48 &+ rest % 10)
        rest /= 10
        i &-= 1
    }
}

/// Monotonic time in nanoseconds (CLOCK_MONOTONIC, through the vDSO: no system call).
@inline(__always)
func monotonicNanoseconds() -> UInt64 {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return UInt64(ts.tv_sec) &* 1_000_000_000 &+ UInt64(ts.tv_nsec)
}
