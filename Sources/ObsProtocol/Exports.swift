// ObsProtocol — the wire protocol of obsd: the line framer, requests, replies and events,
// error codes. No networking. Its values (JSON, canonical encoding, writers) come from
// ObsValues, re-exported: a module that speaks the protocol needs no second import.

@_exported import ObsValues
