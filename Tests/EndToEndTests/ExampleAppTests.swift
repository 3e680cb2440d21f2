// End-to-end tests of the client library as an app uses it: the two example programs in
// Examples/ against a real daemon, and a package outside the repository that depends on it by
// path, as a user's would, built with the documented API and run against a real daemon.

import Foundation
import ObsClient
import ObsProtocol
import Testing
import TestSupport

@Suite(.mayBlock) struct ExampleAppTests {
    @Test func theMirrorExamplePrintsARepositoryLive() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        try await ObsConnection.withConnection(socketPath: d.socketPath) { c in _ = try await c.set("theme", to: "light", in: "ui") }
        let example = try LineReadingProcess(BuildProducts.path("obs-mirror"), ["ui", "--socket", d.socketPath, "--count", "2"])
        #expect(try example.line() == #"rev 1: {"theme":"light"}"#)
        try await ObsConnection.withConnection(socketPath: d.socketPath) { c in _ = try await c.set("lang", to: "fr", in: "ui") }
        #expect(try example.line() == #"rev 2: {"lang":"fr","theme":"light"}"#)
        #expect(example.waitForExit() == 0)
        let usage = try run(BuildProducts.path("obs-mirror"), [])
        #expect(usage.status == 64 && usage.stderr.contains("usage: obs-mirror REPO"))
    }

    @Test func theSettingsExampleIsAnObservableModelOfCodableValues() async throws {
        let d = try await TestDaemon.start(inMemory: true)
        let program = BuildProducts.path("obs-settings")
        let shown = try LineReadingProcess(program, ["--socket", d.socketPath, "show", "--count", "4"])
        #expect(try shown.line() == "theme=light fontSize=13 (defaults)")

        let toggled = try run(program, ["--socket", d.socketPath, "toggle-theme"])
        #expect(toggled.status == 0 && toggled.stdout == "applied at revision 1: theme=dark fontSize=13\n", "\(toggled)")
        #expect(try shown.line() == "theme=dark fontSize=13", "the other process's model saw the change")

        let bigger = try run(program, ["--socket", d.socketPath, "bigger"])
        #expect(bigger.stdout == "applied at revision 2: theme=dark fontSize=14\n", "\(bigger)")
        #expect(try shown.line() == "theme=dark fontSize=14")

        // Another writer stores something that is not an Appearance: the model says so and
        // shows the defaults; it does not crash or show a stale value.
        try await ObsConnection.withConnection(socketPath: d.socketPath) { c in
            _ = try await c.set("appearance", to: ["theme": "sepia", "fontSize": 12], in: "settings")
        }
        let line = try shown.line()
        #expect(line.hasPrefix("theme=light fontSize=13 (stored value ignored: the value of key \"appearance\" is not a valid Appearance"), "\(line)")
        #expect(shown.waitForExit() == 0)

        let usage = try run(program, ["--socket", d.socketPath])
        #expect(usage.status != 0 && usage.stderr.contains("usage: obs-settings"), "\(usage)")
    }

    /// A package of its own, outside the repository, that depends on it by path and uses the
    /// API the documentation shows (ObsClient.docc's Getting Started), run against a real daemon.
    @Test(.timeLimit(.minutes(20))) func aPackageOutsideTheRepositoryBuildsAgainstTheDocumentedAPI() async throws {
        let package = TestDaemon.makeTemporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: package) }
        try ExternalPackage.write(to: package, dependingOn: ExternalPackage.repository)
        // A scratch path in the repository's build directory, kept between runs: the first
        // build compiles the client's dependencies, later ones only what changed.
        let scratch = ExternalPackage.repository + "/.build/external-package"
        let build = try run(
            ExternalPackage.swift, ["build", "--package-path", package, "--scratch-path", scratch, "--product", "uses-obsclient"],
            timeout: .seconds(18 * 60))
        #expect(build.status == 0, "swift build of the outside package failed:\n\(build.stdout)\n\(build.stderr)")
        #expect(!build.stdout.contains("deprecated") && !build.stderr.contains("deprecated"), "the documented API is not deprecated")
        guard build.status == 0 else { return }

        let d = try await TestDaemon.start(inMemory: true)
        let ran = try run(scratch + "/debug/uses-obsclient", ["--socket", d.socketPath], timeout: .seconds(60))
        #expect(ran.status == 0, "\(ran.stdout)\n\(ran.stderr)")
        #expect(
            ran.stdout == """
                hello: obsd/\(ObsRelease.version), protocol 1
                set: revision 1, changed true
                get: "dark" at revision 1
                snapshot at 1: theme = "dark"
                change at 2: theme "dark" -> "light"
                conflict: ifRevision 1 is stale
                statistics: 1 repository, 1 subscription
                typed: Layout(columns: 3, compact: true) at revision 3
                mirror: Layout(columns: 4, compact: true) applied at revision 4

                """, "\(ran.stderr)")
    }
}

