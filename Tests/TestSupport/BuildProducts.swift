// Test support: where the package's executables were built (next to the test bundle), for
// the suites that run the real binaries (EndToEndTests, ObsClusterTests).

import Foundation

public enum BuildProducts {
    /// `OBSD_BUILD_DIR`, or the first directory above the test runner that holds `obsd`.
    public static var directory: URL {
        if let dir = ProcessInfo.processInfo.environment["OBSD_BUILD_DIR"] {
            return URL(fileURLWithPath: dir)
        }
        let exe = URL(fileURLWithPath: "/proc/self/exe").resolvingSymlinksInPath()
        var dir = exe.deletingLastPathComponent()
        // On some layouts the runner sits inside the .xctest bundle.
        while !FileManager.default.fileExists(atPath: dir.appendingPathComponent("obsd").path), dir.path != "/" {
            dir = dir.deletingLastPathComponent()
        }
        return dir
    }

    /// The path of the built executable `name`.
    public static func path(_ name: String) -> String { directory.appendingPathComponent(name).path }
}
