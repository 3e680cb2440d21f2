// TestSupport — temporary directories that go when the test process exits, whichever test
// made them and however it ended (a daemon's socket, data directory and log included).

import Foundation
import ObservableKit

public enum TemporaryDirectory {
    private static let made = Locked<[String]>([])

    /// A fresh, empty directory `/tmp/<prefix>XXXXXX`, removed with its contents at exit.
    public static func make(prefix: String) -> String {
        var template = Array("/tmp/\(prefix)XXXXXX".utf8CString)
        guard let made = template.withUnsafeMutableBufferPointer({ mkdtemp($0.baseAddress!) }) else {
            preconditionFailure("mkdtemp /tmp/\(prefix)XXXXXX: \(String(cString: strerror(errno)))")
        }
        let path = String(cString: made)
        Self.made.withLock { paths in
            if paths.isEmpty { atexit { TemporaryDirectory.removeAll() } }
            paths.append(path)
        }
        return path
    }

    private static func removeAll() {
        for path in made.withLock({ $0 }) { try? FileManager.default.removeItem(atPath: path) }
    }
}
