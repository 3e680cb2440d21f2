"""The blocking client: ``obsd.connect()`` → ``obsd.Client``.

One connection at a time. A reader thread reads it: replies go to the calls waiting for
them, in request order (the daemon answers in that order); events go to the queue of their
subscription (a ``Watch``, a ``Mirror``). The queues are bounded: when one is full and no
call waits for a reply, the reader stops reading the socket, so a slow consumer is handled
by the daemon — its ``overflow`` rule, or coalescing — not by the client's memory. While a
call waits for a reply the reader goes on (the reply is behind the events; a consumer may
make calls from inside its loop), up to a hard bound past which the fullest subscription is
cut off locally and later resumes from where its consumer got to. Neither loses an event:
a watch resumes with ``since``.

After the connection is lost (the daemon restarted, an ``overflow``), the next call
reconnects first — retrying with growing backoff while the daemon is away or refuses
connections (``overloaded``, accept-and-close), for up to ``reconnect_timeout`` — and
watches, mirrors and holds resume by themselves.
"""

from __future__ import annotations

import _thread
import errno
import logging
import socket as _socket
import threading
import time
import weakref
from collections import deque
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Iterable,
    Iterator,
    KeysView,
    ItemsView,
    List,
    Mapping,
    Optional,
    Sequence,
    Type,
    Union,
    ValuesView,
)
from types import TracebackType

from . import _wire
from ._errors import (
    BadRequest,
    Compacted,
    ConnectionError,
    Forbidden,
    NotFound,
    ObsdError,
    Overloaded,
    TooLarge,
    UnknownOp,
    error_from_reply,
)
from ._follow import INITIAL, Cursor, apply_event
from ._types import ABSENT, Delete, Entry, Event, Set, WriteResult
from ._wire import JSONObject, ProtocolViolation

__all__ = ["Client", "connect", "Watch", "Mirror", "Lease", "Hold"]

log = logging.getLogger("obsd")

PLAIN = 0
SUBSCRIBE = 1
UNSUBSCRIBE = 2
SYNC = 3

DEFAULT_QUEUE_SIZE = 1024
HARD_BOUND_FACTOR = 32


class _Lost(Exception):
    """The connection ended before the reply; ``reason`` says why."""

    def __init__(self, reason: ObsdError) -> None:
        super().__init__(reason.message)
        self.reason = reason


class _NotSent(Exception):
    """The connection was already over: the request was not sent (safe to send again)."""


class _Refused(Exception):
    """The daemon refused the connection (an ``overloaded`` line with ``id: null``)."""

    def __init__(self, error: ObsdError) -> None:
        super().__init__(error.message)
        self.error = error


class _Closed(Exception):
    """The watch, mirror or client was closed."""


class _Done(Exception):
    """The reader's loop ends (after an ``overflow``)."""


class _Control:
    """An item of a subscription's queue that is not an event."""

    __slots__ = ("what", "rev", "request")

    def __init__(self, what: str, rev: Any = None, request: Optional["_Request"] = None) -> None:
        self.what = what
        self.rev = rev
        self.request = request


_LOST = _Control("lost")
_CUT = _Control("cut")
_ENDED = _Control("ended")


