"""obsd — the Python client of the obsd event bus.

Keyed observable repositories over a Unix socket: set and get keys, watch them change,
keep a live local copy (a mirror), and hold keys for as long as a process lives.

```
import obsd

with obsd.connect() as c:                      # $OBSD_SOCKET, $XDG_RUNTIME_DIR/obsd.sock, /run/obsd/obsd.sock
    c.set("ui", "theme", "dark")
    with c.hold("svc", "indexer/up", True):    # exists while the block runs
        ...
    for event in c.watch("ui", keys=["theme"]):
        for change in event.changes:
            print(change.key, change.old, "->", change.new)
```

The blocking client (``obsd.connect`` → ``obsd.Client``) is thread-safe; ``obsd.aio`` has the
same API for asyncio. Values are JSON (``None`` is ``null``); a missing side of a change is
``obsd.ABSENT``, an old value a catch-up cannot know ``obsd.UNKNOWN``. Errors are
``obsd.ObsdError`` and its subclasses, one per error code of the protocol.
"""

from ._client import Client, Hold, Lease, Mirror, Watch, connect
from ._errors import (
    BadJSON,
    BadRequest,
    Compacted,
    Conflict,
    ConnectionError,
    Forbidden,
    Internal,
    NotFound,
    ObsdError,
    Overloaded,
    TooLarge,
    UnknownOp,
)
from ._types import ABSENT, UNKNOWN, Absent, Change, Delete, Entry, Event, Set, Unknown, WriteResult

__version__ = "0.1.0"

__all__ = [
    "connect",
    "Client",
    "Watch",
    "Mirror",
    "Lease",
    "Hold",
    "ABSENT",
    "UNKNOWN",
    "Absent",
    "Unknown",
    "WriteResult",
    "Entry",
    "Set",
    "Delete",
    "Change",
    "Event",
    "ObsdError",
    "BadJSON",
    "BadRequest",
    "UnknownOp",
    "NotFound",
    "Conflict",
    "Forbidden",
    "TooLarge",
    "Compacted",
    "Overloaded",
    "Internal",
    "ConnectionError",
    "__version__",
]
