"""One client connection speaking the wire protocol raw (line-delimited JSON over a Unix
stream socket), and the recorder that writes every byte of it to the client's history.

History lines (one file per client process, text, one record a line):

    <t_ns> <conn> <kind> <data>

`t_ns` is CLOCK_MONOTONIC in nanoseconds (shared by every process of the run, the
orchestrator's fault log included); `conn` names the connection (`<client>.<n>`), unique in
the run. Kinds:

    O  connected             data: {"daemon": index, "socket": path}
    F  connect failed        data: errno name
    >  a request line sent   data: the line exactly as sent (without its newline)
    P  a partial line sent, then the connection cut (mid-line)   data: JSON string of the bytes
    H  our sending side shut down (half-close)
    <  a line received       data: the line exactly as received
    E  end of file from the daemon
    R  the connection broke  data: errno name
    X  we closed it          data: why
    M  a note of the client  data: JSON object (not a protocol message)

A request's reply is the next unanswered request's on its connection (replies come in request
order); the validators pair them again and check the `id`s.
"""

import errno as _errno
from collections import deque
import json
import os
import socket
import time

now_ns = time.monotonic_ns
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_decode = json.JSONDecoder().decode


class Recorder:
    """Appends history records to one file, buffered; `flush` writes them."""

    def __init__(self, path):
        self.file = open(path, "w", encoding="utf-8", buffering=1 << 20)
        self.lines = []

    def add(self, t, conn, kind, data=""):
        self.lines.append(f"{t} {conn} {kind} {data}\n")
        if len(self.lines) >= 4096:
            self.flush()

    def flush(self):
        if self.lines:
            self.file.write("".join(self.lines))
            self.lines.clear()

    def close(self):
        self.flush()
        self.file.close()


class Conn:
    """A connection: pipelined requests (each with a callback for its reply), events handed to
    `on_event`, everything recorded. Non-blocking; the owner's loop calls `on_readable` and
    `on_writable` when the selector says so."""

    __slots__ = ("name", "sock", "rec", "daemon", "pending", "out", "inbuf", "next_id", "alive",
                 "reading", "on_event", "on_close", "opened", "closed_at", "half_closed", "owner", "sent", "received")

    def __init__(self, name, rec, daemon, on_event, on_close):
        self.name = name
        self.rec = rec
        self.daemon = daemon
        self.sock = None
        self.pending = deque()  # FIFO of (id, request, callback)
        self.out = bytearray()
        self.inbuf = b""
        self.next_id = 1
        self.alive = False
        self.reading = True
        self.on_event = on_event
        self.on_close = on_close
        self.opened = 0
        self.closed_at = 0
        self.half_closed = False
        self.owner = None
        self.sent = 0
        self.received = 0

    def connect(self, path, daemon_index):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError as e:
            s.close()
            self.rec.add(now_ns(), self.name, "F", _errno.errorcode.get(e.errno, str(e.errno)))
            return False
        s.setblocking(False)
        self.sock = s
        self.alive = True
        self.opened = now_ns()
        self.rec.add(self.opened, self.name, "O", _encode({"daemon": daemon_index, "socket": path}))
        # Every connection says who it is first (the self-tests' proxy goes by it).
        self.request({"op": "hello", "client": self.name, "protocol": 1})
        return True

    # Requests

    def request(self, req, callback=None):
        """Queues `req` (an `id` is added) and returns the id; `callback(req, reply)` runs
        when its reply arrives, `callback(req, None)` if the connection ends first."""
        if not self.alive or self.half_closed:
            return None
        rid = self.next_id
        self.next_id += 1
        req["id"] = rid
        line = _encode(req)
        self.rec.add(now_ns(), self.name, ">", line)
        self.out += line.encode()
        self.out += b"\n"
        self.pending.append((rid, req, callback))
        self.sent += 1
        return rid

    def raw_line(self, line, callback=None, req=None):
        """Sends a line as is (a malformed one): its reply is the one with `id` null."""
        if not self.alive or self.half_closed:
            return
        self.rec.add(now_ns(), self.name, ">", line)
        self.out += line.encode()
        self.out += b"\n"
        self.pending.append((None, req, callback))
        self.sent += 1

    @property
    def in_flight(self):
        return len(self.pending)

    # I/O

    def on_writable(self):
        if not self.out or not self.alive:
            return
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return
        except OSError as e:
            self._broken(e)
            return
        del self.out[:n]

    def on_readable(self):
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except OSError as e:
            self._broken(e)
            return
        t = now_ns()
        if not data:
            self.rec.add(t, self.name, "E")
            self._ended()
            return
        buf = self.inbuf + data if self.inbuf else data
        lines = buf.split(b"\n")
        self.inbuf = lines.pop()
        rec = self.rec
        name = self.name
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            rec.add(t, name, "<", line)
            self.received += 1
            try:
                msg = _decode(line)
            except ValueError:
                continue
            if "event" in msg:
                self.on_event(self, msg, t)
            elif self.pending:
                rid, req, cb = self.pending.popleft()
                if cb is not None:
                    cb(req, msg)

    def _broken(self, e):
        self.rec.add(now_ns(), self.name, "R", _errno.errorcode.get(e.errno, str(e.errno)))
        self._ended()

    def _ended(self):
        if not self.alive:
            return
        self.alive = False
        self.closed_at = now_ns()
        try:
            self.sock.close()
        except OSError:
            pass
        pending, self.pending = self.pending, deque()
        for rid, req, cb in pending:
            if cb is not None:
                cb(req, None)
        if self.on_close:
            self.on_close(self)

    def close(self, why="done"):
        """Closes the connection (both directions)."""
        if not self.alive:
            return
        self.rec.add(now_ns(), self.name, "X", why)
        self._ended()

    def cut_mid_line(self, req):
        """Sends `req` but only part of its line (never its newline), then closes."""
        if not self.alive:
            return
        self.flush_blocking()
        line = _encode(req).encode()
        k = max(1, len(line) // 2)
        part = line[:k]
        try:
            self.sock.send(part)
        except OSError:
            pass
        self.rec.add(now_ns(), self.name, "P", _encode(part.decode("utf-8", "replace")))
        self.close("cut mid-line")

    def half_close(self):
        """Shuts the sending side down: the daemon answers what it got, then ends."""
        if not self.alive or self.half_closed:
            return
        self.flush_blocking()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.half_closed = True
        self.rec.add(now_ns(), self.name, "H")

    def flush_blocking(self, timeout=2.0):
        """Writes what is queued (up to `timeout`)."""
        end = time.monotonic() + timeout
        while self.out and self.alive and time.monotonic() < end:
            try:
                n = self.sock.send(self.out)
                del self.out[:n]
            except BlockingIOError:
                time.sleep(0.001)
            except OSError as e:
                self._broken(e)
                return

    def note(self, obj):
        self.rec.add(now_ns(), self.name, "M", _encode(obj))


def encode(obj):
    return _encode(obj)


def decode(text):
    return _decode(text)


def monotonic_s():
    return time.monotonic()


def pid():
    return os.getpid()
