// obsctl — `watch`: follow changes of keys, a prefix, or a whole repository; print them, or
// run a command for each (`--exec`, WatchExec.swift).

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
                To resume where a watch stopped, pass the last line's rev and epoch: --since REV --epoch EPOCH. If the
                repository's history is not that epoch any more (the daemon lost or replaced it), obsctl says so and
                exits 4 (compacted): start again with --initial.
                --coalesce asks for state rather than every change: while obsctl reads too slowly, the daemon sends one
                change per key whose value differs from the last one printed (human: (coalesced FROM…REV) after the line;
                JSON: "from":FROM), and never cuts the watch off for reading slowly. It cannot go with --once.
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
                --initial runs it once per existing key first (OBSD_OLD unset).
                """)

        @OptionGroup var global: GlobalOptions
        @Argument(help: "Repository name.") var repo: String
        @Argument(help: "Keys to watch (default: every key).") var keys: [String] = []
        @Option(help: ArgumentHelp("Watch keys starting with this prefix.", valueName: "prefix")) var prefix: String?
        @Flag(help: "First print the current values.") var initial = false
        @Option(help: ArgumentHelp("First replay changes after this revision.", valueName: "rev")) var since: UInt64?
        @Option(help: ArgumentHelp("With --since: the epoch that revision belongs to (from --json output).", valueName: "epoch"))
        var epoch: String?
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
            if coalesce && once {
                throw ValidationError("use at most one of --coalesce and --once: a watch that ends at its first change has nothing to coalesce")
            }
            if exec.first?.isEmpty ?? false { throw ValidationError("--exec needs a command") }
            if !exec.isEmpty && json { throw ValidationError("use at most one of --exec and --json") }
        }

        func run() async throws {
            let selection: Selection = !keys.isEmpty ? .keys(Swift.Set(keys.map { Key($0) })) : prefix.map { .prefix($0) } ?? .all
            try await global.withClient { client in
                let options = SubscriptionOptions(coalesce: coalesce, writers: writers, echo: !noEcho)
                let subscription = try await client.subscribe(
                    to: repo, selecting: selection, initial: initial, since: since, epoch: epoch, once: once, options: options)
                if !exec.isEmpty { return try await runCommand(for: subscription) }
                for try await event in subscription {
                    print(event, epoch: subscription.epoch)
                }
            }
        }

        private func print(_ event: SubscriptionEvent, epoch: String) {
            switch event {
            case .snapshot(let rev, let values):
                for key in values.keys.sorted() {
                    let value = values[key]!
                    if json {
                        emit(line([("repo", .string(repo)), ("key", .string(key.string)), ("rev", .number(rev)), ("new", value), ("snapshot", true), ("epoch", .string(epoch))]))
                    } else {
                        emit("\(rev)  \(repo)/\(key.string)  = \(value.jsonText)")
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
            case .catchUp:
                break  // (obsctl does not ask for catch-up yet)
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
