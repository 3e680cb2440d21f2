// ObsCore — the changes of one revision as the record encoder (RevisionRecordLayout) and the
// history read them: given as the bytes where they lie — every write (RepositoryCore.commit),
// which copies no value out — or as a list of `Change`s (revisions loaded, or decided by a
// shared store).

import ObsProtocol
import ObsStore
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

/// Changes given as the bytes where they lie (a plain struct, not a conditional conformance of
/// `UnsafeBufferPointer`: the record encoder is specialized for it).
public struct RawChanges: RecordChanges {
    public let changes: UnsafeBufferPointer<RawChange>

    @inlinable
    public init(_ changes: UnsafeBufferPointer<RawChange>) { self.changes = changes }

    @inlinable public var count: Int { changes.count }

    @inlinable
    public func withKeyBytes<R>(_ i: Int, _ body: (UnsafeRawBufferPointer) -> R) -> R { body(changes[i].key) }

    @inlinable
    public func byteCount(_ i: Int) -> Int { changes[i].key.count + (changes[i].old?.count ?? 0) + (changes[i].new?.count ?? 0) }

    @inlinable
    public func writeChange<S: JSONSink>(_ i: Int, into sink: inout S) {
        EventEncoder.writeChange(&sink, keyUTF8: changes[i].key, old: changes[i].old, new: changes[i].new) { sink, bytes in sink.writeBytes(bytes) }
    }
}
