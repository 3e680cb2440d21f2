// ObsServer — a session's lease requests: `grant`, `keepalive`, `revoke` (the contract's
// "Keys with a lifetime"), answered by the hub's lease service, whichever keeps the leases
// (LeaseService.swift); and `afterStore`, how a request that waits for a shared store holds
// the connection's later requests behind it. Writes that name a lease go through the write
// path like any other (Session.swift, Sequencer.swift).

import ObsCore
import ObsProtocol
import ObsStore
import ObservableKit

extension Session {
    func grant(_ id: JSONValue, ttl: Int64?) { hub.leases.grant(id, ttl: ttl, for: self) }

    func keepAlive(_ id: JSONValue, _ lease: UInt64) { hub.leases.keepAlive(id, lease, for: self) }

    func revoke(_ id: JSONValue, _ lease: UInt64) { hub.leases.revoke(id, lease, for: self) }

    /// Runs `work` off the loop, then `body` with its result on this session's loop, holding
    /// the connection's later requests meanwhile; if the connection closed in between,
    /// `ifClosed` gets the result instead.
    func afterStore<T: Sendable>(
        _ work: @escaping @Sendable () async -> T, ifClosed: @escaping @Sendable (T) -> Void = { _ in },
        then body: @escaping (Session, T) -> Void
    ) {
        wait(for: .cluster)
        let ref = ConnectionRef(connection)
        let run = UncheckedSendableBox(body)
        Task(executorPreference: ref.loop) {
            let result = await work()
            ref.loop.execute {
                guard let session = ref.session else { return ifClosed(result) }
                run.value(session, result)
                session.resume(from: .cluster)
            }
        }
    }
}