/// The outside package: its manifest and its one source file.
enum ExternalPackage {
    /// The repository's root (this file is Tests/EndToEndTests/ExampleAppTests.swift).
    static let repository = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().path

    /// The `swift` that builds it: `$SWIFT`, else the one on PATH, else /opt/swift's.
    static var swift: String {
        let environment = ProcessInfo.processInfo.environment
        if let swift = environment["SWIFT"], swift.hasPrefix("/") { return swift }
        for directory in (environment["PATH"] ?? "").split(separator: ":") where FileManager.default.isExecutableFile(atPath: "\(directory)/swift") {
            return "\(directory)/swift"
        }
        return "/opt/swift/usr/bin/swift"
    }

    static func write(to directory: String, dependingOn repository: String) throws {
        // A path dependency's identity is its directory's name, lowercased.
        let identity = URL(fileURLWithPath: repository).lastPathComponent.lowercased()
        let manifest = """
            // swift-tools-version:6.1
            import PackageDescription

            let package = Package(
                name: "UsesObsClient",
                platforms: [.macOS(.v15)],
                dependencies: [.package(path: "\(repository)")],
                targets: [
                    .executableTarget(
                        name: "uses-obsclient", dependencies: [.product(name: "ObsClient", package: "\(identity)")],
                        swiftSettings: [.unsafeFlags(["-warnings-as-errors"])])
                ]
            )

            """
        try FileManager.default.createDirectory(atPath: directory + "/Sources/uses-obsclient", withIntermediateDirectories: true)
        try manifest.write(toFile: directory + "/Package.swift", atomically: true, encoding: .utf8)
        try source.write(toFile: directory + "/Sources/uses-obsclient/UsesObsClient.swift", atomically: true, encoding: .utf8)
    }

    /// The program: the calls of ObsClient.docc's Getting Started, one line of output each.
    static let source = #"""
        import ObsClient

        struct Layout: Codable, Sendable, Equatable {
            var columns: Int
            var compact: Bool
        }

        @main
        struct UsesObsClient {
            @MainActor
            static func main() async throws {
                let arguments = CommandLine.arguments
                let socket = arguments.firstIndex(of: "--socket").map { arguments[$0 + 1] }

                let connection = try await ObsConnection.connect(socketPath: socket)
                let hello = try await connection.hello(client: "uses-obsclient")
                print("hello: \(hello.server), protocol \(hello.protocolVersion)")

                let written = try await connection.set("theme", to: "dark", in: "ui")
                print("set: revision \(written.revision), changed \(written.changed)")
                if let entry = try await connection.get("theme", in: "ui") {
                    print("get: \(entry.value) at revision \(entry.revision)")
                }

                let subscription = try await connection.subscribe(to: "ui", selecting: .keys(["theme"]), initial: true)
                var events = subscription.makeAsyncIterator()
                if case .snapshot(let revision, let values)? = try await events.next() {
                    print("snapshot at \(revision): theme = \(values["theme"]?.description ?? "-")")
                }
                try await connection.set("theme", to: "light", in: "ui")
                if case .change(let event)? = try await events.next(), let change = event.change(for: "theme") {
                    print("change at \(event.revision): theme \(change.old?.description ?? "-") -> \(change.new?.description ?? "-")")
                }

                do {
                    try await connection.set("theme", to: "blue", in: "ui", ifRevision: 1)
                } catch {
                    guard error.code == .conflict else { throw error }
                    print("conflict: ifRevision 1 is stale")
                }

                let statistics = try await connection.statistics()
                print("statistics: \(statistics.repositories) repository, \(statistics.subscriptions) subscription")
                try await subscription.cancel()
                await connection.close()

                let session = ObsSession(socketPath: socket)
                try await session.set("layout", to: Layout(columns: 3, compact: true), in: "ui")
                if let layout = try await session.get("layout", in: "ui", as: Layout.self) {
                    print("typed: \(layout.value) at revision \(layout.revision)")
                }
                let mirrored = RemoteValue("layout", in: "ui", as: Layout.self, session: session)
                let result = try await mirrored.update { current in
                    var next = current ?? Layout(columns: 1, compact: false)
                    next.columns += 1
                    return next
                }
                if case .applied(let revision) = result, let value = mirrored.value {
                    print("mirror: \(value) applied at revision \(revision)")
                }
                await session.close()
            }
        }

        """#
}
