// obsctl — `stats --prometheus`: the daemon's `stats` and `repos` replies as Prometheus
// metrics (their names, types and help), and `--output`, which replaces a file atomically
// (for node_exporter's textfile collector, which may read it at any moment).

import ObsClient
import ObsProtocol

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// How the daemon's counters read as Prometheus metrics.
///
/// Known `stats` fields have a name, a type and help of their own (`known`). A numeric
/// field this obsctl does not know — one a newer daemon added — becomes the gauge
/// `obsd_<field in snake_case>` with a generic help, so nothing is dropped silently;
/// fields that are not numbers (`peer`, `server`, `storage`, `clients`, `reloadError`) are
/// left out, except `server`, which gives `obsd_info{version="…"}`, and so is `pid` (an
/// identity, not a measurement). A field the reply does not have (an unprivileged caller gets
/// only `connections`, `subscriptions` and `repos`) is not written.
enum StatsExposition {
    typealias MetricType = PrometheusExposition.MetricType

    /// A `stats` field this obsctl knows, and the metric it becomes.
    struct Known: Sendable {
        let field: String
        let metric: String
        let type: MetricType
        let help: String
    }

    /// The known fields, in the order their metrics are written.
    static let known: [Known] = [
        Known(field: "connections", metric: "obsd_connections", type: .gauge,
              help: "Connections open now (for an unprivileged caller: its own uid's)."),
        Known(field: "subscriptions", metric: "obsd_subscriptions", type: .gauge,
              help: "Live subscriptions now (for an unprivileged caller: its own connection's)."),
        Known(field: "repos", metric: "obsd_repositories", type: .gauge,
              help: "Repositories (for an unprivileged caller: those it may read)."),
        Known(field: "uptimeSeconds", metric: "obsd_uptime_seconds", type: .gauge, help: "Seconds since obsd started."),
        Known(field: "connectionsTotal", metric: "obsd_connections_accepted_total", type: .counter,
              help: "Connections accepted since obsd started."),
        Known(field: "connectionsRefused", metric: "obsd_connections_refused_total", type: .counter,
              help: "Connections refused at a connection limit since obsd started."),
        Known(field: "requests", metric: "obsd_requests_total", type: .counter, help: "Requests read since obsd started."),
        Known(field: "writes", metric: "obsd_writes_total", type: .counter,
              help: "Writes that changed something since obsd started."),
        Known(field: "eventsOut", metric: "obsd_events_sent_total", type: .counter,
              help: "Events sent to subscribers since obsd started."),
        Known(field: "bytesOut", metric: "obsd_sent_bytes_total", type: .counter,
              help: "Bytes sent to clients (replies and events) since obsd started."),
        Known(field: "overflows", metric: "obsd_overflows_total", type: .counter,
              help: "Connections cut off for reading too slowly (overflow) since obsd started."),
        Known(field: "writersHeld", metric: "obsd_writers_held_total", type: .counter,
              help: "Times a writer was held until the fan-out caught up (delivery backlog) since obsd started."),
        Known(field: "repositoriesHeld", metric: "obsd_repositories_held", type: .gauge,
              help: "Repository objects in memory: those that exist, and placeholders for subscriptions and writes under way."),
        Known(field: "leases", metric: "obsd_leases", type: .gauge, help: "Live leases (keys that live as long as their owner)."),
        Known(field: "errors", metric: "obsd_errors_total", type: .counter, help: "Error replies since obsd started."),
        Known(field: "denied", metric: "obsd_denied_total", type: .counter,
              help: "Requests refused as forbidden since obsd started."),
        Known(field: "storageCommits", metric: "obsd_storage_commits_total", type: .counter,
              help: "Groups of writes the store committed to its write-ahead log since obsd started."),
        Known(field: "storageFsyncs", metric: "obsd_storage_fsyncs_total", type: .counter,
              help: "Times the store synced its files to disk since obsd started."),
        Known(field: "storageRecords", metric: "obsd_storage_records_total", type: .counter,
              help: "Revisions the store recorded since obsd started."),
        Known(field: "storageFailures", metric: "obsd_storage_failures_total", type: .counter,
              help: "Writes to or syncs of the write-ahead log that failed since obsd started."),
        Known(field: "storageCheckpoints", metric: "obsd_storage_checkpoints_total", type: .counter,
              help: "Batches of durable writes applied to the compacted state since obsd started."),
        Known(field: "storageCheckpointFailures", metric: "obsd_storage_checkpoint_failures_total", type: .counter,
              help: "Batches the compacted state could not take (retried; the log keeps them) since obsd started."),
        Known(field: "reloads", metric: "obsd_reloads_total", type: .counter,
              help: "Configuration reloads (SIGHUP) that ended since obsd started, applied or not."),
        Known(field: "reloadFailures", metric: "obsd_reload_failures_total", type: .counter,
              help: "Configuration reloads that kept the running settings (the file was invalid) since obsd started."),
    ]

    /// Numeric `stats` fields that are not metrics.
    static let notMetrics: Set<String> = ["pid"]

    static let upHelp = "Whether obsctl read obsd's counters (1) or not (0: obsd is down, or the connection failed)."

