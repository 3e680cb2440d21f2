// Tests of the write-ahead log's zeros ahead of its end (WriteAheadLog.zeroAhead): they are
// written where the file system would otherwise convert preallocated extents at each sync,
// and they change nothing replay finds — every frame, nothing torn, nothing left over — while
// a torn write inside them is still found and cut.

import Foundation
@testable import ObsStore
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A group of `count` frames whose payloads are `tag` repeated.
private func group(_ count: Int, tag: UInt8, size: Int = 100) -> [UInt8] {
    var group: [UInt8] = []
    WriteAheadLog.startGroup(into: &group)
    for _ in 0..<count {
        [UInt8](repeating: tag, count: size).withUnsafeBytes { WriteAheadLog.frame($0, into: &group) }
    }
    return group
}

/// A new, empty log in `dir`, open for appends.
private func openLog(_ dir: String) throws -> WriteAheadLog {
    let log = WriteAheadLog(directory: dir, segmentSize: 4 << 20)
    _ = try log.open(after: 0) { _, _ in }
    return log
}

/// Appends `group`, syncs it and writes zeros ahead, as the committer does.
private func commit(_ log: WriteAheadLog, _ group: [UInt8]) throws {
    _ = try log.append(group)
    try log.sync()
    log.zeroAhead()
}

/// Every payload a fresh log over `dir` replays, and what the replay reports.
private func replay(_ dir: String) throws -> (payloads: [[UInt8]], replay: WriteAheadLog.Replay, position: UInt64) {
    let log = WriteAheadLog(directory: dir, segmentSize: 4 << 20)
    var payloads: [[UInt8]] = []
    let replay = try log.open(after: 0) { payload, _ in payloads.append(Array(payload)) }
    return (payloads, replay, log.position)
}

/// The one segment file in `dir`.
private func segment(_ dir: String) throws -> String {
    let names = try FileManager.default.contentsOfDirectory(atPath: dir).filter { $0.hasSuffix(".wal") }
    try #require(names.count == 1)
    return dir + "/" + names[0]
}

/// Where the first hole of the file at `path` begins (the file's size when it has none).
private func firstHole(_ path: String) -> Int {
    let fd = open(path, O_RDONLY)
    defer { close(fd) }
    return Int(lseek(fd, 0, 4 /* SEEK_HOLE */))
}

/// Whether this file system reports preallocated, unwritten space as a hole (ext4 and XFS
/// do): only there can a test see which space holds written zeros.
private func holesShowUnwrittenSpace(in dir: String) -> Bool {
    let path = dir + "/probe"
    let fd = open(path, O_RDWR | O_CREAT, 0o600)
    defer { close(fd); unlink(path) }
    guard posix_fallocate(fd, 0, 1 << 20) == 0 else { return false }
    return lseek(fd, 0, 4 /* SEEK_HOLE */) == 0
}

@Suite(.mayBlock) struct WriteAheadLogZeroTests {
    @Test func zerosAheadOfTheEndChangeNothingReplayFinds() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let log = try openLog(dir)
        for tag in UInt8(1)...3 { try commit(log, group(5, tag: tag)) }
        let end = log.position
        let path = try segment(dir)
        if holesShowUnwrittenSpace(in: dir) {
            // The zeros reach a megabyte past the log's end: written, not merely reserved.
            #expect(firstHole(path) >= Int(end) + WriteAheadLog.zeroChunk - WriteAheadLog.zeroMargin)
        }
        let found = try replay(dir)
        #expect(found.payloads.count == 15)
        #expect(found.payloads.first == [UInt8](repeating: 1, count: 100))
        #expect(found.payloads.last == [UInt8](repeating: 3, count: 100))
        #expect(found.replay.tornBytes == 0)
        #expect(found.replay.leftoverBytes == 0)
        #expect(found.position == end)
    }

    @Test func aTornWriteInsideTheZerosIsStillFoundAndCut() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let log = try openLog(dir)
        try commit(log, group(2, tag: 7))
        let end = log.position
        // Half of a frame a crash interrupted, written over the zeros after the log's end
        // (in the file, positions count from the segment's base, its name).
        let path = try segment(dir)
        let base = try #require(UInt64(URL(fileURLWithPath: path).deletingPathExtension().lastPathComponent, radix: 16))
        let torn = Array(group(1, tag: 9).prefix(60))
        let fd = open(path, O_WRONLY)
        #expect(torn.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(end - base)) } == torn.count)
        close(fd)
        let found = try replay(dir)
        #expect(found.payloads.count == 2)
        #expect(found.replay.tornBytes == torn.count)
        #expect(found.position == end)
        // Cut: a second replay finds the two frames alone.
        let again = try replay(dir)
        #expect(again.payloads.count == 2)
        #expect(again.replay.tornBytes == 0)
    }

    @Test func aGroupUndoneAfterZerosIsCutAndTheLogGoesOn() throws {
        let dir = temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let log = try openLog(dir)
        try commit(log, group(1, tag: 1))
        _ = try log.append(group(1, tag: 2))
        guard case .cut = try log.undoFailedGroup() else {
            Issue.record("the undone group was not cut off")
            return
        }
        try commit(log, group(1, tag: 3))
        let found = try replay(dir)
        #expect(found.payloads.map { $0[0] } == [1, 3])
        #expect(found.replay.tornBytes == 0 && found.replay.leftoverBytes == 0)
    }
}
