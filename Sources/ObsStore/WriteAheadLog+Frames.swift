// ObsStore — the write-ahead log's frames: how a record is framed in a segment, and how
// replay tells a valid frame from the end of the log and from a damaged or torn one.
//
// A frame is `u32 length · u32 CRC-32C of the payload · payload · zero padding to 8 bytes`,
// little-endian, starting on an 8-byte boundary. An all-zero frame header (length 0, CRC 0)
// is the end of the log in its segment: what the preallocated, unwritten part of a segment
// holds, and what a failed group is voided with when it cannot be cut off (WriteAheadLog).

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#endif

extension WriteAheadLog {
    /// The size of a frame's header (length and checksum).
    static let frameHeaderSize = 8

    /// Encodes one frame around `payload` (see the header).
    static func frame(_ payload: UnsafeRawBufferPointer, into group: inout [UInt8]) {
        let crc = CRC32C.checksum(payload)
        withUnsafeBytes(of: UInt32(payload.count).littleEndian) { group.append(contentsOf: $0) }
        withUnsafeBytes(of: crc.littleEndian) { group.append(contentsOf: $0) }
        group.append(contentsOf: payload)
        let padding = (8 - payload.count % 8) % 8
        if padding > 0 { group.append(contentsOf: repeatElement(0, count: padding)) }
    }

    enum Frame {
        case end
        case frame(payload: Range<Int>, next: Int)
        case bad
    }

    /// The frame at `at`: a valid one, the end of the log in this segment (an all-zero frame
    /// header, or zeros to the end of the file), or one that fails its checks.
    static func frame(in bytes: [UInt8], at: Int) -> Frame {
        guard at + frameHeaderSize <= bytes.count else {
            return at == bytes.count || bytes[at...].allSatisfy { $0 == 0 } ? .end : .bad
        }
        let (length, crc) = bytes.withUnsafeBytes { raw in
            (Int(UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: at, as: UInt32.self))),
             UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: at + 4, as: UInt32.self)))
        }
        if length == 0 { return crc == 0 ? .end : .bad }
        let payload = (at + frameHeaderSize)..<(at + frameHeaderSize + length)
        guard payload.upperBound <= bytes.count else { return .bad }
        let actual = bytes.withUnsafeBytes { CRC32C.checksum(UnsafeRawBufferPointer(rebasing: $0[payload])) }
        guard actual == crc else { return .bad }
        return .frame(payload: payload, next: (payload.upperBound + 7) & ~7)
    }

    /// Whether a valid frame starts anywhere after a bad one (frames start on 8-byte boundaries).
    static func anyValidFrame(in bytes: [UInt8], after at: Int) -> Bool {
        var candidate = (at + 8) & ~7
        while candidate + frameHeaderSize <= bytes.count {
            if case .frame = frame(in: bytes, at: candidate) { return true }
            candidate += 8
        }
        return false
    }

    /// The bytes from `at` to the last non-zero byte: what a torn write, or a voided group
    /// behind its zeroed header, left.
    static func usedBytes(in bytes: [UInt8], from at: Int) -> Int {
        var last = bytes.count
        while last > at, bytes[last - 1] == 0 { last -= 1 }
        return last - at
    }

    /// The whole file at `path`.
    static func read(_ path: String) throws(StorageError) -> [UInt8] {
        let file = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard file >= 0 else { throw StorageError.from(errno, "cannot open \(path)") }
        defer { close(file) }
        var st = stat()
        guard fstat(file, &st) == 0 else { throw StorageError.from(errno, "cannot stat \(path)") }
        var bytes = [UInt8](repeating: 0, count: Int(st.st_size))
        var done = 0
        while done < bytes.count {
            let n = bytes.withUnsafeMutableBytes { pread(file, $0.baseAddress! + done, $0.count - done, off_t(done)) }
            if n < 0, errno == EINTR { continue }
            guard n > 0 else { throw StorageError.from(errno, "cannot read \(path)") }
            done += n
        }
        return bytes
    }
}