    /// The metrics of a daemon that answered: `obsd_up 1`, `obsd_info`, the counters in
    /// `stats`, then each repository of `repos` with its revision and number of keys (label
    /// `repo`) — `stats --prometheus` passes none unless `--per-repository` asks for them.
    ///
    /// - Parameter warn: told, in a sentence, about each field left out for a reason other
    ///   than not being a number (a known field that is not one, a name already taken).
    static func metrics(stats typed: Stats, repos: [RepositoryInfo], warn: (String) -> Void) -> PrometheusExposition {
        // By field name, so that a counter a newer daemon adds (kept in `otherCounters`)
        // reads exactly as a known one.
        let stats = typed.jsonObject
        var out = PrometheusExposition()
        func add(_ name: String, _ type: MetricType, _ help: String, _ samples: [PrometheusExposition.Sample]) {
            do {
                try out.add(name, type, help: help, samples: samples)
            } catch {
                warn("left out \(name): \(error)")
            }
        }
        add("obsd_up", .gauge, upHelp, [.init(1)])
        if let server = stats["server"]?.stringValue {
            let version = server.hasPrefix("obsd/") ? String(server.dropFirst("obsd/".count)) : server
            add("obsd_info", .gauge, "obsd's version; always 1.", [.init(labels: [("version", version)], 1)])
        }
        let knownFields = Set(known.map(\.field))
        for k in known {
            guard let value = stats[k.field] else { continue }
            guard let number = value.doubleValue else {
                warn("left out \(k.metric): the stats field \(k.field) is a \(value.typeName), not a number")
                continue
            }
            add(k.metric, k.type, k.help, [.init(number)])
        }
        for member in stats.members where !knownFields.contains(member.name) && !notMetrics.contains(member.name) {
            guard let number = member.value.doubleValue else { continue }
            add(
                "obsd_" + snakeCase(member.name), .gauge,
                "The stats field \(member.name), which this obsctl does not know (written as a gauge).", [.init(number)])
        }
        if !repos.isEmpty {
            add(
                "obsd_repository_revision", .gauge, "The repository's revision (its last change).",
                repos.map { .init(labels: [("repo", $0.name)], Double($0.revision)) })
            add(
                "obsd_repository_keys", .gauge, "Keys in the repository.",
                repos.map { .init(labels: [("repo", $0.name)], Double($0.keys)) })
        }
        return out
    }

    /// The metrics of a daemon that could not be read: `obsd_up 0` alone.
    static func down() -> PrometheusExposition {
        var out = PrometheusExposition()
        // A fixed, valid name: cannot fail.
        try? out.add("obsd_up", .gauge, help: upHelp, value: 0)
        return out
    }

    /// A field name as a metric name's part: `storageCommits` → `storage_commits`,
    /// `HTTPRequests` → `http_requests`; anything but ASCII letters, digits and `_` becomes `_`.
    static func snakeCase(_ field: String) -> String {
        func isUpper(_ s: Unicode.Scalar) -> Bool { ("A"..."Z").contains(s) }
        func isLower(_ s: Unicode.Scalar) -> Bool { ("a"..."z").contains(s) }
        func isDigit(_ s: Unicode.Scalar) -> Bool { ("0"..."9").contains(s) }
        let scalars = Array(field.unicodeScalars)
        var out = ""
        for (i, s) in scalars.enumerated() {
            if isUpper(s) {
                if i > 0 {
                    let previous = scalars[i - 1]
                    let nextIsLower = i + 1 < scalars.count && isLower(scalars[i + 1])
                    if isLower(previous) || isDigit(previous) || (isUpper(previous) && nextIsLower) { out += "_" }
                }
                out += String(s).lowercased()
            } else if isLower(s) || isDigit(s) || s == "_" {
                out.unicodeScalars.append(s)
            } else {
                out += "_"
            }
        }
        return out
    }
}

/// Why `--output` could not be written.
struct OutputFileError: Error, CustomStringConvertible {
    let description: String
}

/// Replaces the file at `path` with `text` atomically: a reader sees the old file or the
/// new one, whole, never a part. The text goes to a temporary file in the same directory
/// (`.NAME.XXXXXX`: hidden, and not `*.prom`, so node_exporter's textfile collector does
/// not read it) that is renamed over `path` once complete; the temporary file is removed
/// if anything fails. The file gets mode 0644 (node_exporter runs as another user). It is
/// not fsynced: it is rewritten every few seconds, and a crash loses nothing worth keeping.
func writeAtomically(_ text: String, to path: String) throws(OutputFileError) {
    let slash = path.lastIndex(of: "/")
    let directory = slash.map { $0 == path.startIndex ? "/" : String(path[..<$0]) } ?? "."
    let name = slash.map { String(path[path.index(after: $0)...]) } ?? path
    guard !name.isEmpty else { throw OutputFileError(description: "cannot write \(path): not a file name") }
    var template = Array(((directory == "/" ? "/" : directory + "/") + ".\(name).XXXXXX").utf8CString)
    let fd = template.withUnsafeMutableBufferPointer { mkstemp($0.baseAddress!) }
    guard fd >= 0 else {
        throw OutputFileError(description: "cannot create a temporary file in \(directory): \(String(cString: strerror(errno)))")
    }
    let temporary = template.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
    func failed(_ what: String) -> OutputFileError {
        let reason = String(cString: strerror(errno))
        close(fd)
        unlink(temporary)
        return OutputFileError(description: "cannot write \(path): \(what): \(reason)")
    }
    var bytes = Array(text.utf8)
    let complete = bytes.withUnsafeMutableBytes { buffer -> Bool in
        var offset = 0
        while offset < buffer.count {
            let n = write(fd, buffer.baseAddress! + offset, buffer.count - offset)
            if n < 0 {
                if errno == EINTR { continue }
                return false
            }
            offset += n
        }
        return true
    }
    guard complete else { throw failed("write") }
    guard fchmod(fd, 0o644) == 0 else { throw failed("fchmod") }
    guard close(fd) == 0 else {
        let reason = String(cString: strerror(errno))
        unlink(temporary)
        throw OutputFileError(description: "cannot write \(path): close: \(reason)")
    }
    guard rename(temporary, path) == 0 else {
        let reason = String(cString: strerror(errno))
        unlink(temporary)
        throw OutputFileError(description: "cannot replace \(path): \(reason)")
    }
}
