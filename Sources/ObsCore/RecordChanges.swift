// ObsCore — the changes of one revision as the record encoder (RevisionRecordLayout) and the
// history read them: a list of `Change`s (batches, lease ends, revisions loaded or decided by
// a shared store), or one change given as the bytes where they lie — the single-key write
// path (RepositoryCore+Single.swift), which copies no value out and builds no array.

import ObsProtocol
import ObsValues
import ObservableKit

/// The changes of one revision, in application order, as a record is encoded from them.
public protocol RecordChanges {
    /// The number of changes.
    var count: Int { get }
    /// Calls `body` with the UTF-8 bytes of change `i`'s key.
    func withKeyBytes<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R
    /// The bytes of change `i`'s key, old value and new value together (for a record's bound).
    func byteCount(_ i: Int) -> Int
    /// Writes change `i`'s object, `{"key":…[,"old":…][,"new":…]}`, with canonical values.
    func writeChange<S: JSONSink>(_ i: Int, into sink: inout S)
}

extension Array: RecordChanges where Element == Change<CanonicalJSON> {
    @inlinable
    public func withKeyBytes<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R {
        self[i].key.withUTF8 { body(UnsafeRawBufferPointer($0)) }
    }

    @inlinable
    public func byteCount(_ i: Int) -> Int {
        self[i].key.utf8Count + (self[i].old?.bytes.count ?? 0) + (self[i].new?.bytes.count ?? 0)
    }

    @inlinable
    public func writeChange<S: JSONSink>(_ i: Int, into sink: inout S) {
        EventEncoder.writeChange(&sink, self[i]) { sink, value in sink.writeCanonical(value) }
    }
}

/// One change given as bytes: the key's UTF-8, and the canonical encodings of the value before
/// (nil: the key did not exist) and after (nil: deleted), each with whether it is plain (see
/// `CanonicalJSON`). Valid while the memory they point into is.
public struct RawChange: RecordChanges {
    public let key: UnsafeRawBufferPointer
    public let old: UnsafeRawBufferPointer?
    public let oldIsPlain: Bool
    public let new: UnsafeRawBufferPointer?
    public let newIsPlain: Bool

    @inlinable
    public init(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, oldIsPlain: Bool, new: UnsafeRawBufferPointer?, newIsPlain: Bool) {
        self.key = key
        self.old = old
        self.oldIsPlain = oldIsPlain
        self.new = new
        self.newIsPlain = newIsPlain
    }

    @inlinable public var count: Int { 1 }

    @inlinable
    public func withKeyBytes<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R { body(key) }

    @inlinable
    public func byteCount(_ i: Int) -> Int { key.count + (old?.count ?? 0) + (new?.count ?? 0) }

    /// The same bytes as `EventEncoder.writeChange` writes for the `Change` this is.
    @inlinable
    public func writeChange<S: JSONSink>(_ i: Int, into sink: inout S) {
        sink.writeRaw("{\"key\":")
        sink.writeJSONString(utf8: key)
        if let old {
            sink.writeRaw(",\"old\":")
            sink.writeBytes(old)
        }
        if let new {
            sink.writeRaw(",\"new\":")
            sink.writeBytes(new)
        }
        sink.writeByte(UInt8(ascii: "}"))
    }

    /// What the change weighs (`RevisionInfo.weight(of:)` of the `Change` this is).
    @inlinable
    public var weight: Int { byteCount(0) + 32 }

    /// The change with its values copied out.
    public var change: Change<CanonicalJSON> {
        Change(
            key: Key(String(decoding: key, as: UTF8.self)), old: old.map { CanonicalJSON(canonical: Array($0), isPlain: oldIsPlain) },
            new: new.map { CanonicalJSON(canonical: Array($0), isPlain: newIsPlain) })
    }
}
