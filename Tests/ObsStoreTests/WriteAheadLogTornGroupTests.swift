// Tests of torn groups in the write-ahead log: a crash during a group's write (a power loss
// under `sync = always`) may leave any of its sectors unwritten — zeros — so a damaged record
// can be followed by valid records of the same group, never acknowledged. Replay keeps the
// records before the damage, cuts the rest and reports it, and the log goes on; a lost sector
// followed by a later group's start, or a byte changed rather than lost, is refused as before. Segments an earlier obsd wrote (format 1, no group
// starts) are read as they were and never appended to.

import Foundation
import TestSupport
import Testing

@testable import ObsStore

#if canImport(Glibc)
import Glibc
#endif

/// A group of `count` records of 1,400 bytes, each its `tag` then its index.
private func group(_ count: Int, tag: UInt8, start: Bool = true) -> [UInt8] {
    var group: [UInt8] = []
    if start { WriteAheadLog.startGroup(into: &group) }
    for i in 0..<count {
        ([tag, UInt8(i)] + [UInt8](repeating: tag, count: 1398)).withUnsafeBytes { WriteAheadLog.frame($0, into: &group) }
    }
    return group
}

/// What a fresh log over `dir` replays (each record's tag and index), and its report.
private func replay(_ dir: String) throws -> (records: [[UInt8]], replay: WriteAheadLog.Replay, log: WriteAheadLog) {
    let log = WriteAheadLog(directory: dir, segmentSize: 4 << 20)
    var records: [[UInt8]] = []
    let replay = try log.open(after: 0) { payload, _ in records.append(Array(payload.prefix(2))) }
    return (records, replay, log)
}

/// Overwrites `bytes` at log position `position` of the segment at `path`.
private func overwrite(_ path: String, at position: UInt64, with bytes: [UInt8]) throws {
    let base = try #require(UInt64(URL(fileURLWithPath: path).deletingPathExtension().lastPathComponent, radix: 16))
    let fd = open(path, O_WRONLY)
    defer { close(fd) }
    #expect(bytes.withUnsafeBytes { pwrite(fd, $0.baseAddress, bytes.count, off_t(position - base)) } == bytes.count)
}

/// Zeros the first whole sector inside the frame at log position `frame` of the segment at
/// `path`: a sector the crash kept from the disk.
private func loseSector(_ path: String, inFrameAt frame: UInt64) throws {
    let base = try #require(UInt64(URL(fileURLWithPath: path).deletingPathExtension().lastPathComponent, radix: 16))
    let offset = Int(frame - base)
    let sector = (offset + 8 + 511) / 512 * 512
    try #require(sector + 512 <= offset + 1408)
    try overwrite(path, at: base + UInt64(sector), with: [UInt8](repeating: 0, count: 512))
}

private func segmentFiles(_ dir: String) throws -> [String] {
    try FileManager.default.contentsOfDirectory(atPath: dir).filter { $0.hasSuffix(".wal") }.sorted().map { dir + "/" + $0 }
}

@Suite(.mayBlock) struct WriteAheadLogTornGroupTests {
    /// Frame sizes: a group start is 16 bytes, a 1,400-byte record 1,408.
    static let record = 1408
    static let start = 16

    @Test func aTornLastGroupKeepsTheRecordsBeforeTheDamageAndTheLogGoesOn() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (_, _, log) = try replay(dir)
        _ = try log.append(group(2, tag: 1))
        try log.sync()
        let groupStart = log.position
        _ = try log.append(group(3, tag: 2))
        try log.sync()
        let path = try #require(try segmentFiles(dir).first)
        // The middle record of the second group lost a sector; the one after it is whole.
        try loseSector(path, inFrameAt: groupStart + UInt64(Self.start + Self.record))

        let found = try replay(dir)
        #expect(found.records == [[1, 0], [1, 1], [2, 0]])
        #expect(found.replay.tornBytes == 2 * Self.record)
        #expect(found.replay.tornAt?.contains(path) == true)
        #expect(found.log.position == groupStart + UInt64(Self.start + Self.record))
        _ = try found.log.append(group(1, tag: 3))
        try found.log.sync()
        let again = try replay(dir)
        #expect(again.records == [[1, 0], [1, 1], [2, 0], [3, 0]])
        #expect(again.replay.tornBytes == 0 && again.replay.leftoverBytes == 0)
    }

    @Test func aTornGroupWhoseFirstRecordIsDamagedGoesWholeWithItsStart() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (_, _, log) = try replay(dir)
        _ = try log.append(group(1, tag: 1))
        let groupStart = log.position
        _ = try log.append(group(2, tag: 2))
        try log.sync()
        try loseSector(try #require(try segmentFiles(dir).first), inFrameAt: groupStart + UInt64(Self.start))

        let found = try replay(dir)
        #expect(found.records == [[1, 0]])
        #expect(found.log.position == groupStart, "the group's start is cut with it")
        #expect(found.replay.tornBytes == Self.start + 2 * Self.record)
    }

    @Test func aLostSectorFollowedByALaterGroupIsRefused() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (_, _, log) = try replay(dir)
        let first = log.position
        _ = try log.append(group(2, tag: 1))
        _ = try log.append(group(1, tag: 2))
        try log.sync()
        let path = try #require(try segmentFiles(dir).first)
        try loseSector(path, inFrameAt: first + UInt64(Self.start))
        #expect {
            _ = try replay(dir)
        } throws: { error in
            (error as? StorageError)?.description.contains("\(path): damaged record") == true
        }
    }

    /// A byte changed in the last group, records of it after: damage, not a torn write (a
    /// crash leaves zeros), so the records the group's sync made durable are not cut.
    @Test func aFlippedByteInTheLastGroupIsRefused() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let (_, _, log) = try replay(dir)
        let first = log.position
        _ = try log.append(group(3, tag: 1))
        try log.sync()
        let path = try #require(try segmentFiles(dir).first)
        try overwrite(path, at: first + UInt64(Self.start + 100), with: [0x55])
        #expect {
            _ = try replay(dir)
        } throws: { error in
            (error as? StorageError)?.description.contains("\(path): damaged record") == true
        }
    }

    /// A log an earlier obsd wrote: replayed as it is, and appended to in a new segment.
    @Test func aFormatOneSegmentIsReadAsItWasAndNeverAppendedTo() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
        var bytes = WriteAheadLog.magicFormat1
        withUnsafeBytes(of: UInt64(1).littleEndian) { bytes.append(contentsOf: $0) }
        bytes += group(3, tag: 1, start: false)
        let old = dir + "/0000000000000001.wal"
        #expect(FileManager.default.createFile(atPath: old, contents: Data(bytes)))

        let found = try replay(dir)
        #expect(found.records == [[1, 0], [1, 1], [1, 2]])
        _ = try found.log.append(group(1, tag: 2))
        try found.log.sync()
        let names = try segmentFiles(dir)
        #expect(names.count == 2, "appends went to a new segment")
        let header = try #require(FileManager.default.contents(atPath: names[1]))
        #expect(WriteAheadLog.format(of: header) == 3)
        #expect(try replay(dir).records == [[1, 0], [1, 1], [1, 2], [2, 0]])

        // In a format 1 segment, damage with any valid record after it is refused, as before.
        try FileManager.default.removeItem(atPath: names[1])
        try loseSector(old, inFrameAt: 1 + UInt64(WriteAheadLog.legacyHeaderSize))
        #expect {
            _ = try replay(dir)
        } throws: { error in
            (error as? StorageError)?.description.contains("damaged record") == true
        }
    }
}
