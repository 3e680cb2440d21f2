// Systemd — a swift-log `LogHandler` that writes structured records to the journal.
//
// Each record carries MESSAGE=, PRIORITY= (syslog levels), SYSLOG_IDENTIFIER=, CODE_FILE=,
// CODE_LINE=, CODE_FUNC=, and one field per metadata key: `repo` becomes OBSD_REPO=,
// `peer.uid` becomes OBSD_PEER_UID= — journal field names allow only `[A-Z0-9_]`, must
// not start with `_` (reserved for fields the journal sets itself) and are at most 64
// bytes. Sent with `sd_journal_sendv(3)` (the variadic `sd_journal_send` is not callable
// from Swift); values are binary-safe, newlines included.

import CSystemd
import Logging

#if canImport(Glibc)
import Glibc
#endif

public struct JournalLogHandler: LogHandler {
    public var logLevel: Logger.Level = .info
    public var metadata: Logger.Metadata = [:]
    public var metadataProvider: Logger.MetadataProvider?
    /// `SYSLOG_IDENTIFIER=`.
    public let identifier: String
    /// Sends one record's `KEY=value` fields; returns 0 or a negative errno. Replaceable for tests.
    let send: @Sendable ([[UInt8]]) -> Int32

    public init(identifier: String, metadataProvider: Logger.MetadataProvider? = nil) {
        self.identifier = identifier
        self.metadataProvider = metadataProvider
        self.send = JournalLogHandler.sendv
    }

    init(identifier: String, send: @escaping @Sendable ([[UInt8]]) -> Int32) {
        self.identifier = identifier
        self.send = send
    }

    public subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    public func log(event: LogEvent) {
        var merged = metadata
        if let provided = metadataProvider?.get() { merged.merge(provided) { $1 } }
        if let own = event.metadata { merged.merge(own) { $1 } }
        _ = send(Self.fields(for: event, identifier: identifier, metadata: merged).map { Array("\($0.name)=\($0.value)".utf8) })
    }

    /// The journal fields of one record, in order.
    public static func fields(for event: LogEvent, identifier: String, metadata: Logger.Metadata) -> [(name: String, value: String)] {
        var fields: [(name: String, value: String)] = [
            ("MESSAGE", event.message.description),
            ("PRIORITY", String(priority(event.level))),
            ("SYSLOG_IDENTIFIER", identifier),
            ("CODE_FILE", event.file),
            ("CODE_LINE", String(event.line)),
            ("CODE_FUNC", event.function),
        ]
        if let error = event.error { fields.append(("OBSD_ERROR", "\(error)")) }
        for key in metadata.keys.sorted() {
            fields.append((fieldName(key), "\(metadata[key]!)"))
        }
        return fields
    }

    /// The syslog priority of a log level (`PRIORITY=`): emerg 0 … debug 7.
    public static func priority(_ level: Logger.Level) -> Int {
        switch level {
        case .trace, .debug: return 7
        case .info: return 6
        case .notice: return 5
        case .warning: return 4
        case .error: return 3
        case .critical: return 2
        }
    }

    /// The journal field name for a metadata key: `OBSD_` + the key in upper case, every
    /// run of other characters turned into one `_`, at most 64 bytes.
    public static func fieldName(_ key: String) -> String {
        var name = "OBSD_"
        var pendingUnderscore = false
        for scalar in key.unicodeScalars {
            let c = Character(scalar)
            if c.isASCII, c.isLetter || c.isNumber {
                if pendingUnderscore, !name.hasSuffix("_") { name.append("_") }
                pendingUnderscore = false
                name.append(Character(c.uppercased()))
            } else {
                pendingUnderscore = true
            }
        }
        if name.hasSuffix("_") { name.removeLast() }
        return String(name.prefix(64))
    }

    /// Wraps `sd_journal_sendv(3)`: one `iovec` per field, the buffers alive for the call.
    static let sendv: @Sendable ([[UInt8]]) -> Int32 = { fields in
        var joined: [UInt8] = []
        var ranges: [Range<Int>] = []
        for field in fields {
            ranges.append(joined.count..<(joined.count + field.count))
            joined.append(contentsOf: field)
        }
        return joined.withUnsafeMutableBytes { raw in
            var vectors = ranges.map { range in
                iovec(iov_base: raw.baseAddress.map { $0 + range.lowerBound }, iov_len: range.count)
            }
            return sd_journal_sendv(&vectors, Int32(vectors.count))
        }
    }
}
