// ObsServer — lets the protocol encoders write straight into NIO buffers.

import NIOCore
import ObsProtocol

extension ByteBuffer: JSONSink {
    @inlinable
    public mutating func writeByte(_ byte: UInt8) { writeInteger(byte) }

    @inlinable
    public mutating func writeBytes(_ bytes: UnsafeRawBufferPointer) { _ = writeBytes(bytes) as Int }
}
