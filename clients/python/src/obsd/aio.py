"""obsd for asyncio: the client's API as coroutines, async iterators and async context managers.

```
import obsd.aio

async with obsd.aio.connect() as c:
    await c.set("ui", "theme", "dark")
    async for event in c.watch("ui", keys=["theme"]):
        print(event.changes)
```

The same rules as the blocking client (``obsd.Client``): one connection, replies matched to
requests in order, events routed to their watch or mirror through bounded queues (the
reader stops reading the socket while a queue is full and no reply is awaited), watches
that resume after a lost connection or a restart, and writes whose outcome a lost
connection left unknown raising ``obsd.ConnectionError``. Everything runs on the event loop
that connected; the client is not thread-safe (use the blocking client from threads).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import weakref
from collections import deque
from types import TracebackType
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Deque,
    Dict,
    Generator,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    List,
    Mapping,
    Optional,
    Sequence,
    Type,
    Union,
    ValuesView,
)

from . import _wire
from ._client import (
    _CUT,
    _ENDED,
    _LOST,
    PLAIN,
    SUBSCRIBE,
    SYNC,
    UNSUBSCRIBE,
    DEFAULT_QUEUE_SIZE,
    HARD_BOUND_FACTOR,
    _Closed,
    _Control,
    _Done,
    _explain,
    _Lost,
    _NotSent,
    _Refused,
)
from ._errors import BadRequest, Compacted, ConnectionError, Forbidden, NotFound, ObsdError, Overloaded, TooLarge, UnknownOp, error_from_reply
from ._follow import Cursor, apply_event
from ._types import ABSENT, Delete, Entry, Event, Set, WriteResult
from ._wire import JSONObject, ProtocolViolation

__all__ = ["connect", "Client", "Watch", "Mirror", "Lease", "Hold"]

log = logging.getLogger("obsd")

_DRAIN_ABOVE = 1 << 20


class _Request:
    __slots__ = ("op", "kind", "route", "arg", "future", "applied", "rid")

    def __init__(self, op: str, kind: int, route: Optional["_Route"], arg: Any, future: "asyncio.Future[JSONObject]") -> None:
        self.rid = 0
        self.op = op
        self.kind = kind
        self.route = route
        self.arg = arg
        self.future = future
        self.applied = False


def _resolve(future: "asyncio.Future[JSONObject]", reply: Optional[JSONObject], error: Optional[BaseException]) -> None:
    if future.done():
        return  # its caller was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        assert reply is not None
        future.set_result(reply)


async def _wait(future: "asyncio.Future[JSONObject]", deadline: Optional[float]) -> JSONObject:
    if deadline is None:
        return await asyncio.shield(future)
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(asyncio.shield(future), max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise TimeoutError("no reply in time") from None


class _Route:
    __slots__ = ("conn", "sub", "items", "ready", "bound", "hard", "ended", "dead")

    def __init__(self, conn: "_Conn", bound: int) -> None:
        self.conn = conn
        self.sub: Optional[int] = None
        self.items: Deque[Any] = deque()
        self.ready = asyncio.Event()
        self.bound = bound
        self.hard = bound * HARD_BOUND_FACTOR
        self.ended = False
        self.dead = False

    def push(self, item: Any) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self, deadline: Optional[float]) -> Any:
        items = self.items
        while not items:
            self.ready.clear()
            if deadline is None:
                await self.ready.wait()
            else:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    raise TimeoutError("no event in time")
                try:
                    await asyncio.wait_for(self.ready.wait(), remaining)
                except asyncio.TimeoutError:
                    raise TimeoutError("no event in time") from None
        item = items.popleft()
        conn = self.conn
        if conn.reader_waiting:
            conn.room.set()
        return item


class _Conn:
    def __init__(self, client: "Client", reader: asyncio.StreamReader, writer: asyncio.StreamWriter, serial: int) -> None:
        self.path = client.socket
        self.reader = reader
        self.writer = writer
        self.serial = serial
        self.pending: Deque[_Request] = deque()
        self.routes: Dict[int, _Route] = {}
        self.closed = False
        self.reason: Optional[ObsdError] = None
        self.closed_event = asyncio.Event()
        self.room = asyncio.Event()
        self.reader_waiting = False
        self.next_id = 0
        self.hello: JSONObject = {}
        self.max_line = 1 << 20
        self.sync_supported: Optional[bool] = None
        self.close_callbacks: List[Callable[[], None]] = []
        self.outgoing: List[bytes] = []
        self.outgoing_bytes = 0
        self.flush_scheduled = False
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self._run())

    def send(self, message: JSONObject, kind: int = PLAIN, route: Optional[_Route] = None, arg: Any = None) -> _Request:
        body = _wire.encode(message)
        if len(body) - 1 > self.max_line:
            raise TooLarge(
                f"the {message.get('op')} request is {len(body) - 1} bytes long; the daemon reads lines of at most {self.max_line}"
            )
        if self.closed:
            raise _NotSent()
        self.next_id += 1
        request = _Request(message["op"], kind, route, arg, self.loop.create_future())
        request.rid = self.next_id
        self.pending.append(request)
        if self.reader_waiting:
            self.room.set()
        # Requests made in one turn of the event loop go out in one write (pipelining).
        line = b'{"id":%d,' % self.next_id + body[1:]
        self.outgoing.append(line)
        self.outgoing_bytes += len(line)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)
        return request

    def flush(self) -> None:
        """Writes the requests made since the last flush."""
        self.flush_scheduled = False
        if not self.outgoing or self.closed_event.is_set():
            self.outgoing.clear()
            self.outgoing_bytes = 0
            return
        data = b"".join(self.outgoing) if len(self.outgoing) > 1 else self.outgoing[0]
        self.outgoing.clear()
        self.outgoing_bytes = 0
        try:
            self.writer.write(data)
        except (OSError, RuntimeError) as error:
            self.fail(ConnectionError(f"the connection to obsd at {self.path} broke while sending: {error}"))

    def send_quietly(self, message: JSONObject, kind: int = PLAIN, arg: Any = None) -> None:
        try:
            self.send(message, kind, None, arg)
        except (_NotSent, ObsdError):
            pass

    async def drain(self) -> None:
        """Waits while the socket's send buffer is large (the daemon reads slower than we write)."""
        if self.outgoing_bytes > _DRAIN_ABOVE:
            self.flush()
        transport = self.writer.transport
        if transport.get_write_buffer_size() > _DRAIN_ABOVE:
            try:
                await self.writer.drain()
            except (OSError, RuntimeError) as error:
                self.fail(ConnectionError(f"the connection to obsd at {self.path} broke while sending: {error}"))

    def on_close(self, callback: Callable[[], None]) -> None:
        if self.closed_event.is_set():
            callback()
        else:
            self.close_callbacks.append(callback)

    async def _run(self) -> None:
        reason: Optional[ObsdError] = None
        parts: List[bytes] = []
        read = self.reader.read
        loads = _wire.loads
        try:
            while True:
                data = await read(262144)
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
                        if "event" in message:
                            waiting = self._event(message)
                            if waiting is not None:
                                await self._deliver_when_room(waiting, message)
                        else:
                            self._reply(message)
                if start < len(data):
                    parts.append(data[start:])
        except _Done:
            pass
        except _Refused as refused:
            reason = refused.error
        except (OSError, EOFError) as error:
            reason = ConnectionError(f"the connection to obsd at {self.path} broke: {error}")
        except (ProtocolViolation, KeyError, TypeError) as error:
            reason = ConnectionError(f"obsd at {self.path} sent what the protocol does not allow ({error}); the connection was dropped")
        except asyncio.CancelledError:
            reason = ConnectionError("the client is closed")
        except BaseException as error:
            reason = ConnectionError(f"the reader of the connection to {self.path} failed: {error!r}")
            log.exception("obsd: reader failed")
        finally:
            self.fail(reason or ConnectionError(f"obsd at {self.path} closed the connection"))

    def _event(self, message: JSONObject) -> Optional[_Route]:
        """Routes an event; the route if it must wait for room first."""
        kind = message["event"]
        if kind == "overflow":
            revs = message.get("revs")
            if not isinstance(revs, dict):
                revs = {}
            self.closed = True
            self.reason = ConnectionError(f"obsd at {self.path} cut the connection off: its events were read too slowly (overflow)")
            for number, live in self.routes.items():
                live.dead = True
                live.push(_Control("overflow", revs.get(str(number))))
            self.routes.clear()
            raise _Done()
        sub = message.get("sub")
        route = self.routes.get(sub)  # type: ignore[arg-type]
        if route is None or route.ended:
            return None
        if len(route.items) >= route.bound:
            return route
        route.push(message)
        if kind == "revoked":
            del self.routes[sub]  # type: ignore[arg-type]
            route.dead = True
        return None

    async def _deliver_when_room(self, route: _Route, message: JSONObject) -> None:
        items = route.items
        while len(items) >= route.bound and not self.pending and not self.closed and not route.ended:
            self.room.clear()
            self.reader_waiting = True
            try:
                await self.room.wait()
            finally:
                self.reader_waiting = False
        if route.ended or self.closed or self.routes.get(route.sub) is not route:  # type: ignore[arg-type]
            return
        if len(items) >= route.hard:
            del self.routes[route.sub]  # type: ignore[arg-type]
            route.dead = True
            route.push(_CUT)
            return
        route.push(message)
        if message.get("event") == "revoked":
            del self.routes[route.sub]  # type: ignore[arg-type]
            route.dead = True

    def _reply(self, message: JSONObject) -> None:
        ok = message.get("ok")
        if ok is not True and message.get("id") is None:
            error = message.get("error")
            if isinstance(error, dict) and error.get("code") == "overloaded":
                raise _Refused(error_from_reply(error))
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
                    route.push(_Control("sync", message.get("rev"), request))  # type: ignore[arg-type]
            _resolve(request.future, message, None)
        else:
            _resolve(request.future, None, error_from_reply(message.get("error")))

    def fail(self, reason: ObsdError) -> None:
        if self.closed_event.is_set():
            return
        self.closed = True
        if self.reason is None:
            self.reason = reason
        lost = _Lost(self.reason)
        pending = list(self.pending)
        self.pending.clear()
        for route in self.routes.values():
            route.dead = True
            route.push(_LOST)
        self.routes.clear()
        self.room.set()
        for request in pending:
            _resolve(request.future, None, lost)
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass
        self.closed_event.set()
        callbacks, self.close_callbacks = self.close_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # pragma: no cover
                log.exception("obsd: a connection-close callback failed")
        current = asyncio.current_task() if self.loop.is_running() else None
        if current is not self.task and not self.task.done():
            self.task.cancel()


