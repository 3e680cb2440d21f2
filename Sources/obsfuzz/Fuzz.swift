// obsfuzz — a libFuzzer harness for everything obsd parses from a client: the line
// framer and the request decoder (and the client's reply/event decoder).
//
// Built with `-DFUZZING -sanitize=fuzzer,address` (fuzz/run.sh) it is a libFuzzer target;
// built normally it replays the files given as arguments (the seed corpus and any crash
// found), so a finding becomes a regression test.
//
// Each input: byte 0 picks the line limit, byte 1 the chunk size the stream arrives in,
// the rest is the stream. Properties checked, beyond "does not crash":
// - the framer never holds more than the limit, and never yields a longer line;
// - whatever parses as JSON re-encodes to text that parses to an equal value, and that
//   encoding is stable;
// - the canonicalizing parser (values as the daemon keeps them, no tree) accepts exactly
//   what the tree parser accepts, and yields the tree's encoding and plainness;
// - the request decoder's fast path never decodes a line differently from the general one,
//   nor reads a single-key write in place that the general one reads otherwise.

import ObsProtocol
import ObservableKit

func fuzzOne(_ data: UnsafeRawBufferPointer) {
    guard data.count >= 2 else { return }
    let maxLine = [16, 256, 70_000][Int(data[0]) % 3]
    let chunk = max(1, Int(data[1]))
    let stream = UnsafeRawBufferPointer(rebasing: data[2...])
    var framer = LineFramer(maxLine: maxLine)
    var start = 0
    while start < stream.count {
        let end = min(stream.count, start + chunk)
        framer.feed(UnsafeRawBufferPointer(rebasing: stream[start..<end])) { frame in
            guard case .line(let line) = frame else { return }
            precondition(line.count <= maxLine, "the framer yielded a line over its limit")
            check(line)
        }
        precondition(framer.bufferedBytes <= maxLine, "the framer held more than its limit")
        start = end
    }
    check(stream)
}

func check(_ line: UnsafeRawBufferPointer) {
    let general = Result { () throws(RequestFailure) in try Request.decodeInGeneral(line: line) }
    if let fast = Request.scan(line, maxDepth: JSONParser.defaultMaxDepth) {
        guard case .success(let request) = general else { preconditionFailure("the fast path accepted a line the decoder refuses") }
        precondition(fast == request, "the fast path decoded a line differently")
    }
    var values: [UInt8] = []
    _ = Request.scan(line, maxDepth: JSONParser.defaultMaxDepth, values: &values) { scanned in
        guard case .success(let request) = general else {
            precondition(scanned.withWrite({ _, _, _ in true }) == nil, "the fast path read a write the decoder refuses")
            return true
        }
        precondition(scanned.writeReads(request) != false, "the fast path read a write the decoder reads differently")
        return true
    }
    _ = try? ServerMessage.decode(line: line)
    let canonical = try? CanonicalJSON(validating: line)
    guard let value = try? JSONParser.parse(line) else {
        precondition(canonical == nil, "the canonicalizer accepted what the parser refuses")
        return
    }
    guard let canonical else { preconditionFailure("the canonicalizer refused what the parser accepts") }
    precondition(canonical.bytes == value.jsonBytes(), "the canonical bytes are not the tree's encoding")
    precondition(canonical.isPlain == CanonicalJSON(value).isPlain, "plainness differs")
    precondition(value == value, "equality is not reflexive")
    let encoded = value.jsonBytes()
    guard let again = try? JSONParser.parse(encoded) else { preconditionFailure("re-encoded JSON does not parse: \(encoded)") }
    precondition(again == value, "a JSON round trip changed the value")
    precondition(again.jsonBytes() == encoded, "the encoding is not stable")
}

#if FUZZING
/// libFuzzer's entry for programs that keep their own `main` (SwiftPM links executables
/// through a renamed Swift main, so libFuzzer's `main` cannot be used).
@_silgen_name("LLVMFuzzerRunDriver")
func runFuzzerDriver(
    _ argc: UnsafeMutablePointer<Int32>, _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>>,
    _ callback: @convention(c) (UnsafePointer<UInt8>?, Int) -> Int32
) -> Int32

/// SwiftPM links an executable's entry point as `<module>_main`; in fuzzing builds it is
/// this function, which hands control to libFuzzer.
@_cdecl("obsfuzz_main")
func fuzzMain(_ argc: Int32, _ argv: UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>) -> Int32 {
    var argc = argc
    var argv = argv
    return runFuzzerDriver(&argc, &argv) { data, size in
        fuzzOne(UnsafeRawBufferPointer(start: data, count: size))
        return 0
    }
}
#else
@main
struct Replay {
    /// Replays every file named, and every regular file in every directory named (one
    /// level, sorted). Exits 66 (EX_NOINPUT) when a path cannot be read: a corpus that
    /// silently replays nothing would be a test that cannot fail.
    static func main() {
        var count = 0
        for path in CommandLine.arguments.dropFirst() {
            guard let files = files(at: path) else { fail("cannot read \(path)") }
            for file in files {
                guard let bytes = read(file) else { fail("cannot read \(file)") }
                bytes.withUnsafeBytes { fuzzOne($0) }
                count += 1
            }
        }
        print("obsfuzz: replayed \(count) inputs")
    }

    static func fail(_ message: String) -> Never {
        let line = Array("obsfuzz: \(message)\n".utf8)
        _ = line.withUnsafeBytes { write(2, $0.baseAddress, $0.count) }
        exit(66)
    }

    /// `path` itself when it is a file, its regular files when it is a directory.
    static func files(at path: String) -> [String]? {
        guard let dir = opendir(path) else { return errno == ENOTDIR ? [path] : nil }
        defer { closedir(dir) }
        var names: [String] = []
        while let entry = readdir(dir) {
            guard entry.pointee.d_type == DT_REG else { continue }
            let name = withUnsafeBytes(of: entry.pointee.d_name) { raw in
                String(decoding: raw.prefix(while: { $0 != 0 }), as: UTF8.self)
            }
            names.append(path + "/" + name)
        }
        return names.sorted()
    }

    static func read(_ path: String) -> [UInt8]? {
        guard let file = fopen(path, "rb") else { return nil }
        defer { fclose(file) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = fread(&chunk, 1, chunk.count, file)
            bytes.append(contentsOf: chunk[..<n])
            if n < chunk.count { return ferror(file) == 0 ? bytes : nil }
        }
    }
}
#endif

#if canImport(Glibc)
import Glibc
#endif
