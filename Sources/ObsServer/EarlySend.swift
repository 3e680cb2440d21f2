// ObsServer — when a connection sends the replies of a long pipelined read before the whole
// read is handled.
//
// A read can hold many pipelined requests. Sending their replies only once all of them are
// handled makes daemon and client take turns; sending them in runs lets the client send more
// while the rest are handled. Each send wakes the client, so a run is a quarter of the read's
// requests (guessed from the length of those handled so far), between 16 and 64, and a run
// goes out only while at least half a run more follows — the replies of a short rest go out
// with the tick's send anyway. Measured in one alternating run (busbench writes with 32, 64,
// 128 and 256 in flight, µs of daemon CPU per write): fixed runs of 32 took 1.52, 0.71, 0.58
// and 0.57, fixed runs of 16 1.33, 0.61, 0.61 and 0.62, quarters 1.34, 0.62, 0.57 and 0.58.
//
// While the loop's ticks write to many connections, runs are at least 32: a loop busy
// writing events does not wait for the writer, so more early sends only cost more sends
// (keyed delivery to 1,000 subscribers, 64 in flight: 1.74 µs per event with runs of 32, 1.82
// with runs of 16). And none at all while ticks deliver `heavyTick` events or more: there a
// writer sending shorter runs would cost more ticks, each writing to every subscriber (1,000
// subscribers: −15 %).

/// When the replies of a long pipelined read go out before the read is handled.
enum EarlySend {
    /// The shortest and longest run of replies sent together.
    static let runs = 16...64
    /// The shortest run while ticks write to more than `busyTickWrites` connections.
    static let busyRun = 32
    static let busyTickWrites = 8
    /// No early sends while ticks deliver this many events.
    static let heavyTick = 1024

    /// Whether the replies so far go out now: `sinceSend` requests were handled since the last
    /// send, `handled` of the read's, whose first `consumed` of `total` bytes they took;
    /// `tickWrites`: how many connections the loop's recent ticks wrote to.
    @inline(__always)
    static func due(sinceSend: Int, handled: Int, consumed: Int, of total: Int, tickWrites: Int) -> Bool {
        guard sinceSend >= runs.lowerBound, consumed > 0 else { return false }
        let least = tickWrites > busyTickWrites ? busyRun : runs.lowerBound
        let run = min(runs.upperBound, max(least, total * handled / consumed / 4))
        return sinceSend >= run && (total - consumed) * handled >= consumed * (run / 2)
    }
}
