// obsbench — `Histogram`: latencies in nanoseconds, counted in log-linear buckets (64 per
// power of two above 128 ns, exact below), so recording is an index computation and an
// increment and a percentile is read with < 1.6 % relative error. Fixed size (about
// 30 KiB), allocated once.

/// A latency histogram; one owner, freed with it.
struct Histogram: ~Copyable {
    /// Values below 2^linearBits are counted exactly; above, 2^(linearBits-1) buckets per octave.
    private static let linearBits = 7
    private static let perOctave = 1 << (linearBits - 1)
    private static let bucketCount = (1 << linearBits) + (64 - linearBits) * perOctave

    private let buckets: UnsafeMutablePointer<UInt64>
    private(set) var count: UInt64 = 0
    private(set) var max: UInt64 = 0

    init() {
        buckets = .allocate(capacity: Self.bucketCount)
        buckets.initialize(repeating: 0, count: Self.bucketCount)
    }

    deinit { buckets.deallocate() }

    mutating func reset() {
        buckets.update(repeating: 0, count: Self.bucketCount)
        count = 0
        max = 0
    }

    @inline(__always)
    mutating func record(_ nanoseconds: UInt64) {
        buckets[Self.index(nanoseconds)] &+= 1
        count &+= 1
        if nanoseconds > max { max = nanoseconds }
    }

    @inline(__always)
    private static func index(_ v: UInt64) -> Int {
        if v < 1 << linearBits { return Int(v) }
        let shift = (63 - v.leadingZeroBitCount) - (linearBits - 1)  // v >> shift is in [perOctave, 2*perOctave)
        return (1 << linearBits) + (shift - 1) * perOctave + Int(v >> UInt64(shift)) - perOctave
    }

    /// The smallest and largest value counted in bucket `i`.
    private static func bounds(_ i: Int) -> (UInt64, UInt64) {
        if i < 1 << linearBits { return (UInt64(i), UInt64(i)) }
        let shift = UInt64((i - (1 << linearBits)) / perOctave + 1)
        let mantissa = UInt64((i - (1 << linearBits)) % perOctave + perOctave)
        return (mantissa &<< shift, ((mantissa &+ 1) &<< shift) &- 1)
    }

    /// The value at quantile `q` (0…1) in nanoseconds: the middle of its bucket, at most `max`.
    func percentile(_ q: Double) -> Double {
        guard count > 0 else { return 0 }
        let rank = Swift.max(1, Swift.min(count, UInt64((q * Double(count)).rounded(.up))))
        var seen: UInt64 = 0
        for i in 0..<Self.bucketCount {
            seen += buckets[i]
            if seen >= rank {
                let (low, high) = Self.bounds(i)
                return Swift.min(Double(max), (Double(low) + Double(high)) / 2)
            }
        }
        return Double(max)
    }

    /// `p50-us=… p99-us=… p999-us=…` (with `prefix` before each name), in microseconds.
    func summary(prefix: String = "") -> String {
        func us(_ q: Double) -> String { fmt(percentile(q) / 1000) }
        return "\(prefix)p50-us=\(us(0.5)) \(prefix)p99-us=\(us(0.99)) \(prefix)p999-us=\(us(0.999)) \(prefix)max-us=\(fmt(Double(max) / 1000))"
    }
}
