// obsctl — `watch --exec`: a command run for each changed key, one run at a time, with the
// change in its environment; with `--coalesce`, the changes that arrive while it runs fold
// into one run per key with the latest state (a debounce), so a burst of writes costs a few
// runs and the last one sees the final value. After `--since`, a key caught up or reset runs
// it too, marked (OBSD_CATCHUP, OBSD_RESET).

import ArgumentParser
import ObsClient
import ObsProtocol
import ObservableKit
import Subprocess

/// One run of the command: a key's change, or — folded — its changes from `old` to `new`.
struct ExecRun: Sendable {
    let key: Key
    /// The value before (nil: the key did not exist), and after (nil: deleted).
    var old: JSONValue?
    var new: JSONValue?
    /// The revision the run is at, and the first revision it covers (when it covers several).
    var revision: UInt64
    var from: UInt64?
    var by: Writer?
    /// For a deletion by a lease's end: which lease, and why.
    var lease: LeaseEnd?
    /// The key as a catch-up or a reset after `--since` listed it: its earlier value is not known.
    var catchUp = false
    var reset = false

    /// Folds a later change of the same key into this run: the old value stays, the rest is the later one's.
    mutating func fold(_ later: ExecRun) {
        from = from ?? revision
        new = later.new
        revision = later.revision
        by = later.by
        lease = later.lease
        catchUp = catchUp || later.catchUp
        reset = reset || later.reset
    }

    /// The runs an event makes: one per change, in the event's order; one per key of a
    /// snapshot, or of a catch-up, in byte order of the keys. `reset`: the snapshot replaces
    /// what the watch had (after `--since`).
    static func runs(of event: SubscriptionEvent, reset: Bool = false) -> [ExecRun] {
        switch event {
        case .snapshot(let rev, let values):
            return values.keys.sorted().map { ExecRun(key: $0, old: nil, new: values[$0], revision: rev, reset: reset) }
        case .change(let e):
            return e.changes.map {
                ExecRun(key: $0.key, old: $0.old, new: $0.new, revision: e.revision, from: e.from, by: e.by, lease: $0.new == nil ? e.lease : nil)
            }
        case .catchUp(let diff):
            let runs =
                diff.entries.map { ExecRun(key: $0.key, old: nil, new: $0.value, revision: diff.revision, catchUp: true) }
                + diff.deleted.map { ExecRun(key: $0, old: nil, new: nil, revision: diff.revision, catchUp: true) }
            return runs.sorted { $0.key < $1.key }
        case .synced:
            return []
        }
    }

    /// The command's environment: obsctl's, with the run's variables set and the absent ones removed.
    func environment(repo: String, epoch: String) -> Environment {
        var names: [Environment.Key: String?] = [
            "OBSD_REPO": repo, "OBSD_KEY": key.string, "OBSD_REV": String(revision), "OBSD_EPOCH": epoch,
            "OBSD_OLD": old?.jsonText, "OBSD_NEW": new?.jsonText, "OBSD_FROM": from.map { String($0) },
            "OBSD_BY_UID": nil, "OBSD_BY_GID": nil, "OBSD_BY_PID": nil, "OBSD_LEASE": nil, "OBSD_LEASE_END": nil,
            "OBSD_CATCHUP": catchUp ? "1" : nil, "OBSD_RESET": reset ? "1" : nil,
        ]
        if let by {
            names["OBSD_BY_UID"] = String(by.uid)
            names["OBSD_BY_GID"] = String(by.gid)
            names["OBSD_BY_PID"] = String(by.pid)
        }
        if let lease {
            names["OBSD_LEASE"] = String(lease.lease)
            names["OBSD_LEASE_END"] = lease.reason.rawValue
        }
        return .inherit.updating(names)
    }
}

/// The runs waiting while the command runs, folded by key (memory bounded by the keys watched).
final class ExecQueue: Sendable {
    private struct State {
        var pending: [Key: ExecRun] = [:]
        var finished = false
        var waiter: CheckedContinuation<[ExecRun]?, Never>?
    }

    private let state = Locked(State())

    /// Adds runs, folding each into the one waiting for its key.
    func add(_ runs: [ExecRun]) {
        guard !runs.isEmpty else { return }
        let (waiter, batch): (CheckedContinuation<[ExecRun]?, Never>?, [ExecRun]) = state.withLock { s in
            for run in runs {
                if s.pending[run.key] != nil { s.pending[run.key]!.fold(run) } else { s.pending[run.key] = run }
            }
            guard let waiter = s.waiter else { return (nil, []) }
            s.waiter = nil
            return (waiter, Self.drain(&s.pending))
        }
        waiter?.resume(returning: batch)
    }

    /// No more runs come; `next` returns what is left, then nil.
    func finish() {
        let waiter = state.withLock { s in
            s.finished = true
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume(returning: nil)
    }

    /// The folded runs waiting (at least one), in byte order of their keys; nil once finished.
    func next() async -> [ExecRun]? {
        await withCheckedContinuation { (continuation: CheckedContinuation<[ExecRun]?, Never>) in
            let now: [ExecRun]?? = state.withLock { s in
                let batch = Self.drain(&s.pending)
                if !batch.isEmpty { return .some(batch) }
                if s.finished { return .some(nil) }
                s.waiter = continuation
                return .none
            }
            if let now { continuation.resume(returning: now) }
        }
    }

    /// Takes the waiting runs, leaving out keys that changed and changed back (as the daemon's
    /// coalescing does).
    private static func drain(_ pending: inout [Key: ExecRun]) -> [ExecRun] {
        defer { pending = [:] }
        return pending.values.filter { $0.from == nil || $0.old != $0.new }.sorted { $0.key < $1.key }
    }
}

extension Obsctl.Watch {
    /// Follows `events`, running `exec` for each changed key, one at a time; with
    /// `coalesce`, folding what arrives while it runs.
    func runCommand(for events: ShownEvents) async throws {
        let epoch = events.subscription.epoch
        let reset = events.resume.isReset
        guard coalesce else {
            for try await event in events {
                for run in ExecRun.runs(of: event, reset: reset) { try await execute(run, epoch: epoch) }
            }
            return
        }
        let queue = ExecQueue()
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask {
                while let batch = await queue.next() {
                    for run in batch { try await execute(run, epoch: epoch) }
                }
            }
            do {
                for try await event in events { queue.add(ExecRun.runs(of: event, reset: reset)) }
                queue.finish()
            } catch {
                queue.finish()
                throw error
            }
            try await group.waitForAll()
        }
    }

    /// Runs the command once; a status other than 0 is reported and the watch goes on. A command
    /// that cannot be started ends the watch (126 or 127).
    private func execute(_ run: ExecRun, epoch: String) async throws {
        do {
            let status = try await ChildCommand.run(exec, environment: run.environment(repo: repo, epoch: epoch), input: false)
            if !status.isSuccess { printError("\(exec[0]) \(status) for \(repo)/\(run.key.string) at revision \(run.revision)") }
        } catch {
            printError(error.message)
            throw ExitCode(Int32(error.status))
        }
    }
}
