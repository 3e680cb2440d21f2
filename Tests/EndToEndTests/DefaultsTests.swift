// The daemon's defaults are written twice — as the settings of `obsd` with no configuration
// file (ObsConfig's `DaemonSettings`, what the README's table shows) and as the defaults of
// ObsServer's `Limits` and `ServerConfiguration` for embedders — and this keeps them equal.

import ObsConfig
import ObsServer
import Testing

@Suite struct DefaultsTests {
    @Test func anEmbeddedServerHasTheDaemonsDefaults() {
        let s = DaemonSettings()
        let expected = Limits(
            maxLine: s.maxLine, queueBytes: s.queueBytes, queueEvents: s.queueEvents, overflowGrace: .seconds(s.overflowGraceSeconds),
            maxValueBytes: s.maxValueBytes, maxRevisionBytes: s.maxRevisionBytes, maxKeysPerRequest: s.maxKeysPerRequest,
            maxSubscriptionsPerConnection: s.maxSubscriptionsPerConnection, maxKeysPerRepository: s.maxKeysPerRepository,
            maxRepositories: s.maxRepositories, maxConnections: s.maxConnections, maxConnectionsPerUID: s.maxConnectionsPerUID,
            maxLeasesPerUID: s.maxLeasesPerUID, maxStartBytes: s.maxStartBytes)
        #expect(Limits() == expected)

        let c = ServerConfiguration(listener: .path("/run/obsd/obsd.sock"))
        #expect(c.socketMode == s.socketMode)
        #expect(c.socketOwner == nil && s.socketUser == nil && c.socketGroup == nil && s.socketGroup == nil)
        #expect(c.historyLimit == s.historyLimit)
        #expect(c.historyMaxBytes == s.historyMaxBytes)
        #expect(c.historyMaxAge == nil && s.historyMaxAgeSeconds == 0)
        #expect(c.historyTombstones == s.historyTombstones)
        #expect(c.threads == nil && s.threads == 0)
        #expect(c.policy.rules.isEmpty && s.accessRules.isEmpty)
        #expect(c.policy.fallback == .none && s.accessDefault == "none")
        #expect(c.listener.path == "/run/obsd/obsd.sock")
    }
}
