"""The client's errors: one class per error code of the protocol, under ``ObsdError``."""

from __future__ import annotations

import builtins
from typing import Any, Dict, Optional, Type

__all__ = [
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
    "error_from_reply",
]


class ObsdError(Exception):
    """An error of obsd: the daemon refused a request, or it could not be reached.

    ``code`` is the protocol's error code (``"not_found"``, ``"conflict"``, …) — or, for an
    error of the client itself, ``"connection"`` — and ``message`` says what happened for a
    person. Each code the protocol defines has its own subclass (``obsd.NotFound``, …); a code
    this version of the client does not know (a newer daemon's) is an ``ObsdError`` with that
    code.
    """

    CODE = "error"

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        self.code: str = code if code is not None else type(self).CODE
        self.message: str = message
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.message, self.code))


def _rebuild(cls: Type[ObsdError], message: str, code: str) -> ObsdError:
    return cls(message, code)


class BadJSON(ObsdError):
    """``bad_json``: the daemon could not read a line as a JSON object."""

    CODE = "bad_json"


class BadRequest(ObsdError, ValueError):
    """``bad_request``: a field is missing, of the wrong type, or invalid (a bad name).

    Also raised by the client itself, without asking the daemon, for an argument it can
    tell is invalid (a repository name with a space, a key that is not a string, a value
    that is not JSON). It is a ``ValueError`` too.
    """

    CODE = "bad_request"


class UnknownOp(ObsdError):
    """``unknown_op``: the daemon does not know the operation (an older daemon)."""

    CODE = "unknown_op"


class NotFound(ObsdError):
    """``not_found``: the key, subscription or lease does not exist (or has ended)."""

    CODE = "not_found"


class Conflict(ObsdError):
    """``conflict``: an ``if_revision`` condition failed; nothing was changed."""

    CODE = "conflict"


class Forbidden(ObsdError):
    """``forbidden``: this user may not do that (the daemon's access policy, another user's lease)."""

    CODE = "forbidden"


class TooLarge(ObsdError):
    """``too_large``: the request, a value or a revision is over one of the daemon's limits."""

    CODE = "too_large"


class Compacted(ObsdError):
    """``compacted``: the daemon no longer holds the history asked for.

    The client handles it itself for watches and mirrors (they start again from the
    complete state); it reaches an application only from a lower-level call.
    """

    CODE = "compacted"


class Overloaded(ObsdError):
    """``overloaded``: a limit of the daemon was reached (leases, subscriptions, keys, connections)."""

    CODE = "overloaded"


class Internal(ObsdError):
    """``internal``: the daemon failed (for example, it could not store a write)."""

    CODE = "internal"


class ConnectionError(ObsdError, builtins.ConnectionError):  # noqa: A001 - the API's name
    """The daemon cannot be reached, or the connection was lost.

    Raised when the socket cannot be connected to (no daemon, wrong path, no permission),
    when the daemon did not come back within the client's ``reconnect_timeout``, for a write
    whose reply a lost connection took with it — **its outcome is unknown**: it may or may
    not have been applied; read before retrying — and for a call on a closed client. It is
    both an ``obsd.ObsdError`` (``code == "connection"``) and a built-in ``ConnectionError``.
    """

    CODE = "connection"


_BY_CODE: Dict[str, Type[ObsdError]] = {
    cls.CODE: cls
    for cls in (BadJSON, BadRequest, UnknownOp, NotFound, Conflict, Forbidden, TooLarge, Compacted, Overloaded, Internal)
}


def error_from_reply(error: Any) -> ObsdError:
    """The exception for the ``error`` member of a failed reply."""
    if not isinstance(error, dict):
        return ObsdError(f"the daemon sent a malformed error: {error!r}", "internal")
    code = error.get("code")
    message = error.get("message")
    if not isinstance(code, str):
        code = "internal"
    if not isinstance(message, str):
        message = "(no message)"
    cls = _BY_CODE.get(code)
    if cls is None:
        return ObsdError(message, code)
    return cls(message)
