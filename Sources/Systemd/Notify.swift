// Systemd — obsd's use of libsystemd: readiness and watchdog notifications, sockets
// passed by socket activation, and the journal. No networking library; every function
// names the libsystemd call it wraps.
//
// This file owns `SystemdNotifier`: `sd_notify(3)` messages to the service manager.

import CSystemd

#if canImport(Glibc)
import Glibc
#endif

/// Sends state changes to the service manager (`sd_notify(3)`). Every call is a no-op when
/// the process was not started by systemd with `Type=notify` (no `$NOTIFY_SOCKET`).
public struct SystemdNotifier: Sendable {
    public init() {}

    /// Whether a service manager listens (`$NOTIFY_SOCKET` is set).
    public var isActive: Bool { getenv("NOTIFY_SOCKET") != nil }

    /// Sends raw `KEY=value` lines. Wraps `sd_notify(0, state)`; returns whether it was sent.
    @discardableResult
    public func notify(_ state: String) -> Bool {
        sd_notify(0, state) > 0
    }

    /// `READY=1`, with an optional status line.
    @discardableResult
    public func ready(status: String? = nil) -> Bool {
        notify(status.map { "READY=1\nSTATUS=\(Self.oneLine($0))" } ?? "READY=1")
    }

    /// `STATUS=…`: a short human-readable summary shown by `systemctl status`.
    @discardableResult
    public func status(_ text: String) -> Bool {
        notify("STATUS=\(Self.oneLine(text))")
    }

    /// `RELOADING=1` with the `MONOTONIC_USEC` systemd ≥ 253 requires for `Type=notify-reload`.
    @discardableResult
    public func reloading() -> Bool {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        let usec = UInt64(now.tv_sec) * 1_000_000 + UInt64(now.tv_nsec) / 1000
        return notify("RELOADING=1\nMONOTONIC_USEC=\(usec)")
    }

    /// `STOPPING=1`.
    @discardableResult
    public func stopping() -> Bool { notify("STOPPING=1") }

    /// `WATCHDOG=1`: the service is alive. Send it more often than `watchdogInterval`.
    @discardableResult
    public func watchdog() -> Bool { notify("WATCHDOG=1") }

    /// The watchdog timeout the service manager expects pings within, if the watchdog is
    /// enabled for this process (`sd_watchdog_enabled(3)`: `$WATCHDOG_USEC`, `$WATCHDOG_PID`).
    public var watchdogTimeout: Duration? {
        var usec: UInt64 = 0
        guard sd_watchdog_enabled(0, &usec) > 0, usec > 0 else { return nil }
        return .microseconds(Int64(clamping: usec))
    }

    private static func oneLine(_ text: String) -> String {
        String(text.map { $0 == "\n" ? " " : $0 })
    }
}
