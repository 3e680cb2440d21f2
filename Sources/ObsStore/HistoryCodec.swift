// ObsStore — how the SQLite store writes a revision's changes in its history table: byte 1,
// then the changes as the write-ahead log encodes them (LogRecord), read back at start-up
// without parsing JSON (obsd 0.3.0 before schema 3 wrote a JSON array
// `[{"key":…,"old":…,"new":…},…]`, still read); and its writer: 12 bytes, uid · gid · pid,
// little-endian (NULL: not recorded).

import ObsValues
import ObservableKit

enum HistoryCodec {
    /// The stored form of `changes`.
    static func encode(_ changes: [Change<CanonicalJSON>]) -> [UInt8] {
        var out: [UInt8] = [1]
        out.reserveCapacity(changes.reduce(5) { $0 + $1.key.utf8Count + ($1.old?.bytes.count ?? 0) + ($1.new?.bytes.count ?? 0) + 11 })
        LogRecord.encode(changes, into: &out)
        return out
    }

    /// The changes stored as `bytes`, or nil when they are not what `encode` (or obsd
    /// 0.3.0's JSON form) writes.
    static func decode(_ bytes: UnsafeRawBufferPointer) -> [Change<CanonicalJSON>]? {
        if bytes.first == 1 { return try? LogRecord.decodeChanges(UnsafeRawBufferPointer(rebasing: bytes[1...])) }
        guard let array = try? JSONParser.parse(bytes, maxDepth: 100_000).arrayValue else { return nil }
        var changes: [Change<CanonicalJSON>] = []
        changes.reserveCapacity(array.count)
        for item in array {
            guard let object = item.objectValue, let key = object["key"]?.stringValue else { return nil }
            changes.append(Change(key: Key(key), old: object["old"].map(CanonicalJSON.init), new: object["new"].map(CanonicalJSON.init)))
        }
        return changes
    }

    /// The stored form of a writer.
    static func encode(_ writer: Writer) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(12)
        withUnsafeBytes(of: writer.uid.littleEndian) { out.append(contentsOf: $0) }
        withUnsafeBytes(of: writer.gid.littleEndian) { out.append(contentsOf: $0) }
        withUnsafeBytes(of: writer.pid.littleEndian) { out.append(contentsOf: $0) }
        return out
    }

    /// The writer stored as `bytes` (nil when NULL, or not what `encode` writes).
    static func writer(_ bytes: UnsafeRawBufferPointer) -> Writer? {
        guard bytes.count == 12 else { return nil }
        return Writer(
            uid: UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: 0, as: UInt32.self)),
            gid: UInt32(littleEndian: bytes.loadUnaligned(fromByteOffset: 4, as: UInt32.self)),
            pid: Int32(littleEndian: bytes.loadUnaligned(fromByteOffset: 8, as: Int32.self)))
    }
}
