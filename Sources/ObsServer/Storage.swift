// ObsServer — the boundary between the daemon and where repositories are kept.
//
// The daemon commits revisions in memory and hands each to its `Storage`, in revision
// order per repository. `InMemoryStorage` keeps nothing (tests and ephemeral buses);
// persistent stores plug in here.

import ObsProtocol
import ObservableKit

/// A repository as found in storage at start-up.
struct LoadedRepository: Sendable {
    let name: String
    let state: KeyedState<StoredValue>
    /// The retained history, oldest first, ending at `state.revision`.
    let history: [RevisionRecord]
}

/// Where the daemon keeps repositories.
protocol Storage: Sendable {
    /// Everything stored, read once at start-up.
    func load() throws -> [LoadedRepository]
    /// Records a committed revision. Called in revision order for each repository.
    func append(_ record: RevisionRecord)
    /// Flushes and releases resources.
    func close()
}

/// Keeps nothing: repositories live only as long as the process.
struct InMemoryStorage: Storage {
    func load() -> [LoadedRepository] { [] }
    func append(_ record: RevisionRecord) {}
    func close() {}
}
