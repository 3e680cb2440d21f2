"""Following a selection across connections, free of I/O: where a watch is, and a mirror's state.

A ``Cursor`` knows the position of one watch — the revision through which every selected
change was handed on, and the epoch (history) that revision belongs to — and turns the
daemon's messages into ``Event``s. After a lost connection, an ``overflow`` or a local
cut-off, it makes the request that resumes: ``since`` + ``epoch`` + ``catchup: true``, so a
daemon that implements catch-up answers with a replay, a diff (a ``catchup`` event) or a
snapshot, never ``compacted``; and for a daemon that does not (it ignores ``catchup`` and
answers ``compacted`` past its history or for another epoch), the fallback request,
``initial: true``, whose snapshot is a ``"reset"``.

The epoch a new subscription reports becomes the cursor's only with the first message that
moves its position (a replayed change, the ``catchup``, the snapshot, ``synced``): until then
the position is still one of the old history, and a connection lost in between resumes from
there — never from an old position in a new history, which would replay one history's
changes onto another's state.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ._errors import Forbidden, error_from_reply
from ._types import ABSENT, UNKNOWN, Change, Event
from ._wire import JSONObject, ProtocolViolation, catchup_changes, changes_of, lease_end_of, writer_of

LIVE = "live"
RESUME = "resume"
INITIAL = "initial"


class Cursor:
    """A watch's position and the requests that resume it (see the module's header)."""

    __slots__ = ("repo", "select", "coalesce", "writers", "initial", "position", "epoch", "_pending_epoch", "_awaiting")

    def __init__(
        self,
        repo: str,
        select: JSONObject,
        *,
        since: Optional[int] = None,
        epoch: Optional[str] = None,
        coalesce: bool = False,
        writers: bool = False,
        initial: bool = False,
    ) -> None:
        self.repo = repo
        self.select = select
        self.coalesce = coalesce
        self.writers = writers
        self.initial = initial
        #: Every selected change through this revision has been handed on (None: not yet known).
        self.position: Optional[int] = since
        #: The history ``position`` belongs to (None: unknown — a ``since`` given without one).
        self.epoch: Optional[str] = epoch
        self._pending_epoch: Optional[str] = None
        self._awaiting = False

    def _base(self) -> JSONObject:
        request: JSONObject = {"op": "subscribe", "repo": self.repo, "progress": True}
        request.update(self.select)
        if self.coalesce:
            request["coalesce"] = True
        if self.writers:
            request["writers"] = True
        return request

    def request(self) -> Tuple[JSONObject, str]:
        """The subscribe request that starts or resumes the watch, and its mode."""
        request = self._base()
        if self.position is not None:
            request["since"] = self.position
            request["catchup"] = True
            if self.epoch is not None:
                request["epoch"] = self.epoch
            return request, RESUME
        if self.initial:
            request["initial"] = True
            return request, INITIAL
        return request, LIVE

    def fallback(self) -> Tuple[JSONObject, str]:
        """The request after ``compacted`` (a daemon without catch-up): the complete state."""
        request = self._base()
        request["initial"] = True
        return request, INITIAL

    def subscribed(self, reply: JSONObject, mode: str) -> None:
        """The subscribe reply of a request made in ``mode`` arrived."""
        rev = reply.get("rev")
        epoch = reply.get("epoch")
        if isinstance(rev, bool) or not isinstance(rev, int):
            raise ProtocolViolation(f"a subscribe reply without a revision: {reply!r}")
        if mode == LIVE:
            self.position = rev
            self.epoch = epoch if isinstance(epoch, str) else self.epoch
            self._pending_epoch = None
            self._awaiting = False
        else:
            self._pending_epoch = epoch if isinstance(epoch, str) else None
            self._awaiting = True

    def _commit(self) -> None:
        if self._awaiting:
            if self._pending_epoch is not None:
                self.epoch = self._pending_epoch
            self._pending_epoch = None
            self._awaiting = False

    def event(self, message: JSONObject) -> Optional[Event]:
        """Takes one event of the subscription; the ``Event`` to hand on, if any."""
        kind = message.get("event")
        if kind == "change":
            self._commit()
            rev = message["rev"]
            self.position = rev
            changes = changes_of(message.get("changes"))
            if not changes:
                return None
            start = message.get("from")
            return Event(
                "change",
                self.repo,
                rev,
                self.epoch or "",
                changes,
                lease_end_of(message),
                writer_of(message),
                start if isinstance(start, int) and not isinstance(start, bool) else None,
            )
        if kind == "snapshot":
            self._commit()
            rev = message["rev"]
            self.position = rev
            values = message.get("values")
            if not isinstance(values, dict):
                raise ProtocolViolation(f"a snapshot without values: {message!r}")
            return Event("reset", self.repo, rev, self.epoch or "", [Change(k, UNKNOWN, v) for k, v in values.items()])
        if kind == "catchup":
            self._commit()
            rev = message["rev"]
            self.position = rev
            changes = catchup_changes(message)
            if not changes:
                return None
            return Event("catchup", self.repo, rev, self.epoch or "", changes)
        if kind == "synced":
            self._commit()
            rev = message["rev"]
            if self.position is None or rev > self.position:
                self.position = rev
            return None
        if kind == "progress":
            rev = message["rev"]
            if not self._awaiting and self.position is not None and rev > self.position:
                self.position = rev
            return None
        if kind == "revoked":
            error = error_from_reply(message.get("error"))
            if not isinstance(error, Forbidden):
                error = Forbidden(error.message)
            raise error
        return None  # an event of a newer daemon this client does not know

    def synced_to(self, rev: int) -> None:
        """A ``sync`` reply: every selected change through ``rev`` was handed on before it."""
        if not self._awaiting and (self.position is None or rev > self.position):
            self.position = rev

    def overflowed(self, rev: Any) -> None:
        """The daemon cut the connection off; ``rev`` is this subscription's ``revs`` entry."""
        if not self._awaiting and isinstance(rev, int) and not isinstance(rev, bool):
            if self.position is None or rev > self.position:
                self.position = rev
        self.lost()

    def lost(self) -> None:
        """The subscription ended before its start arrived, or with its connection."""
        self._pending_epoch = None
        self._awaiting = False


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON: ``1 == 1.0``, but ``True != 1``; objects regardless of order."""
    ta, tb = type(a), type(b)
    if ta is bool or tb is bool:
        return ta is tb and a == b
    if ta in (int, float) and tb in (int, float):
        return bool(a == b)
    if ta is dict and tb is dict:
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if ta is list and tb is list:
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return ta is tb and bool(a == b)


def apply_event(data: Dict[str, Any], event: Event) -> Tuple[Dict[str, Any], List[str]]:
    """Applies ``event`` to a mirror's ``data``: the new data (the same dict unless a reset) and the keys that changed."""
    if event.kind == "reset":
        fresh = {c.key: c.new for c in event.changes}
        changed = [k for k in data if k not in fresh]
        changed.extend(k for k, v in fresh.items() if k not in data or not json_equal(data[k], v))
        return fresh, sorted(changed)
    changed = []
    for change in event.changes:
        if change.new is ABSENT:
            if data.pop(change.key, ABSENT) is not ABSENT or event.kind == "change":
                changed.append(change.key)
        else:
            if event.kind == "catchup" and change.key in data and json_equal(data[change.key], change.new):
                continue  # a catch-up lists keys written since, even those back to the same value
            data[change.key] = change.new
            changed.append(change.key)
    return data, changed
