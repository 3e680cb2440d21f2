// obs-mirror — an example app of the ObsClient library, which is all it imports of obsd's:
// mirrors a repository into an `@Observable` RemoteRepository and prints it each time it
// changes, the way a SwiftUI view would redraw. It survives daemon restarts (the session
// reconnects and the mirror resumes without a gap); connection changes go to standard error.
//
//   obs-mirror REPO [--prefix P] [--socket PATH] [--count N]
//
// Each line: `rev R: {"key":value,...}` (keys sorted). --count exits after N lines.

import ObsClient

#if canImport(Glibc)
import Glibc
#endif

struct Options {
    var repository = ""
    var prefix: String?
    var socket: String?
    var count: Int?

    static func parse(_ arguments: [String]) -> Options? {
        var options = Options()
        var rest = arguments[...]
        while let argument = rest.popFirst() {
            switch argument {
            case "--prefix": options.prefix = rest.popFirst()
            case "--socket": options.socket = rest.popFirst()
            case "--count": options.count = rest.popFirst().flatMap { Int($0) }
            default:
                guard options.repository.isEmpty, !argument.hasPrefix("-") else { return nil }
                options.repository = argument
            }
        }
        return options.repository.isEmpty ? nil : options
    }
}

/// Suspends until something `read` reads from an observable object changes.
@MainActor func nextChange(_ read: () -> Void) async {
    await withCheckedContinuation { continuation in
        withObservationTracking(read) { continuation.resume() }
    }
}

/// Writes a line to standard error.
func report(_ line: String) {
    let bytes = Array((line + "\n").utf8)
    _ = bytes.withUnsafeBytes { write(2, $0.baseAddress, $0.count) }
}

func render(_ contents: RemoteRepository.Contents) -> String {
    let members = contents.values.sorted { $0.key.string < $1.key.string }.map { (name: $0.key.string, value: $0.value) }
    return "rev \(contents.revision): " + String(decoding: JSONValue.object(JSONObject(uniqueMembers: members)).jsonBytes(), as: UTF8.self)
}

@MainActor func mirror(_ options: Options) async {
    let session = ObsSession(socketPath: options.socket)
    let selection: Selection = options.prefix.map { .prefix($0) } ?? .all
    let repository = RemoteRepository(options.repository, selection: selection, session: session)
    var lines = 0
    var connection = repository.connection
    var shown: RemoteRepository.Contents?
    while options.count.map({ lines < $0 }) ?? true {
        await nextChange { _ = repository.contents; _ = repository.connection; _ = repository.failure }
        if let failure = repository.failure {
            report("obs-mirror: \(failure)")
            exit(1)
        }
        if repository.connection != connection {
            connection = repository.connection
            report("obs-mirror: \(connection)")
        }
        guard repository.contents.isLoaded, repository.contents != shown else { continue }
        shown = repository.contents
        print(render(repository.contents))
        fflush(nil)
        lines += 1
    }
    await session.close()
}

guard let options = Options.parse(Array(CommandLine.arguments.dropFirst())) else {
    report("usage: obs-mirror REPO [--prefix P] [--socket PATH] [--count N]")
    exit(64)
}
await mirror(options)
