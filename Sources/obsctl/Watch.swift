// obsctl — `watch`: follow changes of keys, a prefix, or a whole repository.

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
                (OLD is (none) for a creation, NEW is (deleted) for a deletion; --initial lines read REV  REPO/KEY  = VALUE).
                With --json, one object per changed key: {"repo","key","rev","old","new","from","by","epoch"}, with "old",
                "new", "from" and "by" present exactly as in the protocol; --initial values come as {"repo","key","rev","new","snapshot":true,"epoch"},
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

        func validate() throws {
            if !keys.isEmpty && prefix != nil { throw ValidationError("give keys or --prefix, not both") }
            if initial && since != nil { throw ValidationError("use at most one of --initial and --since") }
            if epoch != nil && since == nil { throw ValidationError("--epoch goes with --since") }
            if coalesce && once {
                throw ValidationError("use at most one of --coalesce and --once: a watch that ends at its first change has nothing to coalesce")
            }
        }

        func run() async throws {
            let selection: Selection = !keys.isEmpty ? .keys(Swift.Set(keys.map { Key($0) })) : prefix.map { .prefix($0) } ?? .all
            try await global.withClient { client in
                let options = SubscriptionOptions(coalesce: coalesce, writers: writers, echo: !noEcho)
                let subscription = try await client.subscribe(
                    to: repo, selecting: selection, initial: initial, since: since, epoch: epoch, once: once, options: options)
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
                        members.append(("epoch", .string(epoch)))
                        emit(line(members))
                    } else {
                        let old = change.old?.jsonText ?? "(none)"
                        let new = change.new?.jsonText ?? "(deleted)"
                        var text = "\(event.revision)  \(repo)/\(change.key.string)  \(old) → \(new)"
                        if let from = event.from { text += "  (coalesced \(from)…\(event.revision))" }
                        if let by = event.by { text += "  by uid \(by.uid) pid \(by.pid)" }
                        emit(text)
                    }
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