class _Request:
    """A request sent and the reply it waits for."""

    __slots__ = ("op", "kind", "route", "arg", "reply", "error", "applied", "_lock", "rid")

    def __init__(self, op: str, kind: int, route: Optional["_Route"], arg: Any) -> None:
        self.rid = 0
        self.op = op
        self.kind = kind
        self.route = route
        self.arg = arg
        self.reply: Optional[JSONObject] = None
        self.error: Optional[BaseException] = None
        self.applied = False  # a sync's mark was applied by its mirror
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def succeed(self, reply: JSONObject) -> None:
        self.reply = reply
        self._lock.release()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._lock.release()

    def wait(self, deadline: Optional[float] = None) -> JSONObject:
        """The reply; raises the daemon's error, ``_Lost``, or ``TimeoutError`` past ``deadline``."""
        if deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(True, max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError(f"no reply to {self.op} in time")
        self._lock.release()
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


class _Route:
    """One subscription's queue on one connection."""

    __slots__ = ("conn", "sub", "items", "cv", "bound", "hard", "ended", "dead")

    def __init__(self, conn: "_Conn", bound: int) -> None:
        self.conn = conn
        self.sub: Optional[int] = None
        self.items: Deque[Any] = deque()
        self.cv = threading.Condition(conn.lock)
        self.bound = bound
        self.hard = bound * HARD_BOUND_FACTOR
        self.ended = False  # its consumer closed it: drop what arrives
        self.dead = False  # no more events will arrive

    def get(self, deadline: Optional[float]) -> Any:
        """The next item, waiting until ``deadline`` (``TimeoutError`` past it)."""
        with self.cv:
            items = self.items
            while not items:
                if deadline is None:
                    self.cv.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("no event in time")
                    self.cv.wait(remaining)
            item = items.popleft()
            conn = self.conn
            if conn.reader_waiting:
                conn.reader_cv.notify()
            return item


class _Conn:
    """One connection and its reader thread."""

    def __init__(self, client: "Client", sock: _socket.socket, serial: int) -> None:
        self.client_ref = weakref.ref(client)
        self.path = client.socket
        self.sock = sock
        self.serial = serial
        self.lock = threading.Lock()
        self.reader_cv = threading.Condition(self.lock)
        self.send_lock = threading.Lock()
        self.pending: Deque[_Request] = deque()
        self.routes: Dict[int, _Route] = {}
        self.closed = False
        self.reason: Optional[ObsdError] = None
        self.closed_event = threading.Event()
        self.reader_waiting = False
        self.next_id = 0
        self.hello: JSONObject = {}
        self.max_line = 1 << 20
        self.sync_supported: Optional[bool] = None
        self.close_callbacks: List[Callable[[], None]] = []
        self._shut = False
        self.thread = threading.Thread(target=self._run, name=f"obsd-reader-{serial}", daemon=True)

    # MARK: sending

    def send(self, message: JSONObject, kind: int = PLAIN, route: Optional[_Route] = None, arg: Any = None) -> _Request:
        """Sends ``message``; the request to wait on. ``_NotSent`` if the connection was over."""
        body = _wire.encode(message)
        if len(body) - 1 > self.max_line:
            raise TooLarge(
                f"the {message.get('op')} request is {len(body) - 1} bytes long; the daemon reads lines of at most {self.max_line}"
            )
        request = _Request(message["op"], kind, route, arg)
        with self.send_lock:
            with self.lock:
                if self.closed:
                    raise _NotSent()
                self.next_id += 1
                request.rid = self.next_id
                line = b'{"id":%d,' % self.next_id + body[1:]
                self.pending.append(request)
                if self.reader_waiting:
                    self.reader_cv.notify()
            try:
                self.sock.sendall(line)
            except OSError as error:
                self.fail(ConnectionError(f"the connection to obsd at {self.path} broke while sending: {error}"))
        return request

    def send_quietly(self, message: JSONObject, kind: int = PLAIN, arg: Any = None) -> None:
        """Sends without waiting for the reply (an unsubscribe); nothing if the connection is over."""
        try:
            self.send(message, kind, None, arg)
        except (_NotSent, ObsdError):
            pass

    def on_close(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the connection is over (at once if it is)."""
        with self.lock:
            if not self.closed_event.is_set():
                self.close_callbacks.append(callback)
                return
        callback()

    # MARK: reading

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        reason: Optional[ObsdError] = None
        sock = self.sock
        parts: List[bytes] = []
        dispatch = self._dispatch
        loads = _wire.loads
        try:
            while True:
                data = sock.recv(262144)
                if not data:
                    break
                start = 0
                newline = data.find(b"\n")
                while newline >= 0:
                    if parts:
                        parts.append(data[start:newline])
                        line = b"".join(parts)
                        parts = []
                    else:
                        line = data[start:newline]
                    start = newline + 1
                    newline = data.find(b"\n", start)
                    if line and line != b"\r":
                        try:
                            message = loads(line)
                        except ValueError as error:
                            raise ProtocolViolation(f"a line that is not JSON: {error}") from None
                        if type(message) is not dict:
                            raise ProtocolViolation(f"a message that is not an object: {line[:200]!r}")
                        dispatch(message)
                if start < len(data):
                    parts.append(data[start:])
        except _Done:
            pass
        except _Refused as refused:
            reason = refused.error
        except OSError as error:
            reason = ConnectionError(f"the connection to obsd at {self.path} broke: {error}")
        except (ProtocolViolation, KeyError, TypeError) as error:
            reason = ConnectionError(f"obsd at {self.path} sent what the protocol does not allow ({error}); the connection was dropped")
        except BaseException as error:  # never leave callers waiting
            reason = ConnectionError(f"the reader of the connection to {self.path} failed: {error!r}")
            log.exception("obsd: reader failed")
        finally:
            self.fail(reason or ConnectionError(f"obsd at {self.path} closed the connection"))
            try:
                sock.close()
            except OSError:
                pass

    def _dispatch(self, message: JSONObject) -> None:
        kind = message.get("event")
        if kind is None:
            self._reply(message)
            return
        if kind == "overflow":
            self._overflow(message)
            return
        sub = message.get("sub")
        with self.lock:
            route = self.routes.get(sub)  # type: ignore[arg-type]
            if route is None or route.ended:
                return
            items = route.items
            if len(items) >= route.bound:
                while len(items) >= route.bound and not self.pending and not self.closed and not route.ended:
                    self.reader_waiting = True
                    self.reader_cv.wait(1.0)  # woken by its consumer or a new request; also rechecks `ended`
                self.reader_waiting = False
                if route.ended or self.closed:
                    return
                if len(items) >= route.hard:
                    # Calls wait for replies behind this subscription's events, and its consumer is
                    # this far behind: cut it off here. It resumes from what its consumer got to.
                    del self.routes[sub]  # type: ignore[arg-type]
                    route.dead = True
                    items.append(_CUT)
                    route.cv.notify()
                    return
            items.append(message)
            route.cv.notify()
            if kind == "revoked":
                del self.routes[sub]  # type: ignore[arg-type]
                route.dead = True

    def _reply(self, message: JSONObject) -> None:
        ok = message.get("ok")
        with self.lock:
            if ok is not True and message.get("id") is None:
                error = message.get("error")
                if isinstance(error, dict) and error.get("code") == "overloaded":
                    raise _Refused(error_from_reply(error))  # the daemon refuses the connection
            if not self.pending:
                raise ProtocolViolation(f"a reply to no request: {message!r}")
            request = self.pending.popleft()
            rid = message.get("id")
            if rid is not None and rid != request.rid:
                raise ProtocolViolation(f"the reply to request {request.rid} ({request.op}) carries id {rid!r}")
            if ok is True:
                kind = request.kind
                if kind == SUBSCRIBE:
                    sub = message["sub"]
                    route = request.route
                    assert route is not None
                    route.sub = sub
                    self.routes[sub] = route
                elif kind == UNSUBSCRIBE:
                    gone = self.routes.pop(request.arg, None)
                    if gone is not None:
                        gone.dead = True
                elif kind == SYNC:
                    route = request.route
                    if route is not None and route.sub is not None and self.routes.get(route.sub) is route:
                        route.items.append(_Control("sync", message.get("rev"), request))
                        route.cv.notify()
        if ok is True:
            request.succeed(message)
        else:
            request.fail(error_from_reply(message.get("error")))

    def _overflow(self, message: JSONObject) -> None:
        revs = message.get("revs")
        if not isinstance(revs, dict):
            revs = {}
        with self.lock:
            self.closed = True
            self.reason = ConnectionError(f"obsd at {self.path} cut the connection off: its events were read too slowly (overflow)")
            for sub, route in self.routes.items():
                route.dead = True
                route.items.append(_Control("overflow", revs.get(str(sub))))
                route.cv.notify()
            self.routes.clear()
        raise _Done()

    # MARK: ending

    def fail(self, reason: ObsdError) -> None:
        """Ends the connection: waiting calls fail with ``_Lost``, subscriptions get ``_LOST``."""
        with self.lock:
            self.closed = True
            if self.reason is None:
                self.reason = reason
            pending = list(self.pending)
            self.pending.clear()
            for route in self.routes.values():
                route.dead = True
                route.items.append(_LOST)
                route.cv.notify_all()
            self.routes.clear()
            self.reader_cv.notify_all()
            shut = self._shut
            self._shut = True
            callbacks = self.close_callbacks
            self.close_callbacks = []
            final = self.reason
        lost = _Lost(final)
        for request in pending:
            request.fail(lost)
        if not shut:
            try:
                self.sock.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass
        self.closed_event.set()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # pragma: no cover - callbacks are the client's own
                log.exception("obsd: a connection-close callback failed")


def _explain(error: OSError) -> str:
    code = error.errno
    if code == errno.ENOENT:
        return "no such file — is obsd running?"
    if code == errno.ECONNREFUSED:
        return "connection refused — is obsd running?"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied — check the socket's owner and mode"
    if code == errno.ENOTSOCK:
        return "not a socket"
    return str(error)


class Client:
    """A connection to obsd that comes back. Thread-safe: any thread may call it.

    Make one with ``obsd.connect()``. Calls are blocking; several threads may call at once
    (their requests are pipelined on the one connection). Use it as a context manager, or
    call ``close()``.

    ``reconnect_timeout`` bounds how long a call waits for a daemon that went away (or
    refuses connections) to come back before raising ``obsd.ConnectionError``; watches,
    mirrors and holds wait as long as it takes. ``queue_size`` is how many events each watch
    or mirror may hold unconsumed before the client stops reading (see the module's header).
    """

    def __init__(self, socket: Optional[str] = None, *, reconnect_timeout: float = 30.0, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        if isinstance(reconnect_timeout, bool) or not isinstance(reconnect_timeout, (int, float)) or reconnect_timeout < 0:
            raise BadRequest(f"reconnect_timeout must be a number of seconds ≥ 0, not {reconnect_timeout!r}")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise BadRequest(f"queue_size must be an int ≥ 1, not {queue_size!r}")
        self.socket: str = _wire.resolve_socket(socket)
        """The socket path the client connects to."""
        self.reconnect_timeout = float(reconnect_timeout)
        self.queue_size = queue_size
        self._backoff = _wire.Backoff()
        self._conn: Optional[_Conn] = None
        self._connect_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()
        self._failures = 0
        self._serial = 0
        self._owned: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._owned_lock = threading.Lock()
        self._first_connection()

    # MARK: connecting

    def _attempt(self, deadline: Optional[float]) -> _Conn:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.connect(self.socket)
        except OSError:
            sock.close()
            raise
        self._serial += 1
        conn = _Conn(self, sock, self._serial)
        conn.start()
        try:
            request = conn.send({"op": "hello", "protocol": 1, "client": _wire.CLIENT_NAME})
            hello_deadline = time.monotonic() + 30.0
            if deadline is not None:
                hello_deadline = min(hello_deadline, max(deadline, time.monotonic() + 1.0))
            reply = request.wait(hello_deadline)
        except _NotSent:
            raise _Lost(conn.reason or ConnectionError(f"obsd at {self.socket} closed the connection at once")) from None
        except TimeoutError:
            conn.fail(ConnectionError(f"obsd at {self.socket} did not answer hello"))
            raise _Lost(ConnectionError(f"obsd at {self.socket} accepted the connection but did not answer")) from None
        except BaseException:
            conn.fail(ConnectionError("the connection attempt failed"))
            raise
        conn.hello = reply
        max_line = reply.get("maxLine")
        if isinstance(max_line, int) and not isinstance(max_line, bool) and max_line > 0:
            conn.max_line = max_line
        return conn

    def _first_connection(self) -> None:
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                self._conn = self._attempt(deadline)
                return
            except OSError as error:
                raise ConnectionError(f"cannot connect to obsd at {self.socket}: {_explain(error)}") from None
            except _Lost as lost:  # refused (overloaded) or closed at once: try again, more slowly
                last: ObsdError = lost.reason
            except ObsdError as error:
                last = error
            delay = self._backoff.delay(self._failures)
            self._failures += 1
            if time.monotonic() + delay > deadline:
                raise ConnectionError(f"obsd at {self.socket} refused the connection ({last.message}); gave up after {self.reconnect_timeout:g} s")
            time.sleep(delay)

    def _connection(self, deadline: Optional[float]) -> _Conn:
        """The live connection, reconnecting (with backoff, until ``deadline``) if there is none."""
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise ConnectionError("the client is closed")
        if deadline is None:
            acquired = self._connect_lock.acquire()
        else:
            acquired = self._connect_lock.acquire(True, max(deadline - time.monotonic(), 0.0))
        if not acquired:
            raise ConnectionError(f"obsd at {self.socket} did not come back within {self.reconnect_timeout:g} s")
        try:
            last: Optional[str] = None
            while True:
                conn = self._conn
                if conn is not None and not conn.closed:
                    return conn
                if self._closed:
                    raise ConnectionError("the client is closed")
                try:
                    conn = self._attempt(deadline)
                    self._conn = conn
                    self._failures = 0
                    return conn
                except OSError as error:
                    last = _explain(error)
                except _Lost as lost:
                    last = lost.reason.message
                except ObsdError as error:
                    last = error.message
                delay = self._backoff.delay(self._failures)
                self._failures += 1
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise ConnectionError(f"obsd at {self.socket} did not come back within {self.reconnect_timeout:g} s ({last})")
                if self._closing.wait(delay):
                    raise ConnectionError("the client is closed")
        finally:
            self._connect_lock.release()

    def _deadline(self) -> float:
        return time.monotonic() + self.reconnect_timeout

    def _call(self, message: JSONObject, *, write: bool = False) -> JSONObject:
        """Sends ``message`` and returns its reply, reconnecting first if needed.

        A read whose connection is lost before the reply is sent again; a write is not (its
        outcome is unknown): it raises ``obsd.ConnectionError``.
        """
        deadline = self._deadline()
        while True:
            conn = self._connection(deadline)
            try:
                request = conn.send(message)
            except _NotSent:
                continue
            try:
                return request.wait()
            except _Lost as lost:
                if write:
                    raise ConnectionError(
                        f"the connection to obsd was lost before the reply to {message['op']} "
                        f"({lost.reason.message}): its outcome is unknown — it may or may not have been applied"
                    ) from None
                if time.monotonic() > deadline:
                    raise ConnectionError(f"the connection to obsd was lost ({lost.reason.message})") from None

    def _own(self, thing: Any) -> None:
        with self._owned_lock:
            self._owned[id(thing)] = thing

    # MARK: the API

    @property
    def server(self) -> str:
        """The daemon's name and version, as its ``hello`` said (``"obsd/0.3.0"``)."""
        conn = self._conn
        return str(conn.hello.get("server", "")) if conn is not None else ""

    def ping(self) -> None:
        """Checks that the daemon answers."""
        self._call({"op": "ping"})

    def set(
        self, repo: str, key: str, value: Any, *, if_revision: Optional[int] = None, force: bool = False, lease: Any = None
    ) -> WriteResult:
        """Sets ``key`` of ``repo`` to ``value`` (any JSON value; ``None`` is ``null``).

        A value equal to the current one changes nothing (``changed`` false, no event) unless
        ``force``. With ``if_revision``, only if the key's revision is still that (0: only if the
        key does not exist), else ``obsd.Conflict``. With ``lease`` (an id or an ``obsd.Lease``),
        the key is deleted when that lease ends. ``old`` is the previous value, or ``obsd.ABSENT``.
        """
        return _wire.write_result(self._call(_wire.set_request(repo, key, value, if_revision, force, lease), write=True))

    def get(self, repo: str, key: str) -> Entry:
        """The value of ``key``, the revision that last changed it, and its lease; ``obsd.NotFound`` if absent."""
        message = {"op": "get", "repo": _wire.check_repo(repo), "key": _wire.check_key(key)}
        return _wire.entry(self._call(message))

    def delete(self, repo: str, key: str, *, if_revision: Optional[int] = None) -> WriteResult:
        """Deletes ``key`` (an absent key is not an error: ``changed`` is false); ``if_revision`` as for ``set``."""
        return _wire.write_result(self._call(_wire.delete_request(repo, key, if_revision), write=True))

    def batch(self, repo: str, ops: Sequence[Union[Set, Delete]]) -> WriteResult:
        """Applies ``obsd.Set``s and ``obsd.Delete``s atomically, as one revision (all, or none on a ``Conflict``)."""
        reply = self._call(_wire.batch_request(repo, ops), write=True)
        return WriteResult(_wire.write_result(reply).rev, bool(reply.get("changed")), ABSENT)

    def keys(self, repo: str, prefix: Optional[str] = None) -> List[str]:
        """The keys of ``repo`` (those starting with ``prefix``), sorted by their UTF-8 bytes."""
        return list(self._call(_wire.list_request(repo, prefix, False))["keys"])

    def items(self, repo: str, prefix: Optional[str] = None) -> Dict[str, Any]:
        """The keys of ``repo`` (those starting with ``prefix``) and their values, in key order."""
        reply = self._call(_wire.list_request(repo, prefix, True))
        values = reply.get("values") or {}
        return {k: values[k] for k in reply["keys"]}

    def repos(self) -> List[Dict[str, Any]]:
        """The repositories that exist (that this user may read): ``{"name", "rev", "keys", "epoch"}`` each."""
        return list(self._call({"op": "repos"})["repos"])

    def stats(self) -> Dict[str, Any]:
        """The daemon's counters (its totals only for root and the daemon's own user)."""
        reply = dict(self._call({"op": "stats"}))
        for name in ("id", "ok"):
            reply.pop(name, None)
        return reply

    def watch(
        self,
        repo: str,
        *,
        keys: Optional[Iterable[str]] = None,
        prefix: Optional[str] = None,
        since: Optional[int] = None,
        epoch: Optional[str] = None,
        coalesce: bool = False,
        writers: bool = False,
    ) -> "Watch":
        """Watches the selected keys of ``repo`` (``keys``, or ``prefix``, or all): an iterator of ``obsd.Event``.

        It subscribes now, so nothing written after this call returns is missed. With
        ``since`` (and the ``epoch`` it belongs to) it starts after that revision instead,
        replaying what followed. It never ends on its own: across a lost connection or a
        restart of the daemon it reconnects and resumes, with no change missed or repeated
        within one history (``"catchup"`` or ``"reset"`` events when the daemon cannot replay).
        """
        return Watch(self, repo, keys, prefix, since, epoch, coalesce, writers)

    def mirror(self, repo: str, *, prefix: Optional[str] = None) -> "Mirror":
        """A live read-only mapping of the keys of ``repo`` (those starting with ``prefix``), kept current in the background.

        Returns once the mirror holds the repository's state. See ``obsd.Mirror``.
        """
        return Mirror(self, repo, prefix)

    def hold(self, repo: str, key: str, value: Any) -> "Hold":
        """A context manager that holds ``key`` of ``repo`` at ``value`` while its block runs.

        The key is written on a lease bound to the connection: if the process dies, the daemon
        deletes it. After a reconnection it is written again on a new lease (absent in
        between). When the block exits the lease is revoked, which deletes the key. ``as``
        binds the ``obsd.Lease``.
        """
        return Hold(self, repo, key, value)

    def grant(self, ttl: Optional[float] = None) -> "Lease":
        """Grants a lease: keys written with ``lease=`` it are deleted when it ends.

        With ``ttl`` (seconds, 1 to a year) it ends that long after it was last kept alive —
        the returned ``Lease`` keeps it alive in the background (every third of the TTL) until
        it is revoked or the client closes. Without, it ends with this client's connection.
        """
        if ttl is None:
            deadline = self._deadline()
            while True:
                conn = self._connection(deadline)
                try:
                    reply = conn.send({"op": "grant"}).wait()
                except (_NotSent, _Lost):
                    continue  # a connection-bound lease ended with its connection anyway
                lease = Lease(self, _wire._int(reply, "lease"), None, conn)
                break
        else:
            seconds = _wire.check_ttl(ttl)
            reply = self._call({"op": "grant", "ttl": seconds}, write=True)
            lease = Lease(self, _wire._int(reply, "lease"), seconds, None)
        self._own(lease)
        return lease

    def keepalive(self, lease: Any) -> Optional[int]:
        """Starts the TTL of ``lease`` (an id or ``obsd.Lease``) again in full; its TTL, or ``None`` for a connection-bound lease."""
        ttl = self._call({"op": "keepalive", "lease": _wire.check_lease(lease)}).get("ttl")
        return ttl if isinstance(ttl, int) else None

    def revoke(self, lease: Any) -> Dict[str, int]:
        """Ends ``lease`` now: its keys are deleted. The revision that deleted them, by repository."""
        reply = self._call({"op": "revoke", "lease": _wire.check_lease(lease)}, write=True)
        return dict(reply.get("revs") or {})

    def close(self) -> None:
        """Closes the connection; watches end, mirrors stop, holds and leases stop being kept."""
        with self._owned_lock:
            owned = list(self._owned.values())
        self._closed = True
        self._closing.set()
        for thing in owned:
            try:
                thing._client_closed()
            except Exception:  # pragma: no cover
                log.exception("obsd: closing %r failed", thing)
        conn = self._conn
        if conn is not None:
            conn.fail(ConnectionError("the client is closed"))
            if conn.thread.is_alive() and conn.thread is not threading.current_thread():
                conn.thread.join(5.0)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def __del__(self) -> None:
        # A client dropped without close(): end its connection (no locks: see Watch.__del__).
        conn = getattr(self, "_conn", None)
        if conn is not None and not getattr(self, "_closed", True):
            try:
                conn.sock.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<obsd.Client socket={self.socket!r}{' closed' if self._closed else ''}>"


def connect(socket: Optional[str] = None, *, reconnect_timeout: float = 30.0, queue_size: int = DEFAULT_QUEUE_SIZE) -> Client:
    """Connects to obsd: an ``obsd.Client``.

    ``socket``: the socket's path; else ``$OBSD_SOCKET``, else ``$XDG_RUNTIME_DIR/obsd.sock``,
    else ``/run/obsd/obsd.sock`` (the environment is read now). Raises
    ``obsd.ConnectionError`` at once if nothing listens there; a daemon that refuses the
    connection for now (``overloaded``) is tried again, with backoff, for up to
    ``reconnect_timeout`` seconds.
    """
    return Client(socket, reconnect_timeout=reconnect_timeout, queue_size=queue_size)


# MARK: subscriptions that resume


class _Follower:
    """A subscription that resumes after its connection ends (the engine of Watch and Mirror)."""

    def __init__(self, client: Client, cursor: Cursor) -> None:
        self.client = client
        self.cursor = cursor
        self.route: Optional[_Route] = None
        self.generation = 0
        self.closed = False
        self.stop = threading.Event()
        self.failures = 0
        self.on_route: Optional[Callable[[], None]] = None

    def _subscribe(self, conn: _Conn) -> None:
        message, mode = self.cursor.request()
        route = _Route(conn, self.client.queue_size)
        try:
            reply = conn.send(message, SUBSCRIBE, route).wait()
        except Compacted:  # a daemon without catch-up: start again from the complete state
            message, mode = self.cursor.fallback()
            route = _Route(conn, self.client.queue_size)
            reply = conn.send(message, SUBSCRIBE, route).wait()
        self.cursor.subscribed(reply, mode)
        self.route = route
        self.generation += 1
        if self.closed:
            self._end_route()
        if self.on_route is not None:
            self.on_route()

    def open(self) -> None:
        """The first subscription: its refusal is raised."""
        deadline = self.client._deadline()
        while True:
            conn = self.client._connection(deadline)
            try:
                self._subscribe(conn)
                return
            except (_NotSent, _Lost):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"obsd at {self.client.socket} did not come back within {self.client.reconnect_timeout:g} s") from None

    def resume(self, deadline: Optional[float]) -> None:
        """Subscribes again from the cursor's position; waits for the daemon as long as it takes (or ``deadline``)."""
        while True:
            if self.closed or self.client._closed:
                raise _Closed()
            try:
                conn = self.client._connection(deadline)
            except ConnectionError:
                if self.closed or self.client._closed:
                    raise _Closed() from None
                raise TimeoutError("the daemon did not come back in time") from None
            try:
                self._subscribe(conn)
                self.failures = 0
                return
            except (_NotSent, _Lost):
                continue
            except Overloaded:  # too many large starts at once, too many subscriptions: later
                delay = self.client._backoff.delay(self.failures)
                self.failures += 1
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise TimeoutError("the daemon did not take the subscription in time") from None
                if self.stop.wait(delay):
                    raise _Closed() from None

    def next_item(self, deadline: Optional[float]) -> Any:
        """The next event (a dict) or sync mark of the subscription, resuming as needed."""
        while True:
            route = self.route
            if route is None:
                self.resume(deadline)
                continue
            item = route.get(deadline)
            if type(item) is dict:
                return item
            what = item.what
            if what == "sync":
                return item
            if what == "ended":
                raise _Closed()
            self.route = None
            if what == "overflow":
                self.cursor.overflowed(item.rev)
            else:
                if what == "cut" and route.sub is not None:
                    route.conn.send_quietly({"op": "unsubscribe", "sub": route.sub}, UNSUBSCRIBE, route.sub)
                self.cursor.lost()

    def _end_route(self) -> None:
        route = self.route
        if route is None:
            return
        conn = route.conn
        with conn.lock:
            route.ended = True
            route.items.append(_ENDED)
            route.cv.notify_all()
            if conn.reader_waiting:
                conn.reader_cv.notify()
        if route.sub is not None and not route.dead:
            conn.send_quietly({"op": "unsubscribe", "sub": route.sub}, UNSUBSCRIBE, route.sub)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        self._end_route()


class Watch(Iterator[Event]):
    """The events of one watch (see ``Client.watch``): iterate it, or call ``next_event(timeout)``.

    It ends only when closed (``close()``, a ``with`` block, or the client closing). It raises
    ``obsd.Forbidden`` if the daemon ends the subscription for good (access revoked).
    ``rev`` and ``epoch`` say where it is: pass them to a later ``watch(since=…, epoch=…)``.
    """

    def __init__(
        self,
        client: Client,
        repo: str,
        keys: Optional[Iterable[str]],
        prefix: Optional[str],
        since: Optional[int],
        epoch: Optional[str],
        coalesce: bool,
        writers: bool,
    ) -> None:
        _wire.check_repo(repo)
        select = _wire.selection(keys, prefix)
        if since is not None:
            _wire.check_revision(since, "since")
        if epoch is not None:
            if not isinstance(epoch, str):
                raise BadRequest(f"epoch must be a str, not {type(epoch).__name__}")
            if since is None:
                raise BadRequest("epoch names the history of since: pass since with it")
        cursor = Cursor(
            repo, select, since=since, epoch=epoch, coalesce=_wire.check_bool(coalesce, "coalesce"), writers=_wire.check_bool(writers, "writers")
        )
        self.repo = repo
        """The repository watched."""
        self._follower = _Follower(client, cursor)
        self._follower.open()
        client._own(self)

    @property
    def rev(self) -> Optional[int]:
        """Every selected change through this revision has been handed on."""
        return self._follower.cursor.position

    @property
    def epoch(self) -> Optional[str]:
        """The history ``rev`` belongs to."""
        return self._follower.cursor.epoch

    def __iter__(self) -> "Watch":
        return self

    def __next__(self) -> Event:
        try:
            return self._next(None)
        except _Closed:
            raise StopIteration from None

    def next_event(self, timeout: Optional[float] = None) -> Event:
        """The next event; ``TimeoutError`` if none comes within ``timeout`` seconds, ``obsd.ConnectionError`` once closed."""
        try:
            return self._next(None if timeout is None else time.monotonic() + timeout)
        except _Closed:
            raise ConnectionError("the watch is closed") from None

    def _next(self, deadline: Optional[float]) -> Event:
        follower = self._follower
        cursor = follower.cursor
        while True:
            item = follower.next_item(deadline)
            if type(item) is dict:
                event = cursor.event(item)
                if event is not None:
                    return event
            else:
                cursor.synced_to(item.rev)

    def close(self) -> None:
        """Ends the watch (unsubscribes); iteration stops."""
        self._follower.close()

    def _client_closed(self) -> None:
        self._follower.closed = True
        self._follower.stop.set()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    def __del__(self) -> None:
        # No locks here (a collection may run on any thread, the reader's included): the
        # reader drops what still arrives for the subscription, which ends with the connection.
        follower = getattr(self, "_follower", None)
        if follower is not None and not follower.closed:
            follower.closed = True
            route = follower.route
            if route is not None:
                route.ended = True


class Mirror(Mapping[str, Any]):
    """A live read-only copy of the selected keys of one repository (see ``Client.mirror``).

    A ``Mapping[str, Any]``: ``m["k"]``, ``"k" in m``, ``len(m)``, iteration, ``m.items()``
    (each view a consistent copy taken when called). A background thread keeps it current
    from a coalescing subscription — it reflects the state, not every intermediate value — and
    resumes it after a lost connection or a restart (applying a catch-up in place, or
    replacing everything on a reset).

    ``rev`` is the revision it is known to be current to. ``sync()`` waits until it shows
    every write acknowledged before the call. ``on_change(callback)`` calls ``callback(keys)``
    in the mirror's thread with the keys that changed, after each step.
    """

    def __init__(self, client: Client, repo: str, prefix: Optional[str]) -> None:
        _wire.check_repo(repo)
        select = _wire.selection(None, prefix)
        self.repo = repo
        """The repository mirrored."""
        self.prefix = prefix
        """The prefix of the keys mirrored (``None``: every key)."""
        self._client = client
        self._cond = threading.Condition()
        self._data: Dict[str, Any] = {}
        self._rev = 0
        self._loaded = False
        self._failure: Optional[BaseException] = None
        self._callbacks: List[Callable[[List[str]], Any]] = []
        self._follower = _Follower(client, Cursor(repo, select, coalesce=True, initial=True))
        self._follower.on_route = self._route_changed
        self._follower.open()
        self._thread = threading.Thread(target=self._run, name=f"obsd-mirror-{repo}", daemon=True)
        self._thread.start()
        client._own(self)
        deadline = client._deadline()
        with self._cond:
            while not self._loaded and self._failure is None and not self._follower.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            failure, loaded = self._failure, self._loaded
        if not loaded:
            self.close()
            if failure is not None:
                raise failure
            raise ConnectionError(f"the mirror of {repo} did not load within {client.reconnect_timeout:g} s")

    def _route_changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        follower = self._follower
        cursor = follower.cursor
        try:
            while True:
                item = follower.next_item(None)
                if type(item) is not dict:
                    with self._cond:
                        cursor.synced_to(item.rev)
                        self._rev = cursor.position or self._rev
                        item.request.applied = True
                        self._cond.notify_all()
                    continue
                event = cursor.event(item)
                with self._cond:
                    changed: List[str] = []
                    if event is not None:
                        self._data, changed = apply_event(self._data, event)
                        if event.kind == "reset":
                            self._loaded = True
                    if cursor.position is not None and self._loaded:
                        self._rev = cursor.position
                    self._cond.notify_all()
                    callbacks = list(self._callbacks) if changed else []
                for callback in callbacks:
                    try:
                        callback(changed)
                    except Exception:
                        log.exception("obsd: a mirror's on_change callback failed")
        except _Closed:
            pass
        except BaseException as error:
            with self._cond:
                self._failure = error
                self._cond.notify_all()
            if not isinstance(error, ObsdError):
                log.exception("obsd: the mirror of %s stopped", self.repo)

    # MARK: Mapping

    def __getitem__(self, key: str) -> Any:
        with self._cond:
            return self._data[key]

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._data

    def __len__(self) -> int:
        with self._cond:
            return len(self._data)

    def __iter__(self) -> Iterator[str]:
        with self._cond:
            return iter(list(self._data))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if it does not exist."""
        with self._cond:
            return self._data.get(key, default)

    def snapshot(self) -> Dict[str, Any]:
        """A copy of the mirrored keys and values, consistent at ``rev``."""
        with self._cond:
            return dict(self._data)

    def keys(self) -> KeysView[str]:
        """The keys, as a consistent copy."""
        return self.snapshot().keys()

    def items(self) -> ItemsView[str, Any]:
        """The keys and values, as a consistent copy."""
        return self.snapshot().items()

    def values(self) -> ValuesView[Any]:
        """The values, as a consistent copy."""
        return self.snapshot().values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mirror):
            return self is other
        if isinstance(other, Mapping):
            return self.snapshot() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        with self._cond:
            return f"<obsd.Mirror {self.repo!r} rev={self._rev} keys={len(self._data)}>"

    # MARK: freshness

    @property
    def rev(self) -> int:
        """The revision the mirror is known to be current to."""
        with self._cond:
            return self._rev

    @property
    def epoch(self) -> Optional[str]:
        """The history ``rev`` belongs to."""
        return self._follower.cursor.epoch

    def on_change(self, callback: Callable[[List[str]], Any]) -> Callable[[], None]:
        """Calls ``callback(keys)`` with the keys that changed, after each change is applied; returns a function that stops it."""
        if not callable(callback):
            raise BadRequest("on_change takes a callable")
        with self._cond:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._cond:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return remove

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._follower.closed:
            raise ConnectionError("the mirror is closed")

    def _wait_route(self, old: Optional[_Route], deadline: Optional[float]) -> None:
        """Waits until the mirror has a subscription other than ``old``."""
        with self._cond:
            while True:
                self._check()
                route = self._follower.route
                if route is not None and route is not old and not route.dead:
                    return
                if deadline is None:
                    self._cond.wait(1.0)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("the mirror could not reach the daemon in time")
                    self._cond.wait(min(remaining, 1.0))

    def sync(self, timeout: Optional[float] = None) -> int:
        """Waits until the mirror shows every write acknowledged (to anyone) before the call; returns ``rev``.

        Uses the daemon's ``sync`` operation: its reply comes after every event of the
        mirror's subscription up to the revision it reports. Against a daemon without it
        (``unknown_op``), reads the repository's revision (a subscription that selects no key)
        and waits for the mirror to reach it — through its events, or the daemon's
        ``progress`` events, which come within about a second. ``TimeoutError`` past
        ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        route: Optional[_Route] = None
        while True:
            with self._cond:
                self._check()
                current = self._follower.route
            if current is None or current.dead or current is route:
                self._wait_route(route, deadline)
                continue
            route = current
            conn = route.conn
            if conn.sync_supported is False:
                result = self._sync_by_revision(route, deadline)
                if result is not None:
                    return result
                continue
            try:
                request = conn.send({"op": "sync", "sub": route.sub}, SYNC, route)
                reply = request.wait(deadline)
            except UnknownOp:
                conn.sync_supported = False
                route = None
                continue
            except (_NotSent, _Lost, NotFound):
                continue  # the subscription ended meanwhile: sync on the one that resumes it
            conn.sync_supported = True
            with self._cond:
                while not request.applied:
                    self._check()
                    if self._follower.route is not route:
                        break
                    if deadline is None:
                        self._cond.wait(1.0)
                    else:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError("the mirror did not catch up in time")
                        self._cond.wait(min(remaining, 1.0))
                if request.applied:
                    return max(self._rev, int(reply.get("rev", 0)))

    def _sync_by_revision(self, route: _Route, deadline: Optional[float]) -> Optional[int]:
        conn = route.conn
        probe = _Route(conn, 1)
        probe.ended = True  # it selects nothing; drop anything that arrives for it
        try:
            reply = conn.send({"op": "subscribe", "repo": self.repo, "keys": []}, SUBSCRIBE, probe).wait(deadline)
        except (_NotSent, _Lost):
            return None
        conn.send_quietly({"op": "unsubscribe", "sub": reply["sub"]}, UNSUBSCRIBE, reply["sub"])
        target, epoch = int(reply["rev"]), reply.get("epoch")
        with self._cond:
            while True:
                self._check()
                if self._follower.route is not route:
                    return None
                if self._rev >= target and self._follower.cursor.epoch == epoch:
                    return self._rev
                if deadline is None:
                    self._cond.wait(1.0)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"the mirror did not reach revision {target} in time")
                    self._cond.wait(min(remaining, 1.0))

    def close(self) -> None:
        """Stops following the daemon; the contents stay as they are."""
        self._follower.close()
        with self._cond:
            self._cond.notify_all()

    def _client_closed(self) -> None:
        self._follower.closed = True
        self._follower.stop.set()

    def __enter__(self) -> "Mirror":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()


# MARK: leases


class Lease:
    """A lease: the keys written with it (``lease=``) are deleted when it ends.

    From ``Client.grant``: a lease with a TTL is kept alive in the background (a keepalive
    every third of the TTL) until revoked or its client closes; one without ends with the
    client's connection. From ``Client.hold``: the lease the held key is attached to (``id``
    changes when the hold writes the key again after a reconnection). A context manager:
    the block's end revokes it.
    """

    def __init__(self, client: Client, ident: int, ttl: Optional[int], conn: Optional[_Conn], hold: Optional["Hold"] = None) -> None:
        self._client = client
        self._id = ident
        self.ttl: Optional[int] = ttl
        """The TTL it was granted with (seconds); ``None`` for a lease bound to its connection."""
        self._conn = conn
        self._hold = hold
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if conn is not None and hold is None:
            conn.on_close(self._ended.set)
        if ttl is not None:
            self._thread = threading.Thread(target=self._keep, name=f"obsd-lease-{ident}", daemon=True)
            self._thread.start()

    @property
    def id(self) -> int:
        """The lease's id: pass it (or the ``Lease``) as ``lease=`` to ``set``."""
        return self._id

    @property
    def ended(self) -> bool:
        """Whether the lease is known to have ended (revoked, expired, or its connection closed)."""
        return self._ended.is_set()

    def _keep(self) -> None:
        assert self.ttl is not None
        interval = self.ttl / 3.0
        while not self._stop.wait(interval):
            try:
                self._client.keepalive(self._id)
            except (NotFound, Forbidden):
                self._ended.set()
                return
            except ObsdError as error:
                if self._client._closed:
                    return
                log.warning("obsd: keepalive of lease %d failed (%s); trying again", self._id, error)

    def keepalive(self) -> Optional[int]:
        """Starts the TTL again in full now (the background keepalive does so every third of it)."""
        try:
            return self._client.keepalive(self._id)
        except (NotFound, Forbidden):
            self._ended.set()
            raise

    def revoke(self) -> Dict[str, int]:
        """Ends the lease now; its keys are deleted. The revisions that deleted them, by repository ({} if it had ended)."""
        self._stop.set()
        if self._hold is not None:
            return self._hold.release()
        if self._ended.is_set():
            return {}
        try:
            if self._conn is not None:
                try:
                    reply = self._conn.send({"op": "revoke", "lease": self._id}).wait()
                except (_NotSent, _Lost):
                    return {}  # its connection closed: the lease ended with it
                revs: Dict[str, int] = dict(reply.get("revs") or {})
            else:
                revs = self._client.revoke(self._id)
        except NotFound:
            revs = {}
        self._ended.set()
        return revs

    def _client_closed(self) -> None:
        self._stop.set()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if not self._ended.is_set() and not self._client._closed:
            try:
                self.revoke()
            except ConnectionError:
                pass

    def __repr__(self) -> str:
        return f"<obsd.Lease {self._id}{' ttl=%d' % self.ttl if self.ttl else ''}{' ended' if self.ended else ''}>"


class Hold:
    """Holds a key at a value while a ``with`` block runs (see ``Client.hold``); ``as`` binds the ``obsd.Lease``.

    ``acquire()`` and ``release()`` do the same without a block.
    """

    def __init__(self, client: Client, repo: str, key: str, value: Any) -> None:
        _wire.set_request(repo, key, value, None, False, None)  # checks the arguments now
        self._client = client
        self.repo = repo
        """The repository of the key held."""
        self.key = key
        """The key held."""
        self.value = value
        """The value it is held at."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._released = False
        self._conn: Optional[_Conn] = None
        self._lease: Optional[Lease] = None
        self._thread: Optional[threading.Thread] = None
        self.failure: Optional[BaseException] = None
        """Why the hold stopped writing the key again after a reconnection (``None`` while it holds)."""

    @property
    def lease(self) -> Optional[Lease]:
        """The lease the key is attached to (``None`` before ``acquire``)."""
        return self._lease

    @property
    def held(self) -> bool:
        """Whether the key is written now (false while reconnecting, and once released)."""
        with self._lock:
            return self._conn is not None and not self._conn.closed and not self._released

    def _establish(self, conn: _Conn) -> int:
        """Grants a lease on ``conn`` and writes the key with it; its id."""
        reply = conn.send({"op": "grant"}).wait()
        ident = _wire._int(reply, "lease")
        try:
            conn.send(_wire.set_request(self.repo, self.key, self.value, None, False, ident)).wait()
        except ObsdError:
            conn.send_quietly({"op": "revoke", "lease": ident})
            raise
        return ident

    def acquire(self) -> Lease:
        """Writes the key on a new connection-bound lease and keeps it written; the lease."""
        if self._lease is not None:
            raise BadRequest("this hold was already acquired")
        deadline = self._client._deadline()
        while True:
            conn = self._client._connection(deadline)
            try:
                ident = self._establish(conn)
                break
            except (_NotSent, _Lost):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"obsd at {self._client.socket} did not keep a connection long enough to hold {self.key!r}") from None
        self._lease = Lease(self._client, ident, None, None, hold=self)
        with self._lock:
            self._conn = conn
        conn.on_close(self._wake.set)
        self._thread = threading.Thread(target=self._keep, name=f"obsd-hold-{self.key}", daemon=True)
        self._thread.start()
        self._client._own(self)
        return self._lease

    def _keep(self) -> None:
        """Writes the key again after each reconnection, until released."""
        failures = 0
        while True:
            self._wake.wait()
            with self._lock:
                if self._released:
                    return
                conn = self._conn
            if conn is not None and not conn.closed:
                self._wake.clear()
                continue
            try:
                conn = self._client._connection(None)
                ident = self._establish(conn)
            except (_NotSent, _Lost):
                continue
            except ConnectionError:
                return  # the client closed
            except ObsdError as error:
                self.failure = error
                delay = self._client._backoff.delay(failures)
                failures += 1
                if self._client._closing.wait(delay):
                    return
                continue
            failures = 0
            self.failure = None
            with self._lock:
                released = self._released
                if not released:
                    self._conn = conn
                    assert self._lease is not None
                    self._lease._id = ident
                    self._wake.clear()
            if released:
                conn.send_quietly({"op": "revoke", "lease": ident})
                return
            conn.on_close(self._wake.set)

    def release(self) -> Dict[str, int]:
        """Revokes the lease, which deletes the key; the revisions that deleted it, by repository."""
        with self._lock:
            if self._released:
                return {}
            self._released = True
            conn = self._conn
            lease = self._lease
        self._wake.set()
        if lease is not None:
            lease._ended.set()
        if conn is None or conn.closed or lease is None:
            return {}
        try:
            reply = conn.send({"op": "revoke", "lease": lease.id}).wait()
        except (_NotSent, _Lost, NotFound):
            return {}  # its connection closed, which ended it
        return dict(reply.get("revs") or {})

    def _client_closed(self) -> None:
        with self._lock:
            self._released = True
        self._wake.set()

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            self.release()
        except ConnectionError:
            pass
