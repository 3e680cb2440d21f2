"""Fixtures: a real obsd per test (in memory, or persisting), a fake daemon, a client of either."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

# The package from this checkout (an installed copy would shadow it otherwise).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import obsd  # noqa: E402
from support import Daemon, FakeServer  # noqa: E402


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """A test that hangs (a bug) ends the run with every thread's stack, rather than hanging CI."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """An in-memory obsd."""
    d = Daemon(in_memory=True).start()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def durable() -> Iterator[Daemon]:
    """An obsd that persists (sync = always)."""
    d = Daemon().start()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[obsd.Client]:
    c = obsd.connect(daemon.socket)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    try:
        yield server
    finally:
        server.close()


def pytest_report_header(config: pytest.Config) -> str:
    from support import obsd_binary

    try:
        return f"obsd binary: {obsd_binary()}"
    except RuntimeError as error:
        return str(error)


# Each test's daemon writes to its own temporary directory; nothing here reads the
# environment's OBSD_SOCKET, so a developer's running daemon is never touched.
os.environ.pop("OBSD_SOCKET", None)
