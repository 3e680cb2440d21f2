// Repository names: 1–128 characters of `[A-Za-z0-9._-]`, checked byte by byte.

import Testing

@testable import ObsProtocol

@Suite struct ProtocolRulesTests {
    @Test func everyByteIsJudgedByTheNameCharacterSet() {
        let allowed = Set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-".utf8)
        for byte in UInt8.min...UInt8.max {
            let valid = [byte, UInt8(ascii: "a")].withUnsafeBufferPointer { ProtocolRules.isValidRepoName(bytes: $0) }
            #expect(valid == allowed.contains(byte), "byte \(byte)")
        }
    }

    @Test func namesAreOneTo128Characters() {
        #expect(!ProtocolRules.isValidRepoName(""))
        #expect(ProtocolRules.isValidRepoName(String(repeating: "a", count: 128)))
        #expect(!ProtocolRules.isValidRepoName(String(repeating: "a", count: 129)))
        #expect(ProtocolRules.isValidRepoName("ui.settings-2_b"))
        #expect(!ProtocolRules.isValidRepoName("ui/settings") && !ProtocolRules.isValidRepoName("é"))
    }
}
