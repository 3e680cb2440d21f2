// obsctl — `watch`: follow changes of keys, a prefix, or a whole repository; print them, or
// run a command for each (`--exec`, WatchExec.swift). `--since` resumes with `catchup`: it
// never fails for a history that no longer reaches back — the daemon sends the keys that
// changed (printed "(caught up)") or, from another history, the current values (printed
// "(reset)"); a daemon without catch-up answers `compacted`, and obsctl then shows the
// current values as a reset itself. `--strict` keeps the plain `since` (exit 4 on `compacted`).

import ArgumentParser
import ObsClient
import ObsProtocol
import ObservableKit

extension Obsctl {
    struct Watch: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Print changes as they happen.",
            discussion: """
                Human output, one line per changed key:  REV  REPO/KEY  OLD → NEW
                (OLD is (none) for a creation, NEW is (deleted) for a deletion — or, when the key went away because its
                lease ended, why: (expired), (revoked) or (closed); --initial lines read REV  REPO/KEY  = VALUE).
                With --json, one object per changed key: {"repo","key","rev","old","new","from","by","lease","epoch"}, with
                "old", "new", "from", "by" and "lease" present exactly as in the protocol; --initial values come as {"repo","key","rev","new","snapshot":true,"epoch"},
                and the end of a --since replay as {"repo","rev","synced":true,"epoch"}.
                To resume where a watch stopped, pass the last line's rev and epoch: --since REV --epoch EPOCH. The watch
                replays what followed; if the daemon's history no longer reaches back that far, it prints instead the keys
                that changed since, as they are now — REV  REPO/KEY  = VALUE  (caught up), or REV  REPO/KEY  (deleted)  (caught up);
                JSON: one {"repo","rev","from","catchup":true,"values":{…},"deleted":[…],"epoch"} — and if the history is
                not that epoch any more (the daemon lost or replaced it), the current values — REV  REPO/KEY  = VALUE  (reset);
                JSON: one {"repo","rev","reset":true,"values":{…},"epoch"}: drop every key it does not list. Either way the
                "synced" line follows, then live changes: a resume never fails. (A daemon without catch-up answers
                compacted; obsctl then prints the current values as a reset itself.) --strict resumes only by replaying:
                past the history or from another epoch, obsctl says so and exits 4 (compacted).
                --coalesce asks for state rather than every change: while obsctl reads too slowly, the daemon sends one
                change per key whose value differs from the last one printed (human: (coalesced FROM…REV) after the line;
                JSON: "from":FROM), and never cuts the watch off for reading slowly. It cannot go with --once.
                --once exits after the first change; after --since, a catch-up that lists a key, or a reset, counts as one.
                --writers shows who wrote each change (human: by uid U pid P; JSON: "by":{"uid","gid","pid"}).
                --no-echo leaves out changes written on the watch's own connection (obsctl watch writes nothing on it; the
                flag is there to try the option).
                --exec COMMAND [ARGS...] (last: everything after it is the command) runs COMMAND for each changed key instead
                of printing, one run at a time, with OBSD_REPO, OBSD_KEY, OBSD_REV, OBSD_EPOCH, OBSD_OLD and OBSD_NEW (JSON;
                unset when the key did not exist before, or does not after) in its environment; OBSD_LEASE and
                OBSD_LEASE_END (expired, revoked, closed) when a lease's end deleted the key; with --writers, OBSD_BY_UID,
                OBSD_BY_GID and OBSD_BY_PID. Its standard input is /dev/null; its output is obsctl's. A run that fails is
                reported on standard error and the watch goes on. With --coalesce, the changes that arrive while COMMAND
                runs fold into one run per key, with the value before the first of them (OBSD_OLD), the latest
                (OBSD_NEW, OBSD_REV) and the first revision folded in (OBSD_FROM); a key that changed back is left out.
                --initial runs it once per existing key first (OBSD_OLD unset). After --since, a key caught up runs it with
                OBSD_CATCHUP=1 and a key of a reset with OBSD_RESET=1 (OBSD_OLD unset: the earlier value is not known).
                """)

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Keys to watch (default: every key).") var keys: [String] = []
        @Option(help: ArgumentHelp("Watch keys starting with this prefix.", valueName: "prefix")) var prefix: String?
        @Flag(help: "First print the current values.") var initial = false
        @Option(
            help: ArgumentHelp(
                "First print what changed after this revision: the changes, or the keys that changed (caught up), or the current values (reset).",
                valueName: "rev"))
        var since: UInt64?
        @Option(help: ArgumentHelp("With --since: the epoch that revision belongs to (from --json output).", valueName: "epoch"))
        var epoch: String?
        @Flag(help: "With --since: only replay; exit 4 (compacted) when the daemon cannot replay from there.") var strict = false
        @Flag(help: "Exit after the first change.") var once = false
        @Flag(help: "While reading slowly, get each key's latest value instead of every change (not with --once).")
        var coalesce = false
        @Flag(help: "Show who wrote each change: the writer's uid and pid (JSON: \"by\").") var writers = false
        @Flag(name: .customLong("no-echo"), help: "Leave out changes written on this watch's own connection.") var noEcho = false
        @Flag(help: "Print JSON objects, one per line.") var json = false
        @Option(
            parsing: .remaining,
            help: ArgumentHelp("Run this command for each changed key instead of printing (last option).", valueName: "command"))
        var exec: [String] = []

        func validate() throws {
            if !keys.isEmpty && prefix != nil { throw ValidationError("give keys or --prefix, not both") }
            if initial && since != nil { throw ValidationError("use at most one of --initial and --since") }
            if epoch != nil && since == nil { throw ValidationError("--epoch goes with --since") }
            if strict && since == nil { throw ValidationError("--strict goes with --since") }
            if coalesce && once {
                throw ValidationError("use at most one of --coalesce and --once: a watch that ends at its first change has nothing to coalesce")
            }
            if exec.first?.isEmpty ?? false { throw ValidationError("--exec needs a command") }
            if !exec.isEmpty && json { throw ValidationError("use at most one of --exec and --json") }
        }

        func run() async throws {
            let selection: Selection = !keys.isEmpty ? .keys(Swift.Set(keys.map { Key($0) })) : prefix.map { .prefix($0) } ?? .all
            try await global.withClient { client in
                let (subscription, resume) = try await start(client, selection: selection)
                let events = ShownEvents(subscription: subscription, resume: resume, endAfterFirstChange: once && resume != .plain)
                if !exec.isEmpty { return try await runCommand(for: events) }
                for try await event in events {
                    print(event, epoch: subscription.epoch, resume: resume)
                }
            }
        }

        /// Subscribes as asked. With --since (not --strict), with `catchup`; from a daemon
        /// without it that answers `compacted`, with `initial` instead: a reset.
        private func start(_ client: ObsConnection, selection: Selection) async throws(ObsClientError) -> (Subscription, Resume) {
            let options = SubscriptionOptions(coalesce: coalesce, writers: writers, echo: !noEcho)
            guard let since, !strict else {
                let subscription = try await client.subscribe(
                    to: repo, selecting: selection, initial: initial, since: since, epoch: epoch, once: once, options: options)
                return (subscription, .plain)
            }
            // A once subscription cannot catch up (the protocol has no such thing): --once is obsctl's here.
            let subscription: Subscription
            do {
                subscription = try await client.subscribe(to: repo, selecting: selection, since: since, epoch: epoch, catchUp: true, options: options)
            } catch where error.code == .compacted {
                let fresh = try await client.subscribe(to: repo, selecting: selection, initial: true, options: options)
                notice(
                    "the daemon cannot resume after revision \(since)\(epoch.map { " of epoch \($0)" } ?? "") (\(error.message)) and does not catch up: the current values at revision \(fresh.revision) follow (reset)")
                return (fresh, .reset(synthesizedSynced: true))
            }
            switch subscription.catchUp {
            case .diff?:
                notice("the history no longer holds the revisions after \(since): the keys that changed since, as they are at revision \(subscription.revision) (caught up)")
                return (subscription, .diff)
            case .snapshot?:
                notice(
                    "cannot resume after revision \(since)\(epoch.map { " of epoch \($0)" } ?? ""): the repository's history is another one, or it forgot the deletions since; the current values at revision \(subscription.revision) follow (reset)")
                return (subscription, .reset(synthesizedSynced: false))
            default:
                return (subscription, .replay)
            }
        }

        /// A line on standard error for a person (not with --json: its reader reads the lines).
        private func notice(_ text: String) {
            if !json { printError(text) }
        }

        private func print(_ event: SubscriptionEvent, epoch: String, resume: Resume) {
            switch event {
            case .snapshot(let rev, let values):
                let reset = resume.isReset
                if json && reset {
                    let members = values.keys.sorted().map { (name: $0.string, value: values[$0]!) }
                    emit(line([("repo", .string(repo)), ("rev", .number(rev)), ("reset", true), ("values", .object(JSONObject(uniqueMembers: members))), ("epoch", .string(epoch))]))
                    return
                }
                for key in values.keys.sorted() {
                    let value = values[key]!
                    if json {
                        emit(line([("repo", .string(repo)), ("key", .string(key.string)), ("rev", .number(rev)), ("new", value), ("snapshot", true), ("epoch", .string(epoch))]))
                    } else {
                        emit("\(rev)  \(repo)/\(key.string)  = \(value.jsonText)\(reset ? "  (reset)" : "")")
                    }
                }
            case .change(let event):
                for change in event.changes {
                    if json {
                        var members: [(String, JSONValue)] = [("repo", .string(repo)), ("key", .string(change.key.string)), ("rev", .number(event.revision))]
                        if let old = change.old { members.append(("old", old)) }
                        if let new = change.new { members.append(("new", new)) }
                        if let from = event.from { members.append(("from", .number(from))) }
                        if let by = event.by { members.append(("by", by.jsonValue)) }
                        if let lease = event.lease, change.new == nil {
                            members.append(("lease", ["id": .number(lease.lease), "end": .string(lease.reason.rawValue)]))
                        }
                        members.append(("epoch", .string(epoch)))
                        emit(line(members))
                    } else {
                        let old = change.old?.jsonText ?? "(none)"
                        let new = change.new?.jsonText ?? event.lease.map { "(\($0.reason))" } ?? "(deleted)"
                        var text = "\(event.revision)  \(repo)/\(change.key.string)  \(old) → \(new)"
                        if let from = event.from { text += "  (coalesced \(from)…\(event.revision))" }
                        if let by = event.by { text += "  by uid \(by.uid) pid \(by.pid)" }
                        emit(text)
                    }
                }
            case .catchUp(let diff):
                if json {
                    let values = JSONObject(uniqueMembers: diff.entries.map { (name: $0.key.string, value: $0.value) })
                    emit(line([
                        ("repo", .string(repo)), ("rev", .number(diff.revision)), ("from", .number(diff.from)), ("catchup", true),
                        ("values", .object(values)), ("deleted", .array(diff.deleted.map { .string($0.string) })), ("epoch", .string(epoch)),
                    ]))
                    return
                }
                let lines = diff.entries.map { (key: $0.key, text: "= \($0.value.jsonText)") } + diff.deleted.map { (key: $0, text: "(deleted)") }
                for (key, text) in lines.sorted(by: { $0.key < $1.key }) {
                    emit("\(diff.revision)  \(repo)/\(key.string)  \(text)  (caught up)")
                }
            case .synced(let rev):
                if json {
                    emit(line([("repo", .string(repo)), ("rev", .number(rev)), ("synced", true), ("epoch", .string(epoch))]))
                } else {
                    printError("caught up at revision \(rev) (epoch \(epoch)); watching live")
                }
            }
        }

        private func line(_ members: [(String, JSONValue)]) -> String {
            JSONValue.object(JSONObject(uniqueMembers: members.map { (name: $0.0, value: $0.1) })).jsonText
        }
    }
}

