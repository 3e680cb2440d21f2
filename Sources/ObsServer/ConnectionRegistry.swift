// ObsServer — naming connections: one loop's registry of its open connections (for shutdown
// and `stats`), and a reference to a connection that crosses threads and is resolved only
// back on its loop.


/// One loop's open connections (for shutdown, and `stats`).
final class LoopConnections {
    private(set) var all: [ConnectionID: Connection] = [:]

    func add(_ connection: Connection) { all[connection.id] = connection }
    func remove(_ connection: Connection) { all[connection.id] = nil }
    var count: Int { all.count }
}

/// A connection named across threads: its loop, and its id in the loop's registry. Resolved
/// only back on that loop, to the connection if it is still open. (Not a weak reference: one
/// moves an object's reference counts to a side table, and every retain and release of it —
/// a connection's, thousands of times a second — then takes the slow path.)
struct ConnectionRef: @unchecked Sendable {
    // @unchecked Sendable: `registry` is only read on `loop` (asserted in `connection`), where
    // it lives; the id and the loop are Sendable.
    let loop: IOLoop
    private let registry: LoopConnections
    private let id: ConnectionID

    init(_ connection: Connection) {
        self.loop = connection.loop
        self.registry = connection.registry
        self.id = connection.id
    }

    /// The connection, if it is still open (on its loop only).
    var connection: Connection? {
        loop.assertInLoop()
        return registry.all[id]
    }

    var session: Session? { connection?.session }
}
