// Systemd — is this process running under systemd, and is its stderr the journal?

#if canImport(Glibc)
import Glibc
#endif

public enum SystemdEnvironment {
    /// Whether standard error is connected to the journal: `$JOURNAL_STREAM` is
    /// `<device>:<inode>` of the journal stream, and must match fd 2 (it is inherited by
    /// children whose stderr may point elsewhere).
    public static func stderrIsJournal(environment: [String: String]) -> Bool {
        guard let stream = environment["JOURNAL_STREAM"] else { return false }
        let parts = stream.split(separator: ":")
        guard parts.count == 2, let device = UInt64(parts[0]), let inode = UInt64(parts[1]) else { return false }
        var st = stat()
        guard fstat(2, &st) == 0 else { return false }
        return UInt64(st.st_dev) == device && UInt64(st.st_ino) == inode
    }

    /// Whether the process runs as a systemd unit (`$INVOCATION_ID` is set), or its stderr
    /// is the journal.
    public static func isUnderSystemd(environment: [String: String]) -> Bool {
        environment["INVOCATION_ID"] != nil || stderrIsJournal(environment: environment)
    }
}
