// Tests of the libsystemd module: journal field mapping and a real sd_journal_sendv call,
// sd_notify messages to a test-owned NOTIFY_SOCKET, watchdog settings.

import Foundation
import Logging
import TestSupport
import Testing

@testable import Systemd

@Suite struct JournalFieldTests {
    func event(_ level: Logger.Level, _ message: String = "hello") -> LogEvent {
        LogEvent(level: level, message: "\(message)", metadata: nil, source: "obsd", file: "F.swift", function: "f()", line: 7)
    }

    @Test func levelsMapToSyslogPriorities() {
        let expected: [Logger.Level: Int] = [.trace: 7, .debug: 7, .info: 6, .notice: 5, .warning: 4, .error: 3, .critical: 2]
        for (level, priority) in expected { #expect(JournalLogHandler.priority(level) == priority) }
    }

    @Test func metadataKeysBecomeValidFieldNames() {
        #expect(JournalLogHandler.fieldName("repo") == "OBSD_REPO")
        #expect(JournalLogHandler.fieldName("peer.uid") == "OBSD_PEER_UID")
        #expect(JournalLogHandler.fieldName("peer_pid") == "OBSD_PEER_PID")
        #expect(JournalLogHandler.fieldName("weird--Key ü 9") == "OBSD_WEIRD_KEY_9")
        #expect(JournalLogHandler.fieldName(String(repeating: "k", count: 100)).count == 64)
        for name in ["repo", "peer.uid", "a b", "_x", "9"].map(JournalLogHandler.fieldName) {
            #expect(name.allSatisfy { $0.isASCII && ($0.isUppercase || $0.isNumber || $0 == "_") })
            #expect(!name.hasPrefix("_"))
        }
    }

    @Test func recordsCarryMessagePriorityCodeAndMetadata() {
        let fields = JournalLogHandler.fields(
            for: event(.warning, "line one\nline two"), identifier: "obsd", metadata: ["repo": "ui", "peer.uid": "1000"])
        let map = Dictionary(fields.map { ($0.name, $0.value) }, uniquingKeysWith: { $1 })
        #expect(map["MESSAGE"] == "line one\nline two")
        #expect(map["PRIORITY"] == "4")
        #expect(map["SYSLOG_IDENTIFIER"] == "obsd")
        #expect(map["CODE_FILE"] == "F.swift" && map["CODE_LINE"] == "7" && map["CODE_FUNC"] == "f()")
        #expect(map["OBSD_REPO"] == "ui" && map["OBSD_PEER_UID"] == "1000")
    }

    @Test(.enabled(if: getuid() == 0 || access("/run/systemd/journal/socket", W_OK) == 0))
    func aRealJournalSendSucceeds() throws {
        let journal = "/run/systemd/journal/socket"
        // Without journald (a container), stand in for it at its well-known path.
        var standIn: DatagramListener? = nil
        if access(journal, F_OK) != 0 {
            mkdir("/run/systemd", 0o755)
            mkdir("/run/systemd/journal", 0o755)
            standIn = try DatagramListener(path: journal)
        }
        let fields = JournalLogHandler.fields(for: event(.error, "two\nlines"), identifier: "obsd-test", metadata: ["repo": "ui"])
        let rc = JournalLogHandler.sendv(fields.map { Array("\($0.name)=\($0.value)".utf8) })
        #expect(rc == 0, "sd_journal_sendv returned \(rc)")
        if let standIn, let datagram = standIn.receive() {
            // The native journal protocol: "KEY=value\n", or for values with newlines
            // "KEY\n" + 64-bit little-endian length + value + "\n".
            let text = String(decoding: datagram, as: UTF8.self)
            #expect(text.contains("PRIORITY=3\n") && text.contains("OBSD_REPO=ui\n") && text.contains("SYSLOG_IDENTIFIER=obsd-test\n"))
            #expect(text.contains("MESSAGE\n") && text.contains("two\nlines"))
        }
    }
}

@Suite(.mayBlock, .serialized) struct NotifierTests {
    @Test func sendsStateChangesToNotifySocket() throws {
        let path = NSTemporaryDirectory() + "obsd-notify-\(getpid()).sock"
        let listener = try DatagramListener(path: path)
        setenv("NOTIFY_SOCKET", path, 1)
        defer { unsetenv("NOTIFY_SOCKET") }
        let notifier = SystemdNotifier()
        #expect(notifier.isActive)
        #expect(notifier.ready(status: "serving\nnow"))
        #expect(String(decoding: listener.receive() ?? [], as: UTF8.self) == "READY=1\nSTATUS=serving now")
        #expect(notifier.watchdog())
        #expect(String(decoding: listener.receive() ?? [], as: UTF8.self) == "WATCHDOG=1")
        #expect(notifier.reloading())
        let reloading = String(decoding: listener.receive() ?? [], as: UTF8.self)
        #expect(reloading.hasPrefix("RELOADING=1\nMONOTONIC_USEC="))
        #expect(notifier.stopping())
        #expect(String(decoding: listener.receive() ?? [], as: UTF8.self) == "STOPPING=1")
    }

    @Test func withoutNotifySocketNothingIsSent() {
        unsetenv("NOTIFY_SOCKET")
        #expect(!SystemdNotifier().isActive)
        #expect(!SystemdNotifier().ready())
    }

    @Test func watchdogTimeoutComesFromTheEnvironment() {
        setenv("WATCHDOG_USEC", "400000", 1)
        defer { unsetenv("WATCHDOG_USEC") }
        #expect(SystemdNotifier().watchdogTimeout == .milliseconds(400))
        setenv("WATCHDOG_PID", "1", 1)  // another process's watchdog
        defer { unsetenv("WATCHDOG_PID") }
        #expect(SystemdNotifier().watchdogTimeout == nil)
    }

    @Test func journalStreamMustMatchStandardError() {
        var st = stat()
        fstat(2, &st)
        #expect(SystemdEnvironment.stderrIsJournal(environment: ["JOURNAL_STREAM": "\(st.st_dev):\(st.st_ino)"]))
        #expect(!SystemdEnvironment.stderrIsJournal(environment: ["JOURNAL_STREAM": "1:2"]))
        #expect(SystemdEnvironment.isUnderSystemd(environment: ["INVOCATION_ID": "abc"]))
        #expect(!SystemdEnvironment.isUnderSystemd(environment: [:]))
    }
}
