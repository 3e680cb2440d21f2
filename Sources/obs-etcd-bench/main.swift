// obs-etcd-bench: latency of ObsEtcd against a running etcd cluster, for docs/etcd-notes.md
// (bench/etcd-bench.sh starts a 3-member cluster and runs it beside etcd's own tools).
// Not a test: it prints figures.
//
//   obs-etcd-bench --endpoints http://127.0.0.1:2379,http://127.0.0.1:22379 [-n 1000]
//
// Writes go to the first endpoint; the watcher reads from the last (another member when
// several are given). Measured, one operation at a time:
// - a compare-and-set txn (compare mod_revision, put): latency p50/p99 and rate;
// - a linearizable range of one key;
// - write → watch: from sending a put on the first member to its event arriving from the
//   last (the put's round trip included, as etcd's own client is measured in bench/etcd).

import ObsEtcd

#if canImport(Glibc)
import Glibc
#endif

func fail(_ message: String) -> Never {
    let line = Array("obs-etcd-bench: \(message)\n".utf8)
    _ = write(2, line, line.count)
    exit(64)
}

var endpoints: [String] = []
var count = 1000
var arguments = CommandLine.arguments.dropFirst()
while let argument = arguments.popFirst() {
    switch argument {
    case "--endpoints":
        guard let value = arguments.popFirst() else { fail("--endpoints needs URL[,URL…]") }
        endpoints = value.split(separator: ",").map(String.init)
    case "-n":
        guard let value = arguments.popFirst(), let n = Int(value), n > 0 else { fail("-n needs a positive count") }
        count = n
    default:
        fail("usage: obs-etcd-bench --endpoints URL[,URL…] [-n COUNT]")
    }
}
guard !endpoints.isEmpty else { fail("usage: obs-etcd-bench --endpoints URL[,URL…] [-n COUNT]") }

func milliseconds(_ d: Duration) -> Double {
    Double(d.components.seconds) * 1000 + Double(d.components.attoseconds) / 1e15
}

func report(_ name: String, _ samples: [Duration], elapsed: Duration? = nil) {
    let sorted = samples.sorted()
    func at(_ p: Double) -> String {
        let value = milliseconds(sorted[Int(Double(sorted.count - 1) * p)])
        return String(Int(value * 100) / 100) + "." + String(Int(value * 100) % 100).leftPadded(2)
    }
    var line = "\(name): n=\(samples.count) p50=\(at(0.5))ms p99=\(at(0.99))ms"
    if let elapsed { line += " \(Int(Double(samples.count) / (milliseconds(elapsed) / 1000)))/s" }
    print(line)
}

extension String {
    func leftPadded(_ width: Int) -> String { String(repeating: "0", count: max(0, width - count)) + self }
}

do {
    let writer = try EtcdClient(configuration: .init(endpoints: [endpoints[0]]))
    let reader = try EtcdClient(configuration: .init(endpoints: [endpoints[endpoints.count - 1]]))
    let clock = ContinuousClock()

    // Compare-and-set txns, one after the other.
    let key = Array("/bench/obsetcd/txn".utf8)
    var revision = try await writer.put(key, Array("0".utf8)).revision
    var samples: [Duration] = []
    let started = clock.now
    for i in 0..<count {
        let t = clock.now
        let result = try await writer.txn(
            compare: [.modRevision(key, .equal, revision)], success: [.put(key: key, value: Array("\(i)".utf8))])
        guard result.succeeded else { fail("a compare-and-set failed: another writer?") }
        revision = result.revision
        samples.append(clock.now - t)
    }
    report("gateway txn(compare mod_revision + put) sequential", samples, elapsed: clock.now - started)

    samples.removeAll()
    for _ in 0..<count {
        let t = clock.now
        _ = try await writer.range(key)
        samples.append(clock.now - t)
    }
    report("gateway range (linearizable, 1 key) sequential", samples)

    // Write on the first member, event from the last.
    let watchKey = Array("/bench/obsetcd/watch".utf8)
    let start = try await writer.put(watchKey, Array("start".utf8)).revision
    var events = reader.watch(watchKey, startRevision: start + 1).makeAsyncIterator()
    samples.removeAll()
    for i in 0..<count {
        let t = clock.now
        let written = try await writer.put(watchKey, Array("\(i)".utf8)).revision
        guard let response = try await events.next(), response.revision == written else { fail("the watch lost an event") }
        samples.append(clock.now - t)
    }
    report("gateway put -> watcher on \(endpoints[endpoints.count - 1])", samples)
    await writer.shutdown()
    await reader.shutdown()
} catch {
    fail("\(error)")
}
