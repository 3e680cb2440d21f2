"""The wire: the socket path, argument checks, requests as JSON lines, replies decoded.

Everything here is free of I/O, shared by the blocking client and ``obsd.aio``.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ._errors import BadRequest
from ._types import ABSENT, UNKNOWN, Absent, Change, Delete, Entry, Set, Unknown, WriteResult

JSONObject = Dict[str, Any]

DEFAULT_SYSTEM_SOCKET = "/run/obsd/obsd.sock"
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
MAX_TTL = 31_536_000
CLIENT_NAME = "obsd-python/0.1.0"

_REPO = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_encode_json = _ENCODER.encode
_decode_json = json.JSONDecoder().decode


def loads(line: bytes) -> Any:
    """One line the daemon sent, decoded (``ValueError`` if it is not JSON)."""
    return _decode_json(line.decode("utf-8"))


# MARK: the socket


def resolve_socket(socket: Optional[str]) -> str:
    """The socket path: ``socket``, else ``$OBSD_SOCKET``, else ``$XDG_RUNTIME_DIR/obsd.sock``, else the system's."""
    if socket is not None:
        if not isinstance(socket, (str, os.PathLike)):
            raise BadRequest(f"socket must be a path (str), not {type(socket).__name__}")
        path = os.fspath(socket)
        if not isinstance(path, str) or path == "":
            raise BadRequest("socket must be a non-empty path")
        return path
    env = os.environ.get("OBSD_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return runtime.rstrip("/") + "/obsd.sock" if runtime != "/" else "/obsd.sock"
    return DEFAULT_SYSTEM_SOCKET


class Backoff:
    """Delays between connection attempts: ``initial``, doubling to ``maximum``, shortened by up to ``jitter``.

    As ObsClient's: 50 ms doubling to 5 s, each delay up to 20 % shorter so that the clients
    of a restarted daemon do not come back in lockstep.
    """

    def __init__(self, initial: float = 0.05, maximum: float = 5.0, jitter: float = 0.2) -> None:
        self.initial = initial
        self.maximum = maximum
        self.jitter = min(max(jitter, 0.0), 1.0)

    def delay(self, attempt: int) -> float:
        """The delay after ``attempt`` failures in a row (0 for the first retry)."""
        delay = min(self.initial * float(2 ** min(attempt, 32)), self.maximum)
        return delay * (1.0 - random.uniform(0.0, self.jitter))


# MARK: checks


def check_repo(repo: Any) -> str:
    """``repo`` if it is a valid repository name, else ``BadRequest``."""
    if not isinstance(repo, str):
        raise BadRequest(f"a repository name is a str, not {type(repo).__name__}")
    if not _REPO.match(repo):
        raise BadRequest(f"a repository name is 1 to 128 characters of A-Z a-z 0-9 . _ -, not {repo!r}")
    return repo


def check_key(key: Any, what: str = "key") -> str:
    """``key`` if it is a valid key (a non-empty str of at most 1024 UTF-8 bytes), else ``BadRequest``."""
    if not isinstance(key, str):
        raise BadRequest(f"{what} must be a str, not {type(key).__name__}")
    if key == "":
        raise BadRequest(f"{what} must not be empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadRequest(f"{what} {key!r} is not valid Unicode (it holds a lone surrogate)") from None
    if size > 1024:
        raise BadRequest(f"{what} is {size} bytes of UTF-8; a key is at most 1024")
    return key


def check_prefix(prefix: Any) -> str:
    """``prefix`` if it is a str (``""`` selects every key), else ``BadRequest``."""
    if not isinstance(prefix, str):
        raise BadRequest(f"prefix must be a str, not {type(prefix).__name__}")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"prefix {prefix!r} is not valid Unicode (it holds a lone surrogate)") from None
    return prefix


def check_revision(value: Any, what: str) -> int:
    """``value`` if it is a revision (an int from 0 to 2**64 - 1), else ``BadRequest``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{what} must be an int, not {type(value).__name__}")
    if value < 0 or value > UINT64_MAX:
        raise BadRequest(f"{what} must be from 0 to 2**64 - 1, not {value}")
    return int(value)


def check_lease(lease: Any) -> int:
    """A lease id (an int ≥ 1, or an ``obsd.Lease``), else ``BadRequest``."""
    ident = getattr(lease, "id", lease) if not isinstance(lease, int) else lease
    if isinstance(ident, bool) or not isinstance(ident, int):
        raise BadRequest(f"lease must be a lease id (an int) or an obsd.Lease, not {type(lease).__name__}")
    if ident < 1 or ident > UINT64_MAX:
        raise BadRequest(f"a lease id is from 1 to 2**64 - 1, not {ident}")
    return int(ident)


def check_ttl(ttl: Any) -> int:
    """A TTL in whole seconds (a fraction rounds up), from 1 to a year; else ``BadRequest``."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise BadRequest(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if isinstance(ttl, float) and not math.isfinite(ttl):
        raise BadRequest(f"ttl must be a finite number of seconds, not {ttl}")
    seconds = int(math.ceil(ttl))
    if seconds < 1 or seconds > MAX_TTL:
        raise BadRequest(f"a lease's ttl is from 1 to {MAX_TTL} seconds, not {ttl}")
    return seconds


def check_bool(value: Any, what: str) -> bool:
    """``value`` if it is a bool, else ``BadRequest``."""
    if not isinstance(value, bool):
        raise BadRequest(f"{what} must be True or False, not {value!r}")
    return value


def check_value(value: Any, path: str = "value") -> None:
    """Raises ``BadRequest`` unless ``value`` is JSON the daemon keeps as given.

    JSON here is ``None``, ``bool``, ``int`` within int64 (a larger int would come back as
    a rounded double), finite ``float``, ``str``, ``list``/``tuple`` (an array) and ``dict``
    with ``str`` keys.
    """
    t = type(value)
    if t is str or t is bool or value is None:
        return
    if t is int:
        if value < INT64_MIN or value > INT64_MAX:
            raise BadRequest(
                f"{path} is the integer {value}, outside the 64-bit range the daemon keeps exactly; "
                "pass float(...) to store it as a double"
            )
        return
    if t is float:
        if not math.isfinite(value):
            raise BadRequest(f"{path} is {value}, which JSON cannot hold")
        return
    if t is dict:
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadRequest(f"{path} has the key {k!r}: JSON object keys are str")
            check_value(v, f"{path}[{k!r}]")
        return
    if t is list or t is tuple:
        for i, v in enumerate(value):
            check_value(v, f"{path}[{i}]")
        return
    if isinstance(value, (Absent, Unknown)):
        raise BadRequest(f"{path} is {value!r}, which is not a value (delete a key to make it absent)")
    # Subclasses: an IntEnum is an int, an OrderedDict a dict, …
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        check_value(int(value), path)
        return
    if isinstance(value, float):
        check_value(float(value), path)
        return
    if isinstance(value, str):
        return
    if isinstance(value, Mapping):
        check_value(dict(value), path)
        return
    if isinstance(value, (list, tuple)):
        check_value(list(value), path)
        return
    raise BadRequest(f"{path} is a {type(value).__name__}, which is not JSON (None, bool, int, float, str, list, dict)")


def encode(message: JSONObject) -> bytes:
    """One request as a line of UTF-8 JSON, ``\\n`` included."""
    try:
        return (_encode_json(message) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the request holds a string that is not valid Unicode (a lone surrogate)") from None
    except (TypeError, ValueError) as error:
        raise BadRequest(f"the request cannot be written as JSON: {error}") from None


# MARK: requests


def selection(keys: Optional[Iterable[str]], prefix: Optional[str]) -> JSONObject:
    """The ``keys`` or ``prefix`` members of a subscribe request."""
    if keys is not None and prefix is not None:
        raise BadRequest("pass keys or prefix, not both")
    if keys is not None:
        if isinstance(keys, (str, bytes)):
            raise BadRequest("keys must be a list of keys, not a single str")
        try:
            listed = list(keys)
        except TypeError:
            raise BadRequest(f"keys must be a list of keys, not {type(keys).__name__}") from None
        return {"keys": [check_key(k, "each of keys") for k in listed]}
    if prefix is not None:
        return {"prefix": check_prefix(prefix)}
    return {}


def set_request(repo: str, key: str, value: Any, if_revision: Optional[int], force: bool, lease: Any) -> JSONObject:
    """A ``set`` request."""
    message: JSONObject = {"op": "set", "repo": check_repo(repo), "key": check_key(key), "value": value}
    check_value(value)
    if if_revision is not None:
        message["ifRev"] = check_revision(if_revision, "if_revision")
    if check_bool(force, "force"):
        message["force"] = True
    if lease is not None:
        message["lease"] = check_lease(lease)
    return message


def delete_request(repo: str, key: str, if_revision: Optional[int]) -> JSONObject:
    """A ``delete`` request."""
    message: JSONObject = {"op": "delete", "repo": check_repo(repo), "key": check_key(key)}
    if if_revision is not None:
        message["ifRev"] = check_revision(if_revision, "if_revision")
    return message


def batch_request(repo: str, ops: Sequence[Union[Set, Delete]]) -> JSONObject:
    """A ``batch`` request."""
    check_repo(repo)
    if isinstance(ops, (str, bytes, dict)):
        raise BadRequest("ops must be a list of obsd.Set and obsd.Delete")
    try:
        listed = list(ops)
    except TypeError:
        raise BadRequest(f"ops must be a list of obsd.Set and obsd.Delete, not {type(ops).__name__}") from None
    wire: List[JSONObject] = []
    for i, op in enumerate(listed):
        if isinstance(op, Set):
            item: JSONObject = {"op": "set", "key": check_key(op.key, f"ops[{i}].key"), "value": op.value}
            check_value(op.value, f"ops[{i}].value")
            if op.if_revision is not None:
                item["ifRev"] = check_revision(op.if_revision, f"ops[{i}].if_revision")
            if check_bool(op.force, f"ops[{i}].force"):
                item["force"] = True
            if op.lease is not None:
                item["lease"] = check_lease(op.lease)
        elif isinstance(op, Delete):
            item = {"op": "delete", "key": check_key(op.key, f"ops[{i}].key")}
            if op.if_revision is not None:
                item["ifRev"] = check_revision(op.if_revision, f"ops[{i}].if_revision")
        else:
            raise BadRequest(f"ops[{i}] is a {type(op).__name__}; a batch takes obsd.Set and obsd.Delete")
        wire.append(item)
    return {"op": "batch", "repo": repo, "ops": wire}


def list_request(repo: str, prefix: Optional[str], values: bool) -> JSONObject:
    """A ``list`` request."""
    message: JSONObject = {"op": "list", "repo": check_repo(repo)}
    if prefix is not None:
        message["prefix"] = check_prefix(prefix)
    if values:
        message["values"] = True
    return message


# MARK: replies


class ProtocolViolation(Exception):
    """The daemon sent something the protocol does not allow (the connection is then dropped)."""


def _int(reply: JSONObject, name: str) -> int:
    value = reply.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolViolation(f"the reply's {name!r} is not an integer: {reply!r}")
    return value


def write_result(reply: JSONObject) -> WriteResult:
    """A ``set``/``delete``/``batch`` reply as a ``WriteResult``."""
    return WriteResult(_int(reply, "rev"), bool(reply.get("changed")), reply["old"] if "old" in reply else ABSENT)


def entry(reply: JSONObject) -> Entry:
    """A ``get`` reply as an ``Entry``."""
    lease = reply.get("lease")
    return Entry(reply.get("value"), _int(reply, "rev"), lease if isinstance(lease, int) else None)


def changes_of(raw: Any) -> List[Change]:
    """The ``changes`` of a ``change`` event."""
    if not isinstance(raw, list):
        raise ProtocolViolation(f"an event's changes are not a list: {raw!r}")
    return [Change(c["key"], c["old"] if "old" in c else ABSENT, c["new"] if "new" in c else ABSENT) for c in raw]


def lease_end_of(event: JSONObject) -> Optional[Tuple[int, str]]:
    """An event's ``lease`` member as ``(id, end)``."""
    lease = event.get("lease")
    if isinstance(lease, dict):
        return (int(lease.get("id", 0)), str(lease.get("end", "")))
    return None


def writer_of(event: JSONObject) -> Optional[Tuple[int, int, int]]:
    """An event's ``by`` member as ``(uid, gid, pid)``."""
    by = event.get("by")
    if isinstance(by, dict):
        return (int(by.get("uid", -1)), int(by.get("gid", -1)), int(by.get("pid", -1)))
    return None


def catchup_changes(event: JSONObject) -> List[Change]:
    """A ``catchup`` event's values and deletions as changes with old ``UNKNOWN``."""
    values = event.get("values") or {}
    deleted = event.get("deleted") or []
    if not isinstance(values, dict) or not isinstance(deleted, list):
        raise ProtocolViolation(f"a catchup event is malformed: {event!r}")
    changes = [Change(k, UNKNOWN, v) for k, v in values.items()]
    changes.extend(Change(k, UNKNOWN, ABSENT) for k in deleted)
    return changes
