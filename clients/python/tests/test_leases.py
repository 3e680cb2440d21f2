"""Holds and leases against the real daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import obsd
from support import WAIT, Daemon, wait_until


def test_hold_exists_while_the_block_runs(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as c, obsd.connect(daemon.socket) as other:
        w = other.watch("svc", keys=["indexer/up"])
        hold = c.hold("svc", "indexer/up", {"pid": os.getpid()})
        with hold as lease:
            assert isinstance(lease, obsd.Lease) and hold.held
            entry = other.get("svc", "indexer/up")
            assert entry.value == {"pid": os.getpid()} and entry.lease == lease.id
            assert w.next_event(WAIT).changes[0].new == {"pid": os.getpid()}
        assert not hold.held
        gone = w.next_event(WAIT)
        assert gone.changes == [obsd.Change("indexer/up", {"pid": os.getpid()}, obsd.ABSENT)]
        assert gone.lease_end == (lease.id, "revoked")
        with pytest.raises(obsd.NotFound):
            other.get("svc", "indexer/up")


def test_hold_is_written_again_after_the_daemon_restarts(durable: Daemon) -> None:
    with obsd.connect(durable.socket) as c:
        with c.hold("svc", "up", True) as lease:
            first = lease.id
            durable.restart()  # the connection-bound lease ends with its connection
            with obsd.connect(durable.socket) as other:
                def rewritten() -> "obsd.Entry | None":
                    entry = _get(other, "svc", "up")
                    return entry if entry is not None and entry.lease == lease.id else None

                entry = wait_until(rewritten, "the hold to write its key again on its new lease")
                assert entry.value is True and lease.id != first
        with obsd.connect(durable.socket) as other:
            assert _get(other, "svc", "up") is None


def _get(c: obsd.Client, repo: str, key: str) -> "obsd.Entry | None":
    try:
        return c.get(repo, key)
    except obsd.NotFound:
        return None


HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import obsd
    c = obsd.connect(sys.argv[2])
    with c.hold("svc", "worker", "busy"):
        print("held", flush=True)
        time.sleep(3600)
    """
)


def test_a_killed_holder_loses_its_key(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as c:
        w = c.watch("svc", keys=["worker"])
        src = os.path.join(os.path.dirname(obsd.__file__), "..")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, src, daemon.socket], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert w.next_event(WAIT).changes[0].new == "busy"
            holder.send_signal(signal.SIGKILL)
            holder.wait(WAIT)
            event = w.next_event(WAIT)
            assert event.changes == [obsd.Change("worker", "busy", obsd.ABSENT)] and event.lease_end is not None
            assert event.lease_end[1] == "closed"
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()


def test_connection_bound_lease_ends_with_the_client(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as observer:
        w = observer.watch("l")
        c = obsd.connect(daemon.socket)
        lease = c.grant()
        assert lease.ttl is None and not lease.ended
        c.set("l", "k", 1, lease=lease)
        assert w.next_event(WAIT).rev == 1
        c.close()
        event = w.next_event(WAIT)
        assert event.lease_end == (lease.id, "closed")
        wait_until(lambda: lease.ended, "the lease to know it ended")
        assert lease.revoke() == {}


def test_ttl_lease_is_kept_alive_then_revoked(client: obsd.Client) -> None:
    w = client.watch("l")
    with client.grant(ttl=2) as lease:
        assert lease.ttl == 2 and lease.id >= 1
        client.set("l", "k", "alive", lease=lease.id)
        assert w.next_event(WAIT).rev == 1
        # kept alive every 2/3 s: nothing expires for well over the TTL
        with pytest.raises(TimeoutError):
            w.next_event(5.0)
        assert lease.keepalive() == 2
        assert client.keepalive(lease) == 2
    event = w.next_event(WAIT)
    assert event.lease_end == (lease.id, "revoked") and lease.ended
    with pytest.raises(obsd.NotFound):
        client.keepalive(lease.id)


def test_ttl_lease_expires_without_keepalive(client: obsd.Client) -> None:
    w = client.watch("l")
    lease = client.grant(ttl=1)
    lease._stop.set()  # stop its keepalive, as a process that hangs would
    client.set("l", "k", 1, lease=lease)
    assert w.next_event(WAIT).rev == 1
    event = w.next_event(WAIT)
    assert event.lease_end == (lease.id, "expired")
    with pytest.raises(obsd.NotFound):
        lease.keepalive()
    assert lease.ended and lease.revoke() == {}


def test_revoke_returns_the_deletions(client: obsd.Client) -> None:
    lease = client.grant(ttl=60)
    client.set("a", "k", 1, lease=lease)
    client.set("b", "k", 1, lease=lease)
    revs = lease.revoke()
    assert revs == {"a": 2, "b": 2}
    assert client.keys("a") == [] and client.keys("b") == []
    other = client.grant(ttl=60)
    assert client.revoke(other.id) == {}
