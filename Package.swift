// swift-tools-version:6.1
import PackageDescription

// The daemon's own modules (ObsStore, ObsCore, ObsServer) skip the run-time exclusivity
// checks in release builds: a profile of fan-out to 100 put ~20 % of the daemon's CPU in
// swift_beginAccess and its thread-local bookkeeping, and one of writes at 64 in flight ~1 %
// more in the flat table's lookups. Debug builds — every test run — keep them, so a violation
// still traps in the tests. Never on the library products or what they import: a package
// that uses them must not inherit unsafe flags.
var daemonReleaseSettings: [SwiftSetting] {
    [.unsafeFlags(["-enforce-exclusivity=unchecked"], .when(configuration: .release))]
}

let package = Package(
    name: "obsd",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "obsd", targets: ["obsd"]),
        .executable(name: "obsctl", targets: ["obsctl"]),
        .library(name: "ObservableKit", targets: ["ObservableKit"]),
        .library(name: "ObsProtocol", targets: ["ObsProtocol"]),
        .library(name: "ObsClient", targets: ["ObsClient"]),
        .library(name: "ObsEtcd", targets: ["ObsEtcd"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-log.git", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.8.2"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle.git", from: "2.13.0"),
        .package(url: "https://github.com/LebJe/TOMLKit.git", from: "0.6.0"),
        // Typed errno, stat and file descriptors for the daemon's files (already in SwiftNIO's graph).
        .package(url: "https://github.com/apple/swift-system.git", from: "1.8.1"),
        // Heap, for timer and lease deadlines (already in SwiftNIO's graph).
        .package(url: "https://github.com/apple/swift-collections.git", from: "1.6.0"),
        // `make docs`: the DocC catalogs of ObsClient and ObservableKit (no code of it is linked).
        .package(url: "https://github.com/swiftlang/swift-docc-plugin", from: "1.5.0"),
        // obsctl's child processes (`hold -- COMMAND`, `watch --exec`). Without its Foundation
        // trait: obsctl links no Foundation.
        .package(url: "https://github.com/swiftlang/swift-subprocess.git", from: "1.0.2", traits: []),
    ],
    targets: [
        // Core observation types: keys, changes, keyed state, observer sets, repository. No I/O.
        .target(name: "ObservableKit"),
        // The values every layer shares: JSON values, the parser and writer, their canonical
        // encoding, a writer's credentials, a lease's end. No I/O.
        .target(name: "ObsValues", dependencies: ["ObservableKit"]),
        // The wire protocol: framing, requests, replies, events, error codes. No networking.
        .target(name: "ObsProtocol", dependencies: ["ObservableKit", "ObsValues"]),
        // The system SQLite (libsqlite3-dev).
        .systemLibrary(name: "CSQLite", pkgConfig: "sqlite3", providers: [.apt(["libsqlite3-dev"])]),
        // What the daemon persists and how: revision records, the storage boundary, the
        // write-ahead log with group commit, a repository's entries in flat tables, and the
        // compacted state in a snapshot file (SQLite only to read an earlier obsd's state).
        .target(
            name: "ObsStore",
            dependencies: [
                "ObservableKit", "ObsValues", "CSQLite", "CLinux",
                // FileDescriptor, FilePath and Errno: the store's file system calls (FileSystem.swift).
                .product(name: "SystemPackage", package: "swift-system"),
                .product(name: "Logging", package: "swift-log"),
            ],
            swiftSettings: daemonReleaseSettings),
        // A repository's values, revisions and history as the daemon keeps them: the write rules
        // and limits, undo, revisions recorded once as flat records, what a subscription starts
        // with. No connection, loop, socket or lock.
        .target(name: "ObsCore", dependencies: ["ObservableKit", "ObsValues", "ObsProtocol", "ObsStore"], swiftSettings: daemonReleaseSettings),
        // Linux facts Swift's Glibc module hides: which file a descriptor is (statx, for the
        // store's provenance checks), how many CPUs the process may use (sched_getaffinity);
        // and the CPU's CRC-32C instruction (the store's checksums).
        .target(name: "CLinux"),
        // libsystemd (libsystemd-dev) and the small Swift module over it: notify, listen fds, journal.
        .systemLibrary(name: "CSystemd", pkgConfig: "libsystemd", providers: [.apt(["libsystemd-dev"])]),
        .target(name: "Systemd", dependencies: ["CSystemd", .product(name: "Logging", package: "swift-log")]),
        // The daemon's settings: defaults, configuration file (TOML), environment, flags.
        .target(name: "ObsConfig", dependencies: [.product(name: "TOMLKit", package: "TOMLKit")]),
        // The daemon: its event loops and connections, sessions, the sequencers that decide
        // writes, delivery to subscribers, and the server as a Service.
        .target(
            name: "ObsServer",
            dependencies: [
                "ObservableKit", "ObsProtocol", "ObsStore", "ObsCore", "CLinux",
                // Only for `System.coreCount` (cgroup quotas and cpusets honoured): the daemon's
                // connections run on its own event loops (docs/ARCHITECTURE.md).
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "SystemPackage", package: "swift-system"),
                .product(name: "HeapModule", package: "swift-collections"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ],
            swiftSettings: daemonReleaseSettings),
        // The async client library. Never depends on the daemon. An app imports it alone: it
        // re-exports the values, keys and typed replies it needs (Sources/ObsClient/Exports.swift).
        .target(
            name: "ObsClient",
            dependencies: [
                "ObservableKit", "ObsValues", "ObsProtocol",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ]),
        // An etcd v3 client for the daemon (several hosts, issue 14): etcd's JSON gateway over a
        // small HTTP/1.1 client on NIOHTTP1 — no package beyond swift-nio (docs/etcd-notes.md).
        .target(
            name: "ObsEtcd",
            dependencies: [
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ]),
        // Repositories shared by several daemons through etcd (issue 14): the key layout, start-up,
        // the watch that delivers every daemon's revisions, commits and linearizable reads —
        // ObsStore's SharedStorage over ObsEtcd. The daemon (ObsServer) never sees etcd.
        .target(
            name: "ObsCluster",
            dependencies: [
                "ObsEtcd", "ObsStore", "ObsProtocol", "ObservableKit", .product(name: "Logging", package: "swift-log"),
            ]),
        // Latency figures for docs/etcd-notes.md against a running cluster (not a test).
        .executableTarget(name: "obs-etcd-bench", dependencies: ["ObsEtcd"]),
        .executableTarget(
            name: "obsd",
            dependencies: [
                "ObsServer", "ObsStore", "ObsConfig", "ObsCluster", "Systemd", "ObservableKit",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
            ]),
        .executableTarget(
            name: "obsctl",
            dependencies: [
                "ObsClient",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Subprocess", package: "swift-subprocess"),
            ]),
        // The example apps of the client library (README, "The Swift client library"): each
        // imports ObsClient alone. The mirror prints a repository as it changes; the settings
        // app is an @Observable model over RemoteValue with Codable types.
        .executableTarget(name: "obs-mirror", dependencies: ["ObsClient"], path: "Examples/obs-mirror"),
        .executableTarget(name: "obs-settings", dependencies: ["ObsClient"], path: "Examples/obs-settings"),
        // libFuzzer harness for the framer and request decoder (fuzz/run.sh); a corpus
        // replayer when built normally.
        .executableTarget(name: "obsfuzz", dependencies: ["ObsProtocol", "ObservableKit"]),
        // <sys/epoll.h>, which Swift's Glibc module leaves out, for obsbench's raw event loop.
        .systemLibrary(name: "CEpoll"),
        // The benchmark load generator (see docs/PERFORMANCE.md).
        .executableTarget(
            name: "obsbench",
            dependencies: [
                "ObsProtocol", "ObsClient", "ObservableKit", "CEpoll",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),

        .testTarget(name: "ObservableKitTests", dependencies: ["ObservableKit"]),
        .testTarget(name: "ObsProtocolTests", dependencies: ["ObsProtocol", "ObservableKit"]),
        .testTarget(name: "ObsConfigTests", dependencies: ["ObsConfig"]),
        // The value core in process: rules, records, undo, subscription starts, attachments.
        .testTarget(name: "ObsCoreTests", dependencies: ["ObsCore", "ObsStore", "ObsProtocol", "ObsValues", "ObservableKit", "TestSupport"]),
        // In-process tests of the client library's parts that need no daemon (the mirrors' merging).
        .testTarget(name: "ObsClientTests", dependencies: ["ObsClient", "ObsProtocol", "ObservableKit"]),
        .testTarget(
            name: "ObsStoreTests",
            dependencies: [
                "ObsStore", "ObsProtocol", "ObservableKit", "TestSupport", .product(name: "Logging", package: "swift-log"),
                .product(name: "SystemPackage", package: "swift-system"),
            ]),
        // In-process tests of the daemon's parts: hub, outbox, connection handler.
        .testTarget(
            name: "ObsServerTests",
            dependencies: [
                "ObsServer", "ObsCore", "ObsStore", "ObsProtocol", "ObservableKit", "CLinux", "TestSupport",
                .product(name: "Logging", package: "swift-log"),
            ]),
        // Test support; InProcessDaemon runs the daemon (ObsServer) in the test process.
        .target(
            name: "TestSupport", dependencies: ["ObservableKit", "ObsStore", "ObsProtocol", "ObsServer", .product(name: "Logging", package: "swift-log")],
            path: "Tests/TestSupport"),
        // ObsEtcd against a real 3-member etcd cluster on loopback (TestSupport's EtcdCluster).
        .testTarget(name: "ObsEtcdTests", dependencies: ["ObsEtcd", "TestSupport"]),
        // ObsCluster's encodings and key layout, without a cluster; and two real obsd daemons
        // sharing a real 3-member etcd cluster on loopback (ClusterTests) — or one daemon run
        // in the test process, for settings the obsd binary would refuse (a tiny tombstone bound).
        .testTarget(
            name: "ObsClusterTests",
            dependencies: [
                "ObsCluster", "ObsStore", "ObsProtocol", "ObservableKit", "ObsClient", "ObsEtcd", "TestSupport", "obsd",
                .product(name: "Logging", package: "swift-log"),
            ]),
        .testTarget(name: "SystemdTests", dependencies: ["Systemd", "TestSupport", .product(name: "Logging", package: "swift-log")]),
        // Starts the real obsd binary on a temporary socket; drives it over raw sockets,
        // through ObsClient and through obsctl.
        // Some run the daemon in-process instead, with a storage that fails on demand.
        .testTarget(
            name: "EndToEndTests",
            dependencies: [
                "ObsClient", "ObsProtocol", "ObservableKit", "ObsServer", "ObsStore", "ObsConfig", "TestSupport", "obsd", "obsctl",
                "obs-mirror", "obs-settings", .product(name: "Logging", package: "swift-log"),
            ]),
    ]
)
