// Systemd — sockets passed by socket activation (`sd_listen_fds(3)`).

import CSystemd

#if canImport(Glibc)
import Glibc
#endif

/// A listening socket the service manager passed to this process.
public struct ListenedSocket: Sendable, Equatable {
    /// The file descriptor (3, 4, …).
    public let descriptor: Int32
    /// Its name (`FileDescriptorName=` in the socket unit; "unknown" by default).
    public let name: String
}

/// Why passed sockets cannot be used.
public struct ListenFDsError: Error, CustomStringConvertible, Sendable {
    public let description: String
}

public enum ListenFDs {
    /// Takes the sockets passed by socket activation (`sd_listen_fds_with_names(3)`), and
    /// unsets `$LISTEN_FDS`, `$LISTEN_PID` and `$LISTEN_FDNAMES` so children do not inherit
    /// them. Returns `[]` when the process was not socket-activated.
    ///
    /// - Throws: when a passed descriptor is not a listening Unix stream socket.
    public static func take() throws(ListenFDsError) -> [ListenedSocket] {
        var names: UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>?
        let count = sd_listen_fds_with_names(1, &names)
        guard count >= 0 else {
            throw ListenFDsError(description: "sd_listen_fds_with_names failed: \(String(cString: strerror(-count)))")
        }
        defer {
            if let names {
                for i in 0..<Int(count) { free(names[i]) }
                free(names)
            }
        }
        var sockets: [ListenedSocket] = []
        for i in 0..<count {
            let fd = SD_LISTEN_FDS_START + i
            let name = names?[Int(i)].map { String(cString: $0) } ?? "unknown"
            // Wraps sd_is_socket_unix(3): a Unix stream socket that is listening.
            guard sd_is_socket_unix(fd, Int32(SOCK_STREAM.rawValue), 1, nil, 0) > 0 else {
                throw ListenFDsError(
                    description: "file descriptor \(fd) (\(name)) passed by systemd is not a listening Unix stream socket; check ListenStream= in the socket unit")
            }
            sockets.append(ListenedSocket(descriptor: fd, name: name))
        }
        return sockets
    }
}