/// How a watch started: as asked (no --since, or --strict), or how --since resumed.
enum Resume: Equatable {
    case plain
    /// The daemon replays the changes after --since.
    case replay
    /// The keys that changed after --since, as they are now: a `catchUp` event.
    case diff
    /// The current values: a snapshot that replaces everything. `synthesizedSynced`: from a
    /// daemon without catch-up (a subscription with `initial`), which sends no `synced` after it.
    case reset(synthesizedSynced: Bool)

    var isReset: Bool {
        if case .reset = self { return true }
        return false
    }
}

/// The events a watch shows, in order: its subscription's, with the `synced` that a daemon
/// without catch-up does not send after a reset; ending after the first change when obsctl
/// keeps --once itself (a resume: a subscription that catches up cannot be a once one).
struct ShownEvents: AsyncSequence, Sendable {
    typealias Element = SubscriptionEvent

    let subscription: Subscription
    let resume: Resume
    let endAfterFirstChange: Bool

    func makeAsyncIterator() -> Iterator {
        Iterator(base: subscription.makeAsyncIterator(), resume: resume, endAfterFirstChange: endAfterFirstChange)
    }

    struct Iterator: AsyncIteratorProtocol {
        var base: Subscription.AsyncIterator
        let resume: Resume
        let endAfterFirstChange: Bool
        private var queued: SubscriptionEvent?
        private var ended = false

        init(base: Subscription.AsyncIterator, resume: Resume, endAfterFirstChange: Bool) {
            self.base = base
            self.resume = resume
            self.endAfterFirstChange = endAfterFirstChange
        }

        mutating func next() async throws -> SubscriptionEvent? {
            if let queued {
                self.queued = nil
                return queued
            }
            guard !ended, let event = try await base.next() else { return nil }
            switch event {
            case .snapshot(let rev, _):
                if resume == .reset(synthesizedSynced: true) { queued = .synced(revision: rev) }
                ended = endAfterFirstChange
            case .change:
                ended = endAfterFirstChange
            case .catchUp(let diff):
                ended = endAfterFirstChange && !diff.isEmpty
            case .synced:
                break
            }
            return event
        }
    }
}
