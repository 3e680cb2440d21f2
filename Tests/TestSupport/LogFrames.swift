// Where the records of a write-ahead log segment lie, for tests that damage or tear one: the
// segment's frames read by their lengths (ObsStore WriteAheadLog+Frames.swift), group starts
// skipped.

import Foundation

/// Where each record's frame in the log segment at `path` starts (after the 16-byte header).
public func walRecordStarts(_ path: String) throws -> [Int] {
    let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
    var starts: [Int] = []
    var at = 16
    while at + 8 <= bytes.count {
        let length = Int(bytes[at]) | Int(bytes[at + 1]) << 8 | Int(bytes[at + 2]) << 16 | Int(bytes[at + 3]) << 24
        if length == 0 { break }
        let groupStart = length == 1 && bytes[at + 8] == 0xFD
        if !groupStart { starts.append(at) }
        at = (at + 8 + length + 7) & ~7
    }
    return starts
}
