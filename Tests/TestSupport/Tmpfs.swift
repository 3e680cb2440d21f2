// A size-limited tmpfs mounted for one test: a real file system that fills up.

#if canImport(Glibc)
import Glibc
#endif

public struct Tmpfs: Sendable {
    public let path: String

    /// Whether tmpfs can be mounted here (root, and a kernel that lets us).
    public static let available: Bool = {
        guard getuid() == 0, let probe = try? Tmpfs(megabytes: 1) else { return false }
        probe.unmount()
        return true
    }()

    public init(megabytes: Int) throws {
        var template = Array("/tmp/obsd-tmpfs-XXXXXX".utf8CString)
        path = template.withUnsafeMutableBufferPointer { String(cString: mkdtemp($0.baseAddress!)) }
        let mount = try ChildProcess("/bin/mount", ["-t", "tmpfs", "-o", "size=\(megabytes)m", "tmpfs", path], stdout: .null, stderr: .null)
        guard mount.wait(timeout: .seconds(30)) == 0 else {
            rmdir(path)
            throw SpawnFailure(description: "cannot mount a tmpfs on \(path)")
        }
    }

    public func unmount() {
        if let umount = try? ChildProcess("/bin/umount", ["-l", path], stdout: .null, stderr: .null) { _ = umount.wait(timeout: .seconds(30)) }
        rmdir(path)
    }
}
