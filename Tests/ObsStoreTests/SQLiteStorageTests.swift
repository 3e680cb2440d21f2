// Tests of the SQLite store on its own: what a failing record takes down with it (only
// itself and the revisions built on it), and what append promises while it is closed.

import Foundation
import ObsProtocol
import ObsStore
import ObservableKit
import Synchronization
import Testing

/// A repository as the store sees it: records what storage reports.
final class ListenerStub: DurabilityListener {
    let epoch = Epoch.random()
    private let reports = Mutex<(durable: UInt64, failedAfter: UInt64?)>((0, nil))

    func durable(through revision: UInt64) { reports.withLock { $0.durable = max($0.durable, revision) } }
    func failed(after revision: UInt64, error: StorageError) { reports.withLock { $0.failedAfter = revision } }

    var durable: UInt64 { reports.withLock { $0.durable } }
    var failedAfter: UInt64? { reports.withLock { $0.failedAfter } }
}

func record(_ repo: String, _ revision: UInt64, _ key: String = "k", _ value: JSONValue = 1) -> RevisionRecord {
    RevisionRecord(
        repo: repo, changeSet: ChangeSet(revision: revision, changes: [Change(key: Key(key), old: nil, new: CanonicalJSON(value))]),
        time: 1_700_000_000)
}

func temporaryDirectory() -> String {
    var template = Array("/tmp/obsstore-test-XXXXXX".utf8CString)
    return template.withUnsafeMutableBufferPointer { String(cString: mkdtemp($0.baseAddress!)) }
}

@Suite struct SQLiteStorageTests {
    @Test func aRefusedRecordFailsAloneWithTheRevisionsBuiltOnIt() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (a, b) = (ListenerStub(), ListenerStub())
        do {
            let storage = try SQLiteStorage(options: .init(directory: dir, sync: .always, historyLimit: 100, historyMaxAge: nil))
            // Many records of two repositories queued at once share group commits; a's second
            // revision 2 is refused by the database (its history row exists: a constraint).
            for rev in 1...50 as ClosedRange<UInt64> { #expect(storage.append(record("b", rev), listener: b)) }
            #expect(storage.append(record("a", 1), listener: a))
            #expect(storage.append(record("a", 2), listener: a))
            #expect(storage.append(record("a", 2, "other"), listener: a))
            #expect(storage.append(record("a", 3), listener: a))
            for rev in 51...100 as ClosedRange<UInt64> { #expect(storage.append(record("b", rev), listener: b)) }
            storage.close()
            #expect(b.durable == 100 && b.failedAfter == nil, "another repository's writes in the same commits are kept")
            #expect(a.durable == 2, "a's revisions before the refused one are kept")
            #expect(a.failedAfter == 2, "the refused revision and the one built on it fail")
        }  // releases the data directory
        let reopened = try SQLiteStorage(options: .init(directory: dir, sync: .always, historyLimit: 100, historyMaxAge: nil))
        let loaded = Dictionary(uniqueKeysWithValues: try reopened.load().map { ($0.name, $0) })
        #expect(loaded["a"]?.state.revision == 2 && loaded["b"]?.state.revision == 100)
        #expect(loaded["a"]?.epoch == a.epoch && loaded["b"]?.epoch == b.epoch, "each repository's epoch is stored with it")
        reopened.close()
    }

    @Test func aClosedStoreRefusesAppendsWithoutCallingBack() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let storage = try SQLiteStorage(options: .init(directory: dir, sync: .always, historyLimit: 100, historyMaxAge: nil))
        let a = ListenerStub()
        #expect(storage.append(record("a", 1), listener: a))
        storage.close()
        #expect(a.durable == 1, "close makes everything queued durable first")
        #expect(!storage.append(record("a", 2), listener: a), "closed: refused")
        #expect(a.failedAfter == nil && a.durable == 1, "and the caller, who holds its lock, is not called")
    }
}