class Client:
    """An asyncio connection to obsd that comes back (see ``obsd.aio.connect``).

    The same methods as ``obsd.Client``, as coroutines; ``watch()`` returns an async iterator
    (subscribed at once when connected — ``await`` it to see a refusal early), ``mirror()``
    is awaited, ``hold()`` is an async context manager, ``grant()`` a lease kept alive by a
    task. Use ``async with`` or ``await close()``.
    """

    def __init__(self, socket: Optional[str], reconnect_timeout: float, queue_size: int) -> None:
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
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._closing = asyncio.Event()
        self._failures = 0
        self._serial = 0
        self._owned: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._loop = asyncio.get_running_loop()

    # MARK: connecting

    def _now(self) -> float:
        return self._loop.time()

    def _deadline(self) -> float:
        return self._now() + self.reconnect_timeout

    async def _attempt(self, deadline: Optional[float]) -> _Conn:
        reader, writer = await asyncio.open_unix_connection(self.socket, limit=1 << 20)
        self._serial += 1
        conn = _Conn(self, reader, writer, self._serial)
        try:
            request = conn.send({"op": "hello", "protocol": 1, "client": _wire.CLIENT_NAME})
        except _NotSent:
            raise _Lost(conn.reason or ConnectionError(f"obsd at {self.socket} closed the connection at once")) from None
        hello_deadline = self._now() + 30.0
        if deadline is not None:
            hello_deadline = min(hello_deadline, max(deadline, self._now() + 1.0))
        try:
            reply = await _wait(request.future, hello_deadline)
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

    async def _first_connection(self) -> None:
        deadline = self._deadline()
        while True:
            try:
                self._conn = await self._attempt(deadline)
                return
            except OSError as error:
                raise ConnectionError(f"cannot connect to obsd at {self.socket}: {_explain(error)}") from None
            except _Lost as lost:
                last: ObsdError = lost.reason
            delay = self._backoff.delay(self._failures)
            self._failures += 1
            if self._now() + delay > deadline:
                raise ConnectionError(f"obsd at {self.socket} refused the connection ({last.message}); gave up after {self.reconnect_timeout:g} s")
            await asyncio.sleep(delay)

    async def _connection(self, deadline: Optional[float]) -> _Conn:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise ConnectionError("the client is closed")
        try:
            if deadline is None:
                await self._connect_lock.acquire()
            else:
                await asyncio.wait_for(self._connect_lock.acquire(), max(deadline - self._now(), 0.0))
        except asyncio.TimeoutError:
            raise ConnectionError(f"obsd at {self.socket} did not come back within {self.reconnect_timeout:g} s") from None
        try:
            last: Optional[str] = None
            while True:
                conn = self._conn
                if conn is not None and not conn.closed:
                    return conn
                if self._closed:
                    raise ConnectionError("the client is closed")
                try:
                    conn = await self._attempt(deadline)
                    self._conn = conn
                    self._failures = 0
                    return conn
                except OSError as error:
                    last = _explain(error)
                except _Lost as lost:
                    last = lost.reason.message
                delay = self._backoff.delay(self._failures)
                self._failures += 1
                if deadline is not None and self._now() + delay > deadline:
                    raise ConnectionError(f"obsd at {self.socket} did not come back within {self.reconnect_timeout:g} s ({last})")
                try:
                    await asyncio.wait_for(self._closing.wait(), delay)
                    raise ConnectionError("the client is closed")
                except asyncio.TimeoutError:
                    pass
        finally:
            self._connect_lock.release()

    async def _call(self, message: JSONObject, *, write: bool = False) -> JSONObject:
        deadline = self._deadline()
        while True:
            conn = self._conn
            if conn is None or conn.closed:
                conn = await self._connection(deadline)
            try:
                request = conn.send(message)
            except _NotSent:
                continue
            await conn.drain()
            try:
                return await request.future
            except _Lost as lost:
                if write:
                    raise ConnectionError(
                        f"the connection to obsd was lost before the reply to {message['op']} "
                        f"({lost.reason.message}): its outcome is unknown — it may or may not have been applied"
                    ) from None
                if self._now() > deadline:
                    raise ConnectionError(f"the connection to obsd was lost ({lost.reason.message})") from None

    # MARK: the API

    @property
    def server(self) -> str:
        """The daemon's name and version, as its ``hello`` said."""
        conn = self._conn
        return str(conn.hello.get("server", "")) if conn is not None else ""

    async def ping(self) -> None:
        """Checks that the daemon answers."""
        await self._call({"op": "ping"})

    async def set(
        self, repo: str, key: str, value: Any, *, if_revision: Optional[int] = None, force: bool = False, lease: Any = None
    ) -> WriteResult:
        """Sets ``key`` of ``repo`` to ``value``; as ``obsd.Client.set``."""
        return _wire.write_result(await self._call(_wire.set_request(repo, key, value, if_revision, force, lease), write=True))

    async def get(self, repo: str, key: str) -> Entry:
        """The value of ``key``, its revision and lease; ``obsd.NotFound`` if absent."""
        return _wire.entry(await self._call({"op": "get", "repo": _wire.check_repo(repo), "key": _wire.check_key(key)}))

    async def delete(self, repo: str, key: str, *, if_revision: Optional[int] = None) -> WriteResult:
        """Deletes ``key``; as ``obsd.Client.delete``."""
        return _wire.write_result(await self._call(_wire.delete_request(repo, key, if_revision), write=True))

    async def batch(self, repo: str, ops: Sequence[Union[Set, Delete]]) -> WriteResult:
        """Applies ``obsd.Set``s and ``obsd.Delete``s atomically, as one revision."""
        reply = await self._call(_wire.batch_request(repo, ops), write=True)
        return WriteResult(_wire.write_result(reply).rev, bool(reply.get("changed")), ABSENT)

    async def keys(self, repo: str, prefix: Optional[str] = None) -> List[str]:
        """The keys of ``repo`` (those starting with ``prefix``), sorted by their UTF-8 bytes."""
        return list((await self._call(_wire.list_request(repo, prefix, False)))["keys"])

    async def items(self, repo: str, prefix: Optional[str] = None) -> Dict[str, Any]:
        """The keys of ``repo`` (those starting with ``prefix``) and their values, in key order."""
        reply = await self._call(_wire.list_request(repo, prefix, True))
        values = reply.get("values") or {}
        return {k: values[k] for k in reply["keys"]}

    async def repos(self) -> List[Dict[str, Any]]:
        """The repositories that exist (that this user may read)."""
        return list((await self._call({"op": "repos"}))["repos"])

    async def stats(self) -> Dict[str, Any]:
        """The daemon's counters."""
        reply = dict(await self._call({"op": "stats"}))
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
        """Watches the selected keys of ``repo``: an async iterator of ``obsd.Event`` (see ``obsd.Client.watch``).

        The subscribe request is sent at once when the client is connected, so a write made
        after this call is not missed; ``await`` the watch to wait for the daemon's answer.
        """
        return Watch(self, repo, keys, prefix, since, epoch, coalesce, writers)

    async def mirror(self, repo: str, *, prefix: Optional[str] = None) -> "Mirror":
        """A live read-only mapping of the selected keys of ``repo`` (see ``obsd.Mirror``), once loaded."""
        mirror = Mirror(self, repo, prefix)
        await mirror._start()
        return mirror

    def hold(self, repo: str, key: str, value: Any) -> "Hold":
        """An async context manager that holds ``key`` at ``value`` while its block runs; ``as`` binds the ``Lease``."""
        return Hold(self, repo, key, value)

    async def grant(self, ttl: Optional[float] = None) -> "Lease":
        """Grants a lease (see ``obsd.Client.grant``); one with a TTL is kept alive by a task."""
        if ttl is None:
            deadline = self._deadline()
            while True:
                conn = await self._connection(deadline)
                try:
                    reply = await conn.send({"op": "grant"}).future
                except (_NotSent, _Lost):
                    continue
                lease = Lease(self, _wire._int(reply, "lease"), None, conn)
                break
        else:
            seconds = _wire.check_ttl(ttl)
            reply = await self._call({"op": "grant", "ttl": seconds}, write=True)
            lease = Lease(self, _wire._int(reply, "lease"), seconds, None)
        self._owned[id(lease)] = lease
        return lease

    async def keepalive(self, lease: Any) -> Optional[int]:
        """Starts the TTL of ``lease`` again in full; its TTL, or ``None`` for a connection-bound lease."""
        ttl = (await self._call({"op": "keepalive", "lease": _wire.check_lease(lease)})).get("ttl")
        return ttl if isinstance(ttl, int) else None

    async def revoke(self, lease: Any) -> Dict[str, int]:
        """Ends ``lease`` now: its keys are deleted. The revisions that deleted them, by repository."""
        reply = await self._call({"op": "revoke", "lease": _wire.check_lease(lease)}, write=True)
        return dict(reply.get("revs") or {})

    async def close(self) -> None:
        """Closes the connection; watches end, mirrors stop, holds and leases stop being kept."""
        self._closed = True
        self._closing.set()
        owned = list(self._owned.values())
        self._owned.clear()
        for thing in owned:
            thing._client_closed()
        conn = self._conn
        if conn is not None:
            conn.fail(ConnectionError("the client is closed"))
            try:
                await asyncio.wait_for(asyncio.shield(conn.task), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass
            try:
                await conn.writer.wait_closed()
            except (OSError, RuntimeError, asyncio.CancelledError):
                pass

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<obsd.aio.Client socket={self.socket!r}{' closed' if self._closed else ''}>"


class _Connecting:
    """What ``connect()`` returns: await it for the client, or use it with ``async with``."""

    def __init__(self, socket: Optional[str], reconnect_timeout: float, queue_size: int) -> None:
        self._args = (socket, reconnect_timeout, queue_size)
        self._client: Optional[Client] = None

    async def _connect(self) -> Client:
        client = Client(*self._args)
        await client._first_connection()
        return client

    def __await__(self) -> Generator[Any, None, Client]:
        return self._connect().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._connect()
        return self._client

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._client is not None:
            await self._client.close()


def connect(socket: Optional[str] = None, *, reconnect_timeout: float = 30.0, queue_size: int = DEFAULT_QUEUE_SIZE) -> _Connecting:
    """Connects to obsd: ``c = await obsd.aio.connect()`` or ``async with obsd.aio.connect() as c``.

    The socket is found as for ``obsd.connect`` (the argument, ``$OBSD_SOCKET``,
    ``$XDG_RUNTIME_DIR/obsd.sock``, ``/run/obsd/obsd.sock``), the environment read now.
    """
    return _Connecting(socket, reconnect_timeout, queue_size)


# MARK: subscriptions that resume


class _Follower:
    def __init__(self, client: Client, cursor: Cursor) -> None:
        self.client = client
        self.cursor = cursor
        self.route: Optional[_Route] = None
        self.generation = 0
        self.closed = False
        self.stop = asyncio.Event()
        self.failures = 0
        self.changed = asyncio.Event()  # set at each new route

    def start_now(self) -> Optional[_Request]:
        """Sends the first subscribe request now if connected (no await); the request."""
        conn = self.client._conn
        if conn is None or conn.closed:
            return None
        message, mode = self.cursor.request()
        route = _Route(conn, self.client.queue_size)
        try:
            request = conn.send(message, SUBSCRIBE, route)
        except _NotSent:
            return None
        request.arg = mode
        return request

    async def _finish(self, conn: _Conn, request: _Request) -> None:
        mode = request.arg
        try:
            reply = await request.future
        except Compacted:
            message, mode = self.cursor.fallback()
            request = conn.send(message, SUBSCRIBE, _Route(conn, self.client.queue_size))
            reply = await request.future
        self.cursor.subscribed(reply, mode)
        assert request.route is not None
        self.route = request.route
        self.generation += 1
        self.changed.set()
        if self.closed:
            self._end_route()

    async def _subscribe(self, conn: _Conn) -> None:
        message, mode = self.cursor.request()
        request = conn.send(message, SUBSCRIBE, _Route(conn, self.client.queue_size))
        request.arg = mode
        await self._finish(conn, request)

    async def open(self, first: Optional[_Request]) -> None:
        if first is not None:
            assert first.route is not None
            try:
                await self._finish(first.route.conn, first)
                return
            except (_NotSent, _Lost):
                pass
        deadline = self.client._deadline()
        while True:
            conn = await self.client._connection(deadline)
            try:
                await self._subscribe(conn)
                return
            except (_NotSent, _Lost):
                if self.client._now() > deadline:
                    raise ConnectionError(f"obsd at {self.client.socket} did not come back within {self.client.reconnect_timeout:g} s") from None

    async def resume(self, deadline: Optional[float]) -> None:
        while True:
            if self.closed or self.client._closed:
                raise _Closed()
            try:
                conn = await self.client._connection(deadline)
            except ConnectionError:
                if self.closed or self.client._closed:
                    raise _Closed() from None
                raise TimeoutError("the daemon did not come back in time") from None
            try:
                await self._subscribe(conn)
                self.failures = 0
                return
            except (_NotSent, _Lost):
                continue
            except Overloaded:
                delay = self.client._backoff.delay(self.failures)
                self.failures += 1
                if deadline is not None and self.client._now() + delay > deadline:
                    raise TimeoutError("the daemon did not take the subscription in time") from None
                try:
                    await asyncio.wait_for(self.stop.wait(), delay)
                    raise _Closed()
                except asyncio.TimeoutError:
                    pass

    async def next_item(self, deadline: Optional[float]) -> Any:
        while True:
            route = self.route
            if route is None:
                await self.resume(deadline)
                continue
            items = route.items
            if items:
                item = items.popleft()
                if route.conn.reader_waiting:
                    route.conn.room.set()
            else:
                item = await route.get(deadline)
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
        route.ended = True
        route.push(_ENDED)
        if route.conn.reader_waiting:
            route.conn.room.set()
        if route.sub is not None and not route.dead:
            route.conn.send_quietly({"op": "unsubscribe", "sub": route.sub}, UNSUBSCRIBE, route.sub)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        self._end_route()


class Watch(AsyncIterator[Event]):
    """The events of one watch (see ``Client.watch``): ``async for event in watch``.

    ``await watch`` waits for the daemon to accept the subscription (raising its refusal).
    ``next_event(timeout)`` waits at most ``timeout`` seconds (``TimeoutError``). It ends only
    when closed (``close()``, ``async with``, the client closing).
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
        self._client = client
        self._follower = _Follower(client, cursor)
        self._first = self._follower.start_now()
        self._opened = False
        client._owned[id(self)] = self

    async def _open(self) -> None:
        if not self._opened:
            first, self._first = self._first, None
            await self._follower.open(first)
            self._opened = True

    def __await__(self) -> Generator[Any, None, "Watch"]:
        async def opened() -> "Watch":
            await self._open()
            return self

        return opened().__await__()

    @property
    def rev(self) -> Optional[int]:
        """Every selected change through this revision has been handed on."""
        return self._follower.cursor.position

    @property
    def epoch(self) -> Optional[str]:
        """The history ``rev`` belongs to."""
        return self._follower.cursor.epoch

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> Event:
        try:
            return await self._next(None)
        except _Closed:
            raise StopAsyncIteration from None

    async def next_event(self, timeout: Optional[float] = None) -> Event:
        """The next event; ``TimeoutError`` if none comes within ``timeout`` seconds, ``obsd.ConnectionError`` once closed."""
        try:
            return await self._next(None if timeout is None else self._client._now() + timeout)
        except _Closed:
            raise ConnectionError("the watch is closed") from None

    async def _next(self, deadline: Optional[float]) -> Event:
        if not self._opened:
            if self._follower.closed:
                raise _Closed()
            await self._open()
        follower = self._follower
        cursor = follower.cursor
        while True:
            item = await follower.next_item(deadline)
            if type(item) is dict:
                event = cursor.event(item)
                if event is not None:
                    return event
            else:
                cursor.synced_to(item.rev)

    def close(self) -> None:
        """Ends the watch (unsubscribes); iteration stops."""
        self._follower.close()

    async def aclose(self) -> None:
        """Ends the watch (as ``close()``)."""
        self.close()

    def _client_closed(self) -> None:
        self._follower.closed = True
        self._follower.stop.set()

    def __del__(self) -> None:
        # Dropped without close(): its events are dropped from now on, so that its full queue
        # never holds the connection's reader up.
        follower = getattr(self, "_follower", None)
        if follower is not None and not follower.closed:
            follower.closed = True
            route = follower.route
            if route is not None:
                route.ended = True
                if route.conn.reader_waiting:
                    route.conn.room.set()

    async def __aenter__(self) -> "Watch":
        await self._open()
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()


class Mirror(Mapping[str, Any]):
    """A live read-only copy of the selected keys of one repository, kept current by a task (see ``obsd.Mirror``).

    Reads are plain (``m["k"]``, ``len(m)``, iteration); ``rev``, ``await sync()``,
    ``on_change(callback)`` (called in the mirror's task), ``close()``.
    """

    def __init__(self, client: Client, repo: str, prefix: Optional[str]) -> None:
        _wire.check_repo(repo)
        select = _wire.selection(None, prefix)
        self.repo = repo
        """The repository mirrored."""
        self.prefix = prefix
        """The prefix of the keys mirrored (``None``: every key)."""
        self._client = client
        self._data: Dict[str, Any] = {}
        self._rev = 0
        self._loaded = asyncio.Event()
        self._progress = asyncio.Event()  # set whenever rev moves or a sync mark is applied
        self._failure: Optional[BaseException] = None
        self._callbacks: List[Callable[[List[str]], Any]] = []
        self._follower = _Follower(client, Cursor(repo, select, coalesce=True, initial=True))
        self._first = self._follower.start_now()
        self._task: Optional["asyncio.Task[None]"] = None

    async def _start(self) -> None:
        first, self._first = self._first, None
        await self._follower.open(first)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._client._owned[id(self)] = self
        try:
            await asyncio.wait_for(self._wait_loaded(), self._client.reconnect_timeout)
        except asyncio.TimeoutError:
            self.close()
            raise ConnectionError(f"the mirror of {self.repo} did not load within {self._client.reconnect_timeout:g} s") from None
        if self._failure is not None:
            self.close()
            raise self._failure

    async def _wait_loaded(self) -> None:
        while not self._loaded.is_set() and self._failure is None and not self._follower.closed:
            self._progress.clear()
            await self._progress.wait()

    def _moved(self) -> None:
        self._progress.set()

    async def _run(self) -> None:
        follower = self._follower
        cursor = follower.cursor
        try:
            while True:
                item = await follower.next_item(None)
                if type(item) is not dict:
                    cursor.synced_to(item.rev)
                    if cursor.position is not None:
                        self._rev = max(self._rev, cursor.position)
                    item.request.applied = True
                    self._moved()
                    continue
                event = cursor.event(item)
                changed: List[str] = []
                if event is not None:
                    self._data, changed = apply_event(self._data, event)
                    if event.kind == "reset":
                        self._loaded.set()
                if cursor.position is not None and self._loaded.is_set():
                    self._rev = cursor.position
                self._moved()
                for callback in list(self._callbacks) if changed else []:
                    try:
                        result = callback(changed)
                        if asyncio.iscoroutine(result):
                            await result
                    except Exception:
                        log.exception("obsd: a mirror's on_change callback failed")
        except _Closed:
            pass
        except asyncio.CancelledError:
            pass
        except BaseException as error:
            self._failure = error
            if not isinstance(error, ObsdError):
                log.exception("obsd: the mirror of %s stopped", self.repo)
        finally:
            self._moved()

    # MARK: Mapping

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._data))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if it does not exist."""
        return self._data.get(key, default)

    def snapshot(self) -> Dict[str, Any]:
        """A copy of the mirrored keys and values, consistent at ``rev``."""
        return dict(self._data)

    def keys(self) -> KeysView[str]:
        """The keys, as a copy."""
        return self.snapshot().keys()

    def items(self) -> ItemsView[str, Any]:
        """The keys and values, as a copy."""
        return self.snapshot().items()

    def values(self) -> ValuesView[Any]:
        """The values, as a copy."""
        return self.snapshot().values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mirror):
            return self is other
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<obsd.aio.Mirror {self.repo!r} rev={self._rev} keys={len(self._data)}>"

    @property
    def rev(self) -> int:
        """The revision the mirror is known to be current to."""
        return self._rev

    @property
    def epoch(self) -> Optional[str]:
        """The history ``rev`` belongs to."""
        return self._follower.cursor.epoch

    def on_change(self, callback: Callable[[List[str]], Any]) -> Callable[[], None]:
        """Calls ``callback(keys)`` (a function or a coroutine function) with the keys that changed; returns a function that stops it."""
        if not callable(callback):
            raise BadRequest("on_change takes a callable")
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._follower.closed:
            raise ConnectionError("the mirror is closed")

    async def _wait(self, deadline: Optional[float]) -> None:
        """Waits until the mirror moves (or a second passes)."""
        self._progress.clear()
        timeout = 1.0
        if deadline is not None:
            remaining = deadline - self._client._now()
            if remaining <= 0:
                raise TimeoutError("the mirror did not catch up in time")
            timeout = min(timeout, remaining)
        try:
            await asyncio.wait_for(self._progress.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def sync(self, timeout: Optional[float] = None) -> int:
        """Waits until the mirror shows every write acknowledged before the call; returns ``rev`` (see ``obsd.Mirror.sync``)."""
        deadline = None if timeout is None else self._client._now() + timeout
        route: Optional[_Route] = None
        while True:
            self._check()
            current = self._follower.route
            if current is None or current.dead or current is route:
                await self._wait(deadline)
                continue
            route = current
            conn = route.conn
            if conn.sync_supported is False:
                result = await self._sync_by_revision(route, deadline)
                if result is not None:
                    return result
                continue
            try:
                request = conn.send({"op": "sync", "sub": route.sub}, SYNC, route)
                reply = await _wait(request.future, deadline)
            except UnknownOp:
                conn.sync_supported = False
                route = None
                continue
            except (_NotSent, _Lost, NotFound):
                continue
            conn.sync_supported = True
            while not request.applied:
                self._check()
                if self._follower.route is not route:
                    break
                await self._wait(deadline)
            if request.applied:
                return max(self._rev, int(reply.get("rev", 0)))

    async def _sync_by_revision(self, route: _Route, deadline: Optional[float]) -> Optional[int]:
        conn = route.conn
        probe = _Route(conn, 1)
        probe.ended = True
        try:
            reply = await _wait(conn.send({"op": "subscribe", "repo": self.repo, "keys": []}, SUBSCRIBE, probe).future, deadline)
        except (_NotSent, _Lost):
            return None
        conn.send_quietly({"op": "unsubscribe", "sub": reply["sub"]}, UNSUBSCRIBE, reply["sub"])
        target, epoch = int(reply["rev"]), reply.get("epoch")
        while True:
            self._check()
            if self._follower.route is not route:
                return None
            if self._rev >= target and self._follower.cursor.epoch == epoch:
                return self._rev
            await self._wait(deadline)

    def close(self) -> None:
        """Stops following the daemon; the contents stay as they are."""
        self._follower.close()
        self._moved()

    def _client_closed(self) -> None:
        self._follower.closed = True
        self._follower.stop.set()
        self._moved()

    async def __aenter__(self) -> "Mirror":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()


class Lease:
    """A lease (see ``obsd.Lease``); one with a TTL is kept alive by a task. ``async with lease`` revokes it at the end."""

    def __init__(self, client: Client, ident: int, ttl: Optional[int], conn: Optional[_Conn], hold: Optional["Hold"] = None) -> None:
        self._client = client
        self._id = ident
        self.ttl: Optional[int] = ttl
        """The TTL it was granted with (seconds); ``None`` for a lease bound to its connection."""
        self._conn = conn
        self._hold = hold
        self._ended = False
        self._task: Optional["asyncio.Task[None]"] = None
        if conn is not None and hold is None:
            conn.on_close(self._end)
        if ttl is not None:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    def _end(self) -> None:
        self._ended = True

    @property
    def id(self) -> int:
        """The lease's id: pass it (or the ``Lease``) as ``lease=`` to ``set``."""
        return self._id

    @property
    def ended(self) -> bool:
        """Whether the lease is known to have ended."""
        return self._ended

    async def _keep(self) -> None:
        assert self.ttl is not None
        interval = self.ttl / 3.0
        while True:
            await asyncio.sleep(interval)
            try:
                await self._client.keepalive(self._id)
            except (NotFound, Forbidden):
                self._ended = True
                return
            except ObsdError as error:
                if self._client._closed:
                    return
                log.warning("obsd: keepalive of lease %d failed (%s); trying again", self._id, error)

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def keepalive(self) -> Optional[int]:
        """Starts the TTL again in full now."""
        try:
            return await self._client.keepalive(self._id)
        except (NotFound, Forbidden):
            self._ended = True
            raise

    async def revoke(self) -> Dict[str, int]:
        """Ends the lease now; its keys are deleted. The revisions that deleted them, by repository ({} if it had ended)."""
        self._stop()
        if self._hold is not None:
            return await self._hold.release()
        if self._ended:
            return {}
        try:
            if self._conn is not None:
                try:
                    reply = await self._conn.send({"op": "revoke", "lease": self._id}).future
                except (_NotSent, _Lost):
                    return {}
                revs: Dict[str, int] = dict(reply.get("revs") or {})
            else:
                revs = await self._client.revoke(self._id)
        except NotFound:
            revs = {}
        self._ended = True
        return revs

    def _client_closed(self) -> None:
        self._stop()

    async def __aenter__(self) -> "Lease":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if not self._ended and not self._client._closed:
            try:
                await self.revoke()
            except ConnectionError:
                pass

    def __repr__(self) -> str:
        return f"<obsd.aio.Lease {self._id}{' ttl=%d' % self.ttl if self.ttl else ''}{' ended' if self._ended else ''}>"


class Hold:
    """Holds a key at a value while an ``async with`` block runs (see ``obsd.Client.hold``); ``as`` binds the ``Lease``."""

    def __init__(self, client: Client, repo: str, key: str, value: Any) -> None:
        _wire.set_request(repo, key, value, None, False, None)
        self._client = client
        self.repo = repo
        """The repository of the key held."""
        self.key = key
        """The key held."""
        self.value = value
        """The value it is held at."""
        self._wake = asyncio.Event()
        self._released = False
        self._conn: Optional[_Conn] = None
        self._lease: Optional[Lease] = None
        self._task: Optional["asyncio.Task[None]"] = None
        self.failure: Optional[BaseException] = None
        """Why the hold stopped writing the key again after a reconnection (``None`` while it holds)."""

    @property
    def lease(self) -> Optional[Lease]:
        """The lease the key is attached to (``None`` before ``acquire``)."""
        return self._lease

    @property
    def held(self) -> bool:
        """Whether the key is written now."""
        return self._conn is not None and not self._conn.closed and not self._released

    async def _establish(self, conn: _Conn) -> int:
        reply = await conn.send({"op": "grant"}).future
        ident = _wire._int(reply, "lease")
        try:
            await conn.send(_wire.set_request(self.repo, self.key, self.value, None, False, ident)).future
        except ObsdError:
            conn.send_quietly({"op": "revoke", "lease": ident})
            raise
        return ident

    async def acquire(self) -> Lease:
        """Writes the key on a new connection-bound lease and keeps it written; the lease."""
        if self._lease is not None:
            raise BadRequest("this hold was already acquired")
        deadline = self._client._deadline()
        while True:
            conn = await self._client._connection(deadline)
            try:
                ident = await self._establish(conn)
                break
            except (_NotSent, _Lost):
                if self._client._now() > deadline:
                    raise ConnectionError(f"obsd at {self._client.socket} did not keep a connection long enough to hold {self.key!r}") from None
        self._lease = Lease(self._client, ident, None, None, hold=self)
        self._conn = conn
        conn.on_close(self._wake.set)
        self._task = asyncio.get_running_loop().create_task(self._keep())
        self._client._owned[id(self)] = self
        return self._lease

    async def _keep(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            if self._released:
                return
            conn = self._conn
            if conn is not None and not conn.closed:
                self._wake.clear()
                continue
            try:
                conn = await self._client._connection(None)
                ident = await self._establish(conn)
            except (_NotSent, _Lost):
                continue
            except ConnectionError:
                return
            except ObsdError as error:
                self.failure = error
                delay = self._client._backoff.delay(failures)
                failures += 1
                await asyncio.sleep(delay)
                continue
            failures = 0
            self.failure = None
            if self._released:
                conn.send_quietly({"op": "revoke", "lease": ident})
                return
            self._conn = conn
            assert self._lease is not None
            self._lease._id = ident
            self._wake.clear()
            conn.on_close(self._wake.set)

    async def release(self) -> Dict[str, int]:
        """Revokes the lease, which deletes the key; the revisions that deleted it, by repository."""
        if self._released:
            return {}
        self._released = True
        self._wake.set()
        conn, lease = self._conn, self._lease
        if lease is not None:
            lease._ended = True
        if conn is None or conn.closed or lease is None:
            return {}
        try:
            reply = await conn.send({"op": "revoke", "lease": lease.id}).future
        except (_NotSent, _Lost, NotFound):
            return {}
        return dict(reply.get("revs") or {})

    def _client_closed(self) -> None:
        self._released = True
        self._wake.set()

    async def __aenter__(self) -> Lease:
        return await self.acquire()

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            await self.release()
        except ConnectionError:
            pass
