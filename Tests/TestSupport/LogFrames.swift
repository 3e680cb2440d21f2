// Where the records of a write-ahead log segment lie, for tests that damage or tear one: the
// segment's frames read by their lengths (ObsStore WriteAheadLog+Frames.swift), group starts
// skipped, up to the frame that names the next segment.

import Foundation

/// The size of the header of the log segment whose bytes are `bytes`: 32 in a format 3
/// segment (`OBSDWAL3`), 16 in the formats before.
public func walHeaderSize(_ bytes: [UInt8]) -> Int {
    bytes.starts(with: Array("OBSDWAL3".utf8)) ? 32 : 16
}

/// Where each record's frame in the log segment at `path` starts (after its header), up to the
/// end of its log: an all-zero frame header, or the frame that names the next segment.
public func walRecordStarts(_ path: String) throws -> [Int] {
    let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
    var starts: [Int] = []
    var at = walHeaderSize(bytes)
    while at + 8 <= bytes.count {
        let length = Int(bytes[at]) | Int(bytes[at + 1]) << 8 | Int(bytes[at + 2]) << 16 | Int(bytes[at + 3]) << 24
        if length == 0 || (length == 9 && at + 8 < bytes.count && bytes[at + 8] == 0xFE) { break }
        let groupStart = length == 1 && bytes[at + 8] == 0xFD
        if !groupStart { starts.append(at) }
        at = (at + 8 + length + 7) & ~7
    }
    return starts
}
