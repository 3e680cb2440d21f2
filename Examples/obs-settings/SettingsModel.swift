// obs-settings — the model: an app's appearance settings as an `@Observable` object, kept in
// obsd as one `Codable` value and mirrored by a `RemoteValue`. Everything a view would read is
// a property (`effective`, `summary`), so Observation tells a view — or this example's
// printing loop — exactly when to redraw; changes are read-modify-write with
// compare-and-set, retried when another writer got there first.

import ObsClient

/// The colour scheme.
enum Theme: String, Codable, Sendable {
    case light, dark
}

/// The stored settings: one JSON object in obsd (`{"theme":"dark","fontSize":14}`).
struct Appearance: Codable, Sendable, Equatable {
    var theme: Theme = .light
    var fontSize: Int = 13
}

/// An app's appearance settings, shared by every process that uses the same obsd.
@MainActor @Observable
final class SettingsModel {
    /// The key, as the daemon holds it.
    let appearance: RemoteValue<Appearance>

    init(session: ObsSession) {
        appearance = RemoteValue("appearance", in: "settings", as: Appearance.self, session: session)
    }

    /// Whether the settings have been read from the daemon at least once.
    var isLoaded: Bool { appearance.current.isLoaded }

    /// The settings in effect: the stored ones, or the defaults while there are none (or
    /// while the stored value is not an `Appearance`).
    var effective: Appearance { appearance.value ?? Appearance() }

    /// One line a view would show.
    var summary: String {
        var line = "theme=\(effective.theme.rawValue) fontSize=\(effective.fontSize)"
        if !appearance.current.exists { line += " (defaults)" }
        if let problem = appearance.current.decodingError { line += " (stored value ignored: \(problem.message))" }
        return line
    }

    /// Switches between light and dark.
    func toggleTheme() async throws(ObsClientError) -> RemoteWriteResult {
        try await change { $0.theme = $0.theme == .light ? .dark : .light }
    }

    /// Makes the text bigger (or, with a negative `delta`, smaller), from 8 to 72 points.
    func changeFontSize(by delta: Int) async throws(ObsClientError) -> RemoteWriteResult {
        try await change { $0.fontSize = min(max($0.fontSize + delta, 8), 72) }
    }

    /// Reads the settings, edits them and writes them back only if nobody wrote them in
    /// between (compare-and-set on the key's revision); on a conflict, again on the newer value.
    private func change(_ edit: (inout Appearance) -> Void) async throws(ObsClientError) -> RemoteWriteResult {
        while true {
            let result = try await appearance.update { current in
                var next = current ?? Appearance()
                edit(&next)
                return next
            }
            if result != .conflict { return result }
        }
    }
}
