"""Values and results: ``ABSENT``, ``UNKNOWN``, and the named tuples the client returns."""

from __future__ import annotations

import enum
from typing import Any, List, NamedTuple, Optional, Tuple

__all__ = [
    "Absent",
    "Unknown",
    "ABSENT",
    "UNKNOWN",
    "WriteResult",
    "Entry",
    "Set",
    "Delete",
    "Change",
    "Event",
]


class Absent(enum.Enum):
    """The type of ``obsd.ABSENT``: a key that does not exist, on one side of a change.

    Never conflated with ``None``, which is JSON ``null`` — a value a key can hold.
    """

    ABSENT = "ABSENT"

    def __repr__(self) -> str:
        return "obsd.ABSENT"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return False


class Unknown(enum.Enum):
    """The type of ``obsd.UNKNOWN``: an old value the client cannot know.

    The ``old`` side of the changes of a ``"catchup"`` or ``"reset"`` event: after a resume
    past the daemon's history, the daemon says what each key is now, not what it was.
    """

    UNKNOWN = "UNKNOWN"

    def __repr__(self) -> str:
        return "obsd.UNKNOWN"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return False


ABSENT = Absent.ABSENT
"""A missing side of a change, or the ``old`` of a write to a key that did not exist."""

UNKNOWN = Unknown.UNKNOWN
"""The old value of a key in a ``"catchup"`` or ``"reset"`` event."""


class WriteResult(NamedTuple):
    """What a write did.

    ``rev``: the repository's revision after the call; ``changed``: whether the write changed
    anything (a ``set`` of an equal value does not, unless forced); ``old``: the key's value
    before the write, ``obsd.ABSENT`` if the key did not exist (always ``ABSENT`` for a batch).
    """

    rev: int
    changed: bool
    old: Any = ABSENT


class Entry(NamedTuple):
    """A key's value, the revision that last changed it, and the lease it is attached to (or ``None``)."""

    value: Any
    rev: int
    lease: Optional[int] = None


class Set(NamedTuple):
    """A ``set`` inside ``Client.batch``: ``key`` to ``value``, with the same options as ``Client.set``."""

    key: str
    value: Any
    if_revision: Optional[int] = None
    force: bool = False
    lease: Optional[int] = None


class Delete(NamedTuple):
    """A ``delete`` inside ``Client.batch``, optionally only if the key's revision is ``if_revision``."""

    key: str
    if_revision: Optional[int] = None


class Change(NamedTuple):
    """One key's change: ``old`` and ``new`` values, ``obsd.ABSENT`` for a missing side.

    In a ``"catchup"`` or ``"reset"`` event ``old`` is ``obsd.UNKNOWN``; ``new`` is then the
    key's value at the event's revision, or ``ABSENT`` for a key that was deleted.
    """

    key: str
    old: Any
    new: Any


class Event(NamedTuple):
    """An event of a watch.

    ``kind`` is one of:

    - ``"change"``: one revision's changes to the selected keys (``old`` and ``new`` exact).
      With ``coalesce=True`` it may cover several revisions (then ``from_rev`` is the first).
    - ``"catchup"``: after a resume the daemon's history could not replay, the keys that
      changed since the watch's position, with their values at ``rev`` (``old`` is
      ``obsd.UNKNOWN``, ``new`` ``obsd.ABSENT`` for a deleted key). Apply it and you hold
      the state at ``rev``.
    - ``"reset"``: the complete selected state at ``rev`` after the history changed (the
      daemon restarted without its data, or the client's position is no longer known):
      drop every key not listed. Yielded even when it lists no key — then drop everything.

    ``repo`` and ``rev`` say where the event is; ``epoch`` names the history ``rev`` belongs
    to (pass both to a later ``watch(since=…, epoch=…)`` to resume). ``lease_end`` is
    ``(lease_id, "expired" | "revoked" | "closed")`` for the deletions a lease's end made,
    ``writer`` is ``(uid, gid, pid)`` of the writer when the watch asked for ``writers``.
    """

    kind: str
    repo: str
    rev: int
    epoch: str
    changes: List[Change]
    lease_end: Optional[Tuple[int, str]] = None
    writer: Optional[Tuple[int, int, int]] = None
    from_rev: Optional[int] = None
