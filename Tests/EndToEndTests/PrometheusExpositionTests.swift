// Unit tests of obsctl's Prometheus exposition writer (Sources/obsctl/PrometheusExposition.swift)
// and of how `stats --prometheus` names fields (StatsExposition.swift): escaping with tricky
// strings (repository names cannot carry them, so the end-to-end tests never would), names,
// values, families that would clash, a reduced reply, fields a newer daemon adds. The text is
// also read back by the reference parser when it is installed.

import ObsClient
import ObsProtocol
import Testing

@testable import obsctl

@Suite struct PrometheusExpositionTests {
    @Test func labelValuesEscapeBackslashDoubleQuoteAndLineFeedOnly() {
        #expect(PrometheusExposition.escapeLabelValue("") == "")
        #expect(PrometheusExposition.escapeLabelValue("plain.repo-1") == "plain.repo-1")
        #expect(PrometheusExposition.escapeLabelValue(#"C:\dir"#) == #"C:\\dir"#)
        #expect(PrometheusExposition.escapeLabelValue(#"say "hi""#) == #"say \"hi\""#)
        #expect(PrometheusExposition.escapeLabelValue("two\nlines") == #"two\nlines"#)
        // A backslash followed by n is two characters, not a line feed: both must survive.
        #expect(PrometheusExposition.escapeLabelValue(#"\n"#) == #"\\n"#)
        #expect(PrometheusExposition.escapeLabelValue("\\\"\n") == #"\\\"\n"#)
        #expect(PrometheusExposition.escapeLabelValue(#"\\"#) == #"\\\\"#)
        // Nothing else is escaped: tabs, carriage returns, braces, commas, UTF-8.
        #expect(PrometheusExposition.escapeLabelValue("a\tb\rc{d},e=f") == "a\tb\rc{d},e=f")
        #expect(PrometheusExposition.escapeLabelValue("ünïcødé ✓ 🚀") == "ünïcødé ✓ 🚀")
    }

    @Test func helpEscapesBackslashAndLineFeedButNotDoubleQuotes() {
        #expect(PrometheusExposition.escapeHelp(#"a "quoted" word"#) == #"a "quoted" word"#)
        #expect(PrometheusExposition.escapeHelp("first\nsecond") == #"first\nsecond"#)
        #expect(PrometheusExposition.escapeHelp(#"back\slash"#) == #"back\\slash"#)
    }

    @Test func namesFollowTheFormatsGrammar() {
        for valid in ["obsd_up", "_x", "a:b", "obsd_p99_seconds", "A9", ":colon"] {
            #expect(PrometheusExposition.isValidMetricName(valid), "\(valid)")
        }
        for invalid in ["", "9lives", "a-b", "a.b", "a b", "é", "obsd_up{"] {
            #expect(!PrometheusExposition.isValidMetricName(invalid), "\(invalid)")
        }
        for valid in ["repo", "_x", "version2"] {
            #expect(PrometheusExposition.isValidLabelName(valid), "\(valid)")
        }
        for invalid in ["", "__name__", "__x", "a:b", "2x", "re-po"] {
            #expect(!PrometheusExposition.isValidLabelName(invalid), "\(invalid)")
        }
    }

    @Test func valuesAreGoFloats() {
        #expect(PrometheusExposition.format(0) == "0")
        #expect(PrometheusExposition.format(3) == "3")
        #expect(PrometheusExposition.format(-2) == "-2")
        #expect(PrometheusExposition.format(0.25) == "0.25")
        #expect(PrometheusExposition.format(123_456_789_012) == "123456789012")
        #expect(PrometheusExposition.format(1e20) == "1e+20")
        #expect(PrometheusExposition.format(.nan) == "NaN")
        #expect(PrometheusExposition.format(.infinity) == "+Inf")
        #expect(PrometheusExposition.format(-.infinity) == "-Inf")
    }

