// Tests of the test-only failpoints (Failpoints.swift): the modifiers, and the `.fired` file
// beside a spec file, which a test waits on for a fault it could not otherwise see.

import Foundation
@testable import ObsStore
import Testing
import TestSupport

@Suite(.mayBlock) struct FailpointsTests {
    @Test func afterAndTimesPickTheHitsThatTrigger() {
        let f = Failpoints(spec: "wal.write=drop@after(2)@times(2);store.segment-size=value(4096)", seed: 1)
        let hits = (1...6).map { _ in f.evaluate("wal.write") }
        #expect(hits == [nil, nil, .drop, .drop, nil, nil])
        #expect(f.evaluate("wal.fdatasync") == nil)
        #expect(f.value("store.segment-size") == 4096)
    }

    @Test func aSpecReadFromAFileNotesEachTriggerBesideIt() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = dir + "/failpoints"
        try "wal.write=drop@times(1)\n".write(toFile: path, atomically: true, encoding: .utf8)
        let f = Failpoints(spec: "@" + path, seed: 1)
        #expect(!FileManager.default.fileExists(atPath: path + ".fired"), "nothing triggered yet")
        #expect(f.evaluate("wal.write") == .drop)
        #expect(f.evaluate("wal.write") == nil)
        #expect(try String(contentsOfFile: path + ".fired", encoding: .utf8) == "wal.write drop\n")
    }
}
