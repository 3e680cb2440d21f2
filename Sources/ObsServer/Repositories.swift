// ObsServer — the repositories by name, daemon-wide: which exist, which are placeholders, and
// when a placeholder goes.
//
// A repository exists (is listed by `repos`) once a write changed it (revision > 0). Reading
// a repository that does not exist creates nothing. Subscribing to one — or writing to it
// while the write waits for a shared store — holds an empty, unlisted placeholder, dropped
// again when nobody uses it. A repository that was ever written in this process is never
// dropped, so the common path — a write or subscribe to such a repository — takes this lock
// once, for a dictionary lookup, and nobody can hold a repository the daemon no longer has.

import ObsStore
import ObservableKit

/// The repositories held in memory, by name.
final class Repositories: Sendable {
    private struct Slot {
        let repository: Repository
        /// Operations in progress that may create or register into this repository.
        var users = 0
    }

    private let map = Locked<[String: Slot]>([:])
    private let make: @Sendable (_ name: String, _ loaded: LoadedRepository?) -> Repository
    private let stats: ServerStats

    /// The repositories storage `loaded`, and `make` for each new one.
    init(loaded: [LoadedRepository], stats: ServerStats, make: @escaping @Sendable (_ name: String, _ loaded: LoadedRepository?) -> Repository) {
        self.make = make
        self.stats = stats
        let made = loaded.map { ($0.name, make($0.name, $0)) }
        map.withLock { map in
            for (name, repository) in made { map[name] = Slot(repository: repository) }
        }
        stats.repositories.store(loaded.filter { $0.state.revision > 0 }.count, ordering: .relaxed)
    }

    /// The repository if it exists or is held; never creates one.
    func existing(_ name: String) -> Repository? {
        map.withLock { $0[name]?.repository }
    }

    /// The repository `name` (created, unlisted and empty, if needed), kept until `release`.
    func hold(_ name: String) -> Repository {
        map.withLock { map -> Repository in
            if map[name] == nil { map[name] = Slot(repository: make(name, nil)) }
            map[name]!.users += 1
            return map[name]!.repository
        }
    }

    /// Ends a `hold`: drops the repository if it is a placeholder nobody uses.
    func release(_ name: String) {
        map.withLock { map in
            guard var slot = map[name] else { return }
            slot.users -= 1
            map[name] = Self.isDisposable(slot) ? nil : slot
        }
    }

    /// Repository `name` kept for good (a shared store delivered revisions of it), made if
    /// need be — under the map's lock, so a placeholder cannot be dropped between here and the
    /// install that makes it a repository.
    func permanent(_ name: String) -> Repository {
        map.withLock { map -> Repository in
            let repository = map[name]?.repository ?? make(name, nil)
            if map[name] == nil { map[name] = Slot(repository: repository) }
            repository.makePermanent()
            return repository
        }
    }

    /// Called after a subscription to `repository` ended, by whoever ended it (a session, or
    /// a connection for what its loop's delivery ended): drops the repository if it was a
    /// placeholder nobody uses any more.
    func subscriptionEnded(_ repository: Repository) {
        guard !repository.isPermanent else { return }
        map.withLock { map in
            if let slot = map[repository.name], slot.repository === repository, Self.isDisposable(slot) { map[repository.name] = nil }
        }
    }

    private static func isDisposable(_ slot: Slot) -> Bool {
        slot.users == 0 && !slot.repository.isPermanent && slot.repository.subscriberCount == 0
    }

    /// Every repository held, placeholders included, in no order.
    var all: [Repository] {
        map.withLock { $0.values.map(\.repository) }
    }

    /// The repositories that exist (revision > 0), sorted by name.
    func listed() -> [Repository] {
        all.filter { $0.revision > 0 }.sorted { $0.name.utf8.lexicographicallyPrecedes($1.name.utf8) }
    }

    /// The number of repositories that exist.
    var count: Int { stats.repositories.load(ordering: .relaxed) }

    /// The repository objects held in memory: those that exist, and placeholders for
    /// subscriptions and writes under way (privileged `stats`: `repositoriesHeld`).
    var heldCount: Int { map.withLock { $0.count } }
}
