// ObsProtocol — where the daemon's socket is, by the contract's rules.
//
// Daemon: `--socket`, then `OBSD_SOCKET`, then its config file, then the default.
// Clients: flag, then `OBSD_SOCKET`, then the default. The default is
// `$XDG_RUNTIME_DIR/obsd.sock` when that variable is set (and non-empty), else
// `/run/obsd/obsd.sock`.

/// Resolves the daemon's socket path.
public enum SocketPath {
    /// The system-wide default.
    public static let system = "/run/obsd/obsd.sock"

    /// The default for this environment.
    public static func defaultPath(environment: [String: String]) -> String {
        if let runtime = environment["XDG_RUNTIME_DIR"], !runtime.isEmpty {
            return runtime.hasSuffix("/") ? runtime + "obsd.sock" : runtime + "/obsd.sock"
        }
        return system
    }

    /// Why `path` cannot be a Unix socket's path (empty, or longer than `sun_path` holds), or nil.
    public static func problem(_ path: String) -> String? {
        if path.isEmpty { return "the socket path is empty" }
        if path.utf8.count >= 108 {
            return "socket path \(path) is \(path.utf8.count) bytes long; Unix sockets allow at most 107"
        }
        return nil
    }

    /// The path a client uses: the explicit one, else `OBSD_SOCKET`, else the default.
    public static func resolve(explicit: String?, environment: [String: String]) -> String {
        resolve(explicit: explicit, configured: nil, environment: environment)
    }

    /// The path the daemon uses: flag, `OBSD_SOCKET`, config file, default.
    public static func resolve(explicit: String?, configured: String?, environment: [String: String]) -> String {
        if let explicit, !explicit.isEmpty { return explicit }
        if let env = environment["OBSD_SOCKET"], !env.isEmpty { return env }
        if let configured, !configured.isEmpty { return configured }
        return defaultPath(environment: environment)
    }
}

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// The process environment, without Foundation.
public enum ProcessEnvironment {
    /// The current environment variables.
    public static var current: [String: String] {
        var result: [String: String] = [:]
        var pointer = environ
        while let entry = pointer.pointee {
            let text = String(cString: entry)
            if let eq = text.firstIndex(of: "=") {
                result[String(text[..<eq])] = String(text[text.index(after: eq)...])
            }
            pointer += 1
        }
        return result
    }
}
