// swift-tools-version:6.1
import PackageDescription

let package = Package(
    name: "obsd",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "obsd", targets: ["obsd"]),
        .executable(name: "obsctl", targets: ["obsctl"]),
        .library(name: "ObservableKit", targets: ["ObservableKit"]),
        .library(name: "ObsProtocol", targets: ["ObsProtocol"]),
        .library(name: "ObsClient", targets: ["ObsClient"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-log.git", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.8.2"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle.git", from: "2.13.0"),
    ],
    targets: [
        // Core observation types: keys, changes, keyed state, observer sets, repository. No I/O.
        .target(name: "ObservableKit"),
        // The wire protocol: JSON, framing, requests, replies, events. No networking.
        .target(name: "ObsProtocol", dependencies: ["ObservableKit"]),
        // The system SQLite (libsqlite3-dev).
        .systemLibrary(name: "CSQLite", pkgConfig: "sqlite3", providers: [.apt(["libsqlite3-dev"])]),
        // What the daemon persists and how: stored values, revision records, the storage
        // boundary, and the SQLite store with group commit.
        .target(name: "ObsStore", dependencies: ["ObservableKit", "ObsProtocol", "CSQLite"]),
        // The daemon: SwiftNIO server, subscriptions, fan-out, history.
        .target(
            name: "ObsServer",
            dependencies: [
                "ObservableKit", "ObsProtocol", "ObsStore",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ]),
        // The async client library. Never depends on the daemon.
        .target(
            name: "ObsClient",
            dependencies: [
                "ObservableKit", "ObsProtocol",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ]),
        .executableTarget(
            name: "obsd",
            dependencies: [
                "ObsServer", "ObsStore",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ]),
        .executableTarget(
            name: "obsctl",
            dependencies: [
                "ObsClient",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),
        // The benchmark load generator (see README, "Performance").
        .executableTarget(
            name: "obsbench",
            dependencies: [
                "ObsProtocol", "ObsClient",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),

        .testTarget(name: "ObservableKitTests", dependencies: ["ObservableKit"]),
        .testTarget(name: "ObsProtocolTests", dependencies: ["ObsProtocol", "ObservableKit"]),
        // Starts the real obsd binary on a temporary socket; drives it over raw sockets,
        // through ObsClient and through obsctl.
        .testTarget(name: "EndToEndTests", dependencies: ["ObsClient", "ObsProtocol", "ObservableKit", "obsd", "obsctl"]),
    ]
)
