// ObsStore — epochs: names of unbroken histories.
//
// A repository's epoch names one history of its revisions. It stays the same while
// revisions only move forward with their history kept, and changes whenever that stops
// being true (a daemon that persists nothing starts again, a data directory is new or
// replaced, the store cannot vouch that it kept every acknowledged revision). A client that
// resumes with `since` names the epoch it saw; another epoch means its revisions belong to
// another history, and it must start over from a snapshot.

/// Epochs: 128 random bits as 32 lowercase hexadecimal digits, so that two daemons never
/// hand out the same epoch for different histories.
public enum Epoch {
    /// A new epoch.
    public static func random() -> String {
        var generator = SystemRandomNumberGenerator()
        let digits = Array("0123456789abcdef".utf8)
        var bytes: [UInt8] = []
        bytes.reserveCapacity(32)
        for _ in 0..<2 {
            var word: UInt64 = generator.next()
            for _ in 0..<16 {
                bytes.append(digits[Int(word & 0xF)])
                word >>= 4
            }
        }
        return String(decoding: bytes, as: UTF8.self)
    }

    /// Whether `text` can be an epoch: 1–64 bytes of printable ASCII.
    public static func isValid(_ text: String) -> Bool {
        !text.isEmpty && text.utf8.count <= 64 && text.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F }
    }
}
