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
/// (nil: the key did not exist) and after (nil: deleted). Valid while the memory they point
/// into is.
public struct RawChange: RecordChanges {
    public let key: UnsafeRawBufferPointer
    public let old: UnsafeRawBufferPointer?
    public let new: UnsafeRawBufferPointer?

    @inlinable
    public init(key: UnsafeRawBufferPointer, old: UnsafeRawBufferPointer?, new: UnsafeRawBufferPointer?) {
        self.key = key
        self.old = old
        self.new = new
    }

    @inlinable public var count: Int { 1 }

    @inlinable
    public func withKeyBytes<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R { body(key) }

    @inlinable
    public func byteCount(_ i: Int) -> Int { key.count + (old?.count ?? 0) + (new?.count ?? 0) }

    @inlinable
    public func writeChange<S: JSONSink>(_ i: Int, into sink: inout S) {
        EventEncoder.writeChange(&sink, keyUTF8: key, old: old, new: new) { sink, bytes in sink.writeBytes(bytes) }
    }

}
