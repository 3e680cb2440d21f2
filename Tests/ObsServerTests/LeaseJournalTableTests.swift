// The lease table over a real lease journal: what it records — grants, ends and attachments,
// across the journal's rewrites — reads back as the table's state, also when a move is what
// triggers the rewrite (the rewrite holds the table's state first, then the move).

import Foundation
import Logging
import ObsProtocol
import ObsStore
import ObservableKit
import TestSupport
import Testing

@testable import ObsServer

@Suite struct LeaseJournalTableTests {
    @Test func movesAcrossARewriteReadBackAsTheTableHasThem() throws {
        let dir = FileManager.default.temporaryDirectory.appendingPathComponent("obsd-lease-table-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
        let journal = try LeaseJournal(directory: dir, sync: .relaxed(interval: .seconds(1)), logger: Logger(label: "test"))
        let table = LeaseTable(journal: journal)
        let owner = Writer(uid: 1000, gid: 1000, pid: 7)
        let connection = ConnectionID.next()
        guard case .success(let kept) = table.grant(owner: owner, ttl: 60, connection: connection, now: 0, limit: 10),
            case .success(let gone) = table.grant(owner: owner, ttl: 60, connection: connection, now: 0, limit: 10)
        else { throw TestFailure("grants refused") }
        // Enough moves of long keys to take the journal past its rewrite threshold (1 MiB),
        // so that some move is the one that triggers a rewrite; every move must survive.
        let long = String(repeating: "k", count: 1000)
        let keys = (0..<3000).map { Key("\(long)\($0)") }
        for key in keys { table.move(key, of: "r", from: nil, to: kept) }
        table.move(keys[0], of: "r", from: kept, to: gone)
        _ = table.revoke(gone, by: Peer(uid: 1000, gid: 1000, pid: 7, daemonUID: 0))
        journal.close()

        let found = try LeaseJournal(directory: dir, sync: .always, logger: Logger(label: "test")).takeLoaded()
        #expect(found.live.keys.sorted() == [kept] && found.nextID == gone + 1)
        let attached = found.attachments["r"] ?? [:]
        #expect(attached.count == 3000 && keys.dropFirst().allSatisfy { attached[$0] == kept }, "\(attached.count) keys attached")
        #expect(attached[keys[0]] == gone && found.ended[gone]?.reason == .revoked, "the moved key's lease, ended")
    }
}
