// obs-settings — an example app of the ObsClient library, which is all it imports: an
// `@Observable` settings model (SettingsModel.swift) driven by `RemoteValue` with `Codable`
// types, without SwiftUI. `show` prints the model's summary each time Observation says it
// changed, as a view would redraw; the other commands change the settings through the model.
//
//   obs-settings [--socket PATH] show [--count N]
//   obs-settings [--socket PATH] toggle-theme | bigger | smaller
//
// `show` prints `theme=light fontSize=13 (defaults)`-like lines (--count: exit after N); a
// change prints `applied at revision R: <summary>` or `unchanged at revision R: <summary>`.

import ObsClient

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Prints a line and flushes it (standard output may be a file or a pipe, which buffer).
func say(_ line: String) {
    print(line)
    fflush(nil)
}

@main
struct ObsSettings {
    static let usage = "usage: obs-settings [--socket PATH] show [--count N] | toggle-theme | bigger | smaller"

    @MainActor
    static func main() async throws {
        var socket: String?
        var count: Int?
        var command: String?
        var arguments = CommandLine.arguments.dropFirst()
        while let argument = arguments.popFirst() {
            switch argument {
            case "--socket": socket = arguments.popFirst()
            case "--count": count = arguments.popFirst().flatMap { Int($0) }
            default:
                guard command == nil else { throw UsageError(usage) }
                command = argument
            }
        }
        let session = ObsSession(socketPath: socket)
        let model = SettingsModel(session: session)
        switch command {
        case "show": try await show(model, count: count)
        case "toggle-theme": report(try await model.toggleTheme(), model)
        case "bigger": report(try await model.changeFontSize(by: 1), model)
        case "smaller": report(try await model.changeFontSize(by: -1), model)
        default: throw UsageError(usage)
        }
        await session.close()
    }

    /// Prints the summary once loaded, then each time it changes (`count` lines at most).
    @MainActor
    static func show(_ model: SettingsModel, count: Int?) async throws {
        var shown: String?
        var lines = 0
        while count.map({ lines < $0 }) ?? true {
            if model.isLoaded, model.summary != shown {
                shown = model.summary
                say(model.summary)
                lines += 1
                continue
            }
            if let failure = model.appearance.failure { throw failure }
            await nextChange { _ = model.summary; _ = model.isLoaded; _ = model.appearance.failure }
        }
    }

    @MainActor
    static func report(_ result: RemoteWriteResult, _ model: SettingsModel) {
        switch result {
        case .applied(let revision): say("applied at revision \(revision): \(model.summary)")
        case .unchanged(let revision): say("unchanged at revision \(revision): \(model.summary)")
        case .conflict: say("conflict: \(model.summary)")  // not returned: the model retries
        }
    }

    /// Suspends until something `read` reads changes.
    @MainActor
    static func nextChange(_ read: () -> Void) async {
        await withCheckedContinuation { continuation in
            withObservationTracking(read) { continuation.resume() }
        }
    }
}

/// A command line this program does not understand.
struct UsageError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
