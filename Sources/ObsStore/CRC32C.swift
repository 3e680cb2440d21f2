// ObsStore — CRC-32C (Castagnoli), the checksum of every write-ahead-log record and snapshot
// block: the same polynomial as ext4, iSCSI and etcd's WAL. On the CPU's instruction where it
// has one (CLinux), else table-driven, eight bytes at a time.

import CLinux

enum CRC32C {
    /// Eight tables: `tables[k][b]` is the CRC of byte `b` followed by `k` zero bytes.
    private static let tables: [[UInt32]] = {
        let polynomial: UInt32 = 0x82F6_3B78  // reflected
        var first = [UInt32](repeating: 0, count: 256)
        for i in 0..<256 {
            var c = UInt32(i)
            for _ in 0..<8 { c = c & 1 != 0 ? (c >> 1) ^ polynomial : c >> 1 }
            first[i] = c
        }
        var tables = [first]
        for k in 1..<8 {
            var t = [UInt32](repeating: 0, count: 256)
            for i in 0..<256 { t[i] = (tables[k - 1][i] >> 8) ^ first[Int(tables[k - 1][i] & 0xFF)] }
            tables.append(t)
        }
        return tables
    }()

    /// Whether the CPU computes it (SSE 4.2): about ten times the tables' speed.
    private static let hardware = obs_crc32c_hardware() != 0

    /// The CRC-32C of `bytes` — following bytes whose CRC-32C is `previous`, if given.
    static func checksum(_ bytes: UnsafeRawBufferPointer, continuing previous: UInt32 = 0) -> UInt32 {
        if hardware { return ~obs_crc32c_update(~previous, bytes.baseAddress, bytes.count) }
        return software(bytes, continuing: previous)
    }

    /// The same, from the tables (what a CPU without the instruction runs; tests compare the two).
    static func software(_ bytes: UnsafeRawBufferPointer, continuing previous: UInt32 = 0) -> UInt32 {
        var crc: UInt32 = ~previous
        var i = 0
        let n = bytes.count
        tables.withUnsafeBufferPointer { t in
            let t0 = t[0], t1 = t[1], t2 = t[2], t3 = t[3], t4 = t[4], t5 = t[5], t6 = t[6], t7 = t[7]
            while i + 8 <= n {
                let lo = bytes.loadUnaligned(fromByteOffset: i, as: UInt32.self).littleEndian ^ crc
                let hi = bytes.loadUnaligned(fromByteOffset: i + 4, as: UInt32.self).littleEndian
                crc = t7[Int(lo & 0xFF)] ^ t6[Int((lo >> 8) & 0xFF)] ^ t5[Int((lo >> 16) & 0xFF)] ^ t4[Int(lo >> 24)]
                    ^ t3[Int(hi & 0xFF)] ^ t2[Int((hi >> 8) & 0xFF)] ^ t1[Int((hi >> 16) & 0xFF)] ^ t0[Int(hi >> 24)]
                i += 8
            }
            while i < n {
                crc = (crc >> 8) ^ t0[Int((crc ^ UInt32(bytes[i])) & 0xFF)]
                i += 1
            }
        }
        return ~crc
    }
}