    @Test func rendersFamiliesInOrderWithEscapedLabels() throws {
        var e = PrometheusExposition()
        try e.add("t_total", .counter, help: "A \"counter\" with a \\ and a\nline feed.", value: 5)
        try e.add(
            "t_labels", .gauge, help: "Labels.",
            samples: [.init(labels: [("a", "x\"y"), ("b", "p\\q\nr")], 1.5), .init(labels: [("a", "")], -1)])
        #expect(e.text == """
            # HELP t_total A "counter" with a \\\\ and a\\nline feed.
            # TYPE t_total counter
            t_total 5
            # HELP t_labels Labels.
            # TYPE t_labels gauge
            t_labels{a="x\\"y",b="p\\\\q\\nr"} 1.5
            t_labels{a=""} -1

            """)
    }

    @Test func refusesWhatWouldNotParseOrWouldClash() throws {
        var e = PrometheusExposition()
        try e.add("x", .gauge, help: "", value: 1)
        #expect(throws: PrometheusExposition.Problem.duplicateFamily("x")) { try e.add("x", .gauge, help: "", value: 2) }
        // A parser files the counter x_total under x.
        #expect(throws: PrometheusExposition.Problem.duplicateFamily("x_total")) { try e.add("x_total", .counter, help: "", value: 2) }
        try e.add("y_total", .counter, help: "", value: 1)
        #expect(throws: PrometheusExposition.Problem.duplicateFamily("y")) { try e.add("y", .gauge, help: "", value: 2) }
        #expect(throws: PrometheusExposition.Problem.invalidMetricName("bad-name")) { try e.add("bad-name", .gauge, help: "", value: 1) }
        #expect(throws: PrometheusExposition.Problem.invalidLabelName(metric: "z", label: "__name__")) {
            try e.add("z", .gauge, help: "", samples: [.init(labels: [("__name__", "v")], 1)])
        }
        #expect(throws: PrometheusExposition.Problem.repeatedLabel(metric: "z", label: "a")) {
            try e.add("z", .gauge, help: "", samples: [.init(labels: [("a", "1"), ("a", "2")], 1)])
        }
        #expect(e.families.map(\.name) == ["x", "y_total"], "a refused family adds nothing")
    }

    @Test(.enabled(if: hasPrometheusParser, "needs python3-prometheus-client for /usr/bin/python3 (make test-deps)"))
    func theReferenceParserReadsTrickyLabelValuesBackUnchanged() throws {
        let tricky = [#"back\slash"#, #"double "quote""#, "line\nfeed", #"\n literally"#, "\\\"\n\\", "", "tab\tand ✓ 🚀", "a,b=c}{"]
        var e = PrometheusExposition()
        try e.add(
            "obsd_test_label_values", .gauge, help: "Help with \\ and \"quotes\"\nover two lines.",
            samples: tricky.enumerated().map { .init(labels: [("i", String($0.offset)), ("v", $0.element)], Double($0.offset)) })
        let family = try #require(try parseWithPrometheusClient(e.text)["obsd_test_label_values"])
        #expect(family.help == "Help with \\ and \"quotes\"\nover two lines.")
        #expect(family.samples.count == tricky.count)
        for sample in family.samples {
            let i = try #require(sample.labels["i"].flatMap { Int($0) })
            #expect(sample.labels["v"] == tricky[i], "value \(i)")
            #expect(sample.value == Double(i))
        }
    }

    @Test func fieldNamesInSnakeCase() {
        #expect(StatsExposition.snakeCase("writes") == "writes")
        #expect(StatsExposition.snakeCase("storageCommits") == "storage_commits")
        #expect(StatsExposition.snakeCase("uptimeSeconds") == "uptime_seconds")
        #expect(StatsExposition.snakeCase("HTTPRequests") == "http_requests")
        #expect(StatsExposition.snakeCase("p99Latency") == "p99_latency")
        #expect(StatsExposition.snakeCase("queue-bytes.max") == "queue_bytes_max")
        #expect(StatsExposition.snakeCase("café") == "caf_")
    }

    @Test func aReducedReplyGivesOnlyItsFields() throws {
        // What an unprivileged caller gets (docs/PROTOCOL.md, stats).
        let reduced: JSONValue = [
            "connections": 2, "subscriptions": 0, "repos": 1,
            "peer": ["uid": 65534, "gid": 65534, "pid": 42, "privileged": false], "server": "obsd/9.9.9",
        ]
        var warnings: [String] = []
        let stats = try Stats(decoding: reduced.objectValue ?? JSONObject())
        let e = StatsExposition.metrics(
            stats: stats, repos: [RepositoryInfo(name: "public.news", revision: 7, keys: 2, epoch: "e")]
        ) { warnings.append($0) }
        #expect(e.families.map(\.name) == [
            "obsd_up", "obsd_info", "obsd_connections", "obsd_subscriptions", "obsd_repositories", "obsd_repository_revision",
            "obsd_repository_keys",
        ])
        #expect(warnings.isEmpty)
        #expect(e.text.contains("obsd_info{version=\"9.9.9\"} 1\n") && e.text.contains("obsd_repository_revision{repo=\"public.news\"} 7\n"))
        // No repositories: no repository families (not empty ones).
        let none = StatsExposition.metrics(stats: stats, repos: []) { _ in }
        #expect(!none.families.contains { $0.name.hasPrefix("obsd_repository_") })
    }

    @Test func numericFieldsANewerDaemonAddsBecomeGaugesAndNothingIsDroppedSilently() throws {
        let reply: JSONValue = [
            "connections": 1, "subscriptions": 0, "repos": 0, "writes": 10, "server": "obsd/2.0.0",
            "queueHighWater": 4096, "loadAverage": 0.5, "p99LatencyMicros": 77,
            "tls": true, "storage": "sqlite /var/lib/obsd/obsd.db, sync always", "clients": [], "limits": ["x": 1], "nothing": nil,
            // The daemon's pid is a number but no metric; the last reload's error is text.
            "pid": 4242, "reloadError": "obsd.toml: unknown key x",
            // A new field whose name is taken: reported.
            "up": 3,
        ]
        let stats = try Stats(decoding: reply.objectValue ?? JSONObject())
        #expect(stats.otherCounters.map(\.name) == ["queueHighWater", "loadAverage", "p99LatencyMicros", "up"])
        var warnings: [String] = []
        let e = StatsExposition.metrics(stats: stats, repos: []) { warnings.append($0) }
        #expect(e.families.map(\.name) == [
            "obsd_up", "obsd_info", "obsd_connections", "obsd_subscriptions", "obsd_repositories", "obsd_writes_total",
            "obsd_queue_high_water", "obsd_load_average", "obsd_p99_latency_micros",
        ])
        let generic = e.families.first { $0.name == "obsd_queue_high_water" }
        #expect(generic?.type == .gauge && generic?.help.contains("queueHighWater") == true)
        #expect(e.text.contains("\nobsd_load_average 0.5\n") && e.text.contains("\nobsd_queue_high_water 4096\n"))
        #expect(warnings.count == 1, "\(warnings)")
        #expect(warnings.contains { $0.hasPrefix("left out obsd_up:") })
        // A known field whose type changed is not a `Stats`: the client reports the reply as a
        // protocol violation (and `stats --prometheus` as obsd_up 0), rather than guessing.
        var changed = reply.objectValue ?? JSONObject()
        changed["requests"] = "many"
        #expect(throws: ProtocolViolation.self) { try Stats(decoding: changed) }
    }

    @Test func aDaemonThatCannotBeReadIsUpZeroAlone() {
        #expect(StatsExposition.down().text == """
            # HELP obsd_up Whether obsctl read obsd's counters (1) or not (0: obsd is down, or the connection failed).
            # TYPE obsd_up gauge
            obsd_up 0

            """)
    }
}
