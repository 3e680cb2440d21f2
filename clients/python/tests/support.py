"""Test support: the real daemon in a temporary directory, a scripted fake daemon, deadlines."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[3]

# Generous: a debug daemon on a busy 2-core machine.
WAIT = 60.0


def obsd_binary() -> str:
    """$OBSD_BIN, else the worktree's debug build. A missing binary fails the tests (never skips them)."""
    path = os.environ.get("OBSD_BIN") or str(REPO_ROOT / ".build" / "debug" / "obsd")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no obsd binary at {path}: build it (swift build --product obsd) or set OBSD_BIN")
    return path


def obsctl_binary() -> str:
    """The obsctl beside the obsd binary."""
    return str(Path(obsd_binary()).with_name("obsctl"))


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT, interval: float = 0.01) -> Any:
    """Polls ``condition`` until it returns something true; fails naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def raw_request(path: str, message: Dict[str, Any], timeout: float = 10.0) -> Dict[str, Any]:
    """One request on a fresh raw connection; its reply (independent of the client under test)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps(message) + "\n").encode())
        data = b""
        while True:
            for line in data.split(b"\n")[:-1]:
                reply = json.loads(line)
                if "event" not in reply:
                    return reply  # type: ignore[no-any-return]
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            data += chunk


class Daemon:
    """One obsd process with its socket and data directory in a temporary directory."""

    def __init__(self, *, in_memory: bool = False, args: Optional[List[str]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="obsd-py-", dir="/tmp")
        self.socket = os.path.join(self.dir, "obsd.sock")
        self.data = os.path.join(self.dir, "data")
        self.in_memory = in_memory
        self.args = list(args or [])
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.log_path = os.path.join(self.dir, "obsd.log")
        self.starts = 0

    def command(self) -> List[str]:
        command = [obsd_binary(), "--socket", self.socket, "--log-target", "stderr", "--log-level", "warning"]
        command += ["--in-memory"] if self.in_memory else ["--data-dir", self.data]
        return command + self.args

    def start(self) -> "Daemon":
        assert self.process is None or self.process.poll() is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("OBSD_")}
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        log.close()
        self.starts += 1
        self.wait_ready()
        return self

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self) -> None:
        """Polls until the daemon answers ``ping`` on its socket."""
        deadline = time.monotonic() + WAIT
        while True:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                raise AssertionError(f"obsd exited with {code} while starting:\n{self.log()}")
            try:
                if raw_request(self.socket, {"id": 0, "op": "ping"}, timeout=5.0).get("ok") is True:
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"obsd did not answer within {WAIT:g} s:\n{self.log()}")
            time.sleep(0.01)

    def stop(self) -> None:
        """SIGTERM; the daemon must exit 0."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(WAIT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError(f"obsd did not stop within {WAIT:g} s of SIGTERM:\n{self.log()}")
        assert code == 0, f"obsd exited with {code} after SIGTERM:\n{self.log()}"

    def kill(self) -> None:
        """SIGKILL (kill -9)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(WAIT)
        assert self.process.returncode == -signal.SIGKILL

    def restart(self) -> None:
        self.stop()
        self.start()

    def request(self, message: Dict[str, Any]) -> Dict[str, Any]:
        return raw_request(self.socket, message)

    def stats(self) -> Dict[str, Any]:
        return self.request({"id": 1, "op": "stats"})

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            shutil.rmtree(self.dir, ignore_errors=True)


# MARK: a scripted fake daemon


class FakeConnection:
    """One accepted connection of the fake daemon."""

    def __init__(self, server: "FakeServer", sock: socket.socket, index: int) -> None:
        self.server = server
        self.sock = sock
        self.index = index
        self.requests: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.closed = threading.Event()
        self._lock = threading.Lock()

    def send(self, *messages: Dict[str, Any]) -> None:
        data = b"".join((json.dumps(m, separators=(",", ":")) + "\n").encode() for m in messages)
        with self._lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def send_raw(self, data: bytes) -> None:
        with self._lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def reply(self, request: Dict[str, Any], **members: Any) -> None:
        self.send({"id": request.get("id"), "ok": True, **members})

    def error(self, request: Dict[str, Any], code: str, message: str = "scripted") -> None:
        self.send({"id": request.get("id"), "ok": False, "error": {"code": code, "message": message}})

    def next_request(self, op: Optional[str] = None, timeout: float = WAIT) -> Dict[str, Any]:
        """The next request (of ``op``, skipping others that the handler answered)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the client sent no {op or 'request'} within {timeout:g} s")
            try:
                request = self.requests.get(timeout=remaining)
            except queue.Empty:
                continue
            if op is None or request.get("op") == op:
                return request

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.closed.set()


class FakeServer:
    """A Unix socket server thread that speaks scripted lines.

    Every connection is answered ``hello`` (unless ``refuse`` says otherwise) and ``ping``;
    every other request is put in the connection's ``requests`` queue for the test to
    answer, unless ``handler(conn, request)`` returns True (it answered).
    """

    def __init__(self, handler: Optional[Callable[[FakeConnection, Dict[str, Any]], bool]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="obsd-fake-", dir="/tmp")
        self.socket = os.path.join(self.dir, "fake.sock")
        self.handler = handler
        self.refuse = 0  # refuse this many connections (an overloaded line, then close)
        self.close_at_once = 0  # accept and close this many without a word
        self.refused = 0
        self.connections: List[FakeConnection] = []
        self._new: "queue.Queue[FakeConnection]" = queue.Queue()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket)
        self._listener.listen(16)
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if self.close_at_once > 0:
                self.close_at_once -= 1
                self.refused += 1
                sock.close()
                continue
            if self.refuse > 0:
                self.refuse -= 1
                self.refused += 1
                sock.sendall(b'{"id":null,"ok":false,"error":{"code":"overloaded","message":"too many connections"}}\n')
                sock.shutdown(socket.SHUT_WR)
                threading.Thread(target=self._drain_and_close, args=(sock,), daemon=True).start()
                continue
            conn = FakeConnection(self, sock, len(self.connections))
            self.connections.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()
            self._new.put(conn)

    @staticmethod
    def _drain_and_close(sock: socket.socket) -> None:
        sock.settimeout(1.0)
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass
        sock.close()

    def _read(self, conn: FakeConnection) -> None:
        buffer = b""
        try:
            while True:
                chunk = conn.sock.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    request = json.loads(line)
                    op = request.get("op")
                    if op == "hello":
                        conn.reply(request, protocol=1, server="fake/1", maxLine=1 << 20)
                    elif op == "ping":
                        conn.reply(request)
                    elif self.handler is not None and self.handler(conn, request):
                        pass
                    else:
                        conn.requests.put(request)
        except OSError:
            pass
        finally:
            conn.closed.set()
            try:
                conn.sock.close()
            except OSError:
                pass

    def next_connection(self, timeout: float = WAIT) -> FakeConnection:
        try:
            return self._new.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the client did not connect within {timeout:g} s") from None

    def close(self) -> None:
        self._stop = True
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in self.connections:
            conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)
