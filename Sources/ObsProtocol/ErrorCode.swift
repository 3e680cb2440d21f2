// ObsProtocol — error codes and protocol constants of the contract.

/// An error code of the contract. Extensible: a code this version does not know (a newer
/// daemon's) is kept as it was sent, and a new code is a new static member, never a
/// breaking change to a `switch` (which needs a `default`).
public struct ErrorCode: RawRepresentable, Sendable, Hashable, CustomStringConvertible {
    /// The code on the wire, e.g. `not_found`.
    public let rawValue: String

    public init(rawValue: String) { self.rawValue = rawValue }

    /// The line is not valid JSON, or not an object.
    public static let badJSON = ErrorCode(rawValue: "bad_json")
    /// A field is missing or ill-typed, or a name is invalid.
    public static let badRequest = ErrorCode(rawValue: "bad_request")
    /// `op` names no operation the daemon knows.
    public static let unknownOp = ErrorCode(rawValue: "unknown_op")
    /// The key, subscription or lease does not exist.
    public static let notFound = ErrorCode(rawValue: "not_found")
    /// A compare-and-set condition (`ifRev`) failed.
    public static let conflict = ErrorCode(rawValue: "conflict")
    /// The peer may not do this.
    public static let forbidden = ErrorCode(rawValue: "forbidden")
    /// The line or value exceeds a limit.
    public static let tooLarge = ErrorCode(rawValue: "too_large")
    /// `since` reaches before the retained history (or beyond the current revision), or
    /// names another epoch.
    public static let compacted = ErrorCode(rawValue: "compacted")
    /// A server-side resource limit was reached.
    public static let overloaded = ErrorCode(rawValue: "overloaded")
    /// The daemon failed.
    public static let `internal` = ErrorCode(rawValue: "internal")

    /// The codes the contract defines.
    public static let contractCodes: [ErrorCode] = [
        .badJSON, .badRequest, .unknownOp, .notFound, .conflict, .forbidden, .tooLarge, .compacted, .overloaded, .internal,
    ]

    public var description: String { rawValue }
}

/// An error the daemon reports in a reply: a code and a message for a person.
public struct ProtocolError: Error, Sendable, Equatable, CustomStringConvertible {
    public let code: ErrorCode
    public let message: String

    public init(_ code: ErrorCode, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "\(code.rawValue): \(message)" }
}

/// Constants fixed by the protocol.
public enum ObsProtocolVersion {
    /// The protocol version this module speaks.
    public static let current: Int64 = 1
}

/// The release of obsd, obsctl and the client library: one number for all of them (the
/// daemon reports it in `hello` as `obsd/<version>`; docs/PROTOCOL.md shows it).
public enum ObsRelease {
    public static let version = "0.3.0"
}

/// Limits fixed by the contract.
public enum ProtocolRules {
    /// The longest key, in UTF-8 bytes.
    public static let maxKeyBytes = 1024
    /// The longest repository name, in characters.
    public static let maxRepoNameLength = 128
    /// The default maximum line length, in bytes before the `\n`.
    public static let defaultMaxLine = 1 << 20

    /// Whether `name` is a valid repository name: 1–128 characters of `[A-Za-z0-9._-]`.
    public static func isValidRepoName(_ name: String) -> Bool {
        var name = name
        return name.withUTF8 { isValidRepoName(bytes: $0) }
    }

    /// Whether these bytes are a valid repository name.
    public static func isValidRepoName(bytes: UnsafeBufferPointer<UInt8>) -> Bool {
        guard !bytes.isEmpty, bytes.count <= maxRepoNameLength else { return false }
        // One test per byte, of a bit in `repoNameBytes` (every write's name is checked).
        for b in bytes {
            let mask = b < 64 ? repoNameBytes.low : b < 128 ? repoNameBytes.high : 0
            if mask & (1 << UInt64(b & 63)) == 0 { return false }
        }
        return true
    }

    /// The bytes of `[A-Za-z0-9._-]`: bit b of `low` for byte b < 64 (`-`, `.`, the digits),
    /// of `high` for byte 64 + b (the letters, `_`). `ProtocolRulesTests` checks every byte.
    static let repoNameBytes: (low: UInt64, high: UInt64) = (0x03FF_6000_0000_0000, 0x07FF_FFFE_87FF_FFFE)

    /// Why `key` is not a valid key, or `nil` if it is.
    public static func keyProblem(_ key: String) -> String? {
        let n = key.utf8.count
        if n == 0 { return "key must not be empty" }
        if n > maxKeyBytes { return "key is \(n) bytes long; the limit is \(maxKeyBytes) bytes of UTF-8" }
        return nil
    }
}
