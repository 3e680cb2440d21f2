// The Makefile's two commands install what they say (README, "Quick start"): `make run`
// only what building obsd needs; `make test` the tests' tools on top, and etcd unpacked,
// never the etcd-server package (which would enable and start a system etcd on port 2379).
// Read from `make -n` (nothing is run or installed).

import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// The Debian packages a dry run of `make target` would install when missing: the lists of
/// the `for p in …; do` loops that check them.
func packagesInstalled(byMaking target: String) throws -> Set<String> {
    let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../..").standardized.path
    let result = try run(which("make")!, ["-n", "-C", root, target])
    guard result.status == 0 else { throw TestFailure("make -n \(target): \(result.stderr)") }
    var packages = Set<String>()
    // A recipe's continued lines, joined: each shell command on one line.
    let commands = result.stdout.replacingOccurrences(of: "\\\n", with: " ").split(separator: "\n")
    for line in commands where line.contains("apt-get install") {
        guard let start = line.range(of: "for p in "), let end = line.range(of: "; do", range: start.upperBound..<line.endIndex) else {
            throw TestFailure("an apt-get install without the package loop: \(line)")
        }
        packages.formUnion(line[start.upperBound..<end.lowerBound].split(separator: " ").map(String.init))
    }
    return packages
}

@Suite(.mayBlock) struct MakefileTests {
    @Test(.enabled(if: which("make") != nil, "needs make"))
    func runInstallsOnlyWhatTheBuildNeedsAndTestAddsTheTestsToolsButNoEtcdService() throws {
        #expect(try packagesInstalled(byMaking: "run") == ["libsqlite3-dev", "libsystemd-dev", "pkg-config"])
        let test = try packagesInstalled(byMaking: "test")
        #expect(test.isSuperset(of: ["libsqlite3-dev", "systemd", "strace", "socat", "netcat-openbsd", "python3-prometheus-client"]), "\(test)")
        #expect(!test.contains("etcd-server") && !test.contains("etcd-client"), "etcd is unpacked, not installed: \(test)")
    }
}
