// ObsClient — what an app gets from `import ObsClient` alone: besides this module's own types,
// the values it reads and writes (ObsValues: `JSONValue`, `JSONObject`, `Writer`, `LeaseEnd`), the
// keyed-observation vocabulary (ObservableKit: `Key`, `Selection`, `Change`, `ChangeSet`,
// `Entry`, `WriteOp`) and the protocol's typed replies, events and errors it returns
// (ObsProtocol). Each is re-exported by name, so the daemon-side pieces of those modules
// (request decoding, encoders, in-process repositories) stay out of an app's namespace.
// Observation comes along whole: the mirrors are `@Observable`, and an app that follows them
// outside SwiftUI needs `withObservationTracking`.

@_exported import Observation

@_exported import struct ObservableKit.Key
@_exported import enum ObservableKit.Selection
@_exported import struct ObservableKit.Change
@_exported import struct ObservableKit.ChangeSet
@_exported import struct ObservableKit.Entry
@_exported import enum ObservableKit.WriteOp

@_exported import enum ObsValues.JSONValue
@_exported import struct ObsValues.JSONObject
@_exported import struct ObsValues.Writer
@_exported import struct ObsValues.LeaseEnd

@_exported import struct ObsProtocol.ProtocolError
@_exported import struct ObsProtocol.ErrorCode
@_exported import protocol ObsProtocol.WireValue
@_exported import struct ObsProtocol.HelloReply
@_exported import struct ObsProtocol.WriteReply
@_exported import struct ObsProtocol.BatchReply
@_exported import struct ObsProtocol.ListReply
@_exported import struct ObsProtocol.RepositoryInfo
@_exported import struct ObsProtocol.Stats
@_exported import struct ObsProtocol.ChangeEvent
@_exported import struct ObsProtocol.CatchUpEvent
@_exported import struct ObsProtocol.CatchUpMode
