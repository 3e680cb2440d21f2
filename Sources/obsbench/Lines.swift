// obsbench — byte helpers for the SwiftNIO handlers of `fill` and `soak`: whether a line
// contains a marker, and the integer after one. (The raw engine has its own, Raw/Wire.swift.)

/// Whether `line` contains `needle`.
func contains(_ line: UnsafeRawBufferPointer, _ needle: String) -> Bool {
    let n = Array(needle.utf8)
    guard line.count >= n.count else { return false }
    for i in 0...(line.count - n.count) where line[i] == n[0] {
        if (0..<n.count).allSatisfy({ line[i + $0] == n[$0] }) { return true }
    }
    return false
}

/// The integer right after `marker` in `line`.
func valueAfter(_ marker: String, in line: UnsafeRawBufferPointer) -> Int? {
    let needle = Array(marker.utf8)
    guard line.count > needle.count else { return nil }
    for i in 0...(line.count - needle.count) where line[i] == needle[0] {
        guard (0..<needle.count).allSatisfy({ line[i + $0] == needle[$0] }) else { continue }
        var j = i + needle.count
        var value = 0
        while j < line.count, line[j] >= 48, line[j] <= 57 {
            value = value * 10 + Int(line[j] - 48)
            j += 1
        }
        return j > i + needle.count ? value : nil
    }
    return nil
}
