"""The client's handling of what today's daemon cannot be made to send, against a scripted fake daemon.

Catch-up events and replies, ``sync``, ``overflow`` with its revisions, a local cut-off while a
call waits, writes whose outcome a lost connection left unknown, refused connections, every
error code, ``revoked``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List

import pytest

import obsd
from support import WAIT, FakeConnection, FakeServer, wait_until


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(4)
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)


def change(sub: int, rev: int, key: str, old: Any = None, new: Any = None, **extra: Any) -> Dict[str, Any]:
    item: Dict[str, Any] = {"key": key}
    if old is not None:
        item["old"] = old
    if new is not None:
        item["new"] = new
    return {"event": "change", "sub": sub, "repo": "ui", "rev": rev, "changes": [item], **extra}


def start_watch(fake: FakeServer, pool: ThreadPoolExecutor, **options: Any) -> "tuple[obsd.Client, FakeConnection, obsd.Watch, Dict[str, Any]]":
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    future = pool.submit(client.watch, "ui", **options)
    request = conn.next_request("subscribe")
    conn.reply(request, sub=1, rev=40, epoch="E1")
    return client, conn, future.result(WAIT), request


def test_resume_with_a_catchup_diff(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, first = start_watch(fake, pool, keys=["theme", "lang", "draft"])
    assert first["op"] == "subscribe" and first["keys"] == ["theme", "lang", "draft"] and first["progress"] is True
    assert "since" not in first and "catchup" not in first and "initial" not in first
    conn.send(change(1, 41, "theme", "light", "dark"))
    assert w.next_event(WAIT).changes == [obsd.Change("theme", "light", "dark")]
    conn.close()  # the daemon restarts
    pending = pool.submit(w.next_event, WAIT)
    conn2 = fake.next_connection()
    resume = conn2.next_request("subscribe")
    assert (resume["since"], resume["epoch"], resume["catchup"]) == (41, "E1", True)
    assert resume["keys"] == ["theme", "lang", "draft"] and "initial" not in resume
    conn2.reply(resume, sub=7, rev=97, epoch="E1", catchup="diff")
    conn2.send(
        {"event": "catchup", "sub": 7, "repo": "ui", "from": 41, "rev": 97, "values": {"lang": "fr", "theme": "dark"}, "deleted": ["draft"]},
        {"event": "synced", "sub": 7, "repo": "ui", "rev": 97},
        change(7, 98, "lang", "fr", "de"),
    )
    event = pending.result(WAIT)
    assert event.kind == "catchup" and event.rev == 97 and event.epoch == "E1"
    assert event.changes == [
        obsd.Change("lang", obsd.UNKNOWN, "fr"),
        obsd.Change("theme", obsd.UNKNOWN, "dark"),
        obsd.Change("draft", obsd.UNKNOWN, obsd.ABSENT),
    ]
    following = w.next_event(WAIT)
    assert following.kind == "change" and following.rev == 98 and following.changes == [obsd.Change("lang", "fr", "de")]
    client.close()


def test_resume_with_a_snapshot_is_a_reset_and_empty_catchups_are_not_yielded(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, _ = start_watch(fake, pool)
    conn.close()
    pending = pool.submit(w.next_event, WAIT)
    conn2 = fake.next_connection()
    resume = conn2.next_request("subscribe")
    assert resume["since"] == 40 and resume["epoch"] == "E1"
    conn2.reply(resume, sub=1, rev=50, epoch="E1", catchup="diff")
    conn2.send(  # nothing selected changed: no event is yielded, but the position moves
        {"event": "catchup", "sub": 1, "repo": "ui", "from": 40, "rev": 50, "values": {}, "deleted": []},
        {"event": "synced", "sub": 1, "repo": "ui", "rev": 50},
        {"event": "progress", "sub": 1, "repo": "ui", "rev": 55},
    )
    wait_until(lambda: w.rev == 55, "the position to follow the catch-up and progress")
    conn2.close()
    conn3 = fake.next_connection()
    resume = conn3.next_request("subscribe")
    assert resume["since"] == 55 and resume["epoch"] == "E1" and resume["catchup"] is True
    conn3.reply(resume, sub=1, rev=3, epoch="E2", catchup="snapshot")  # another history
    conn3.send({"event": "snapshot", "sub": 1, "repo": "ui", "rev": 3, "values": {"a": 1, "b": None}}, {"event": "synced", "sub": 1, "repo": "ui", "rev": 3})
    event = pending.result(WAIT)
    assert event.kind == "reset" and event.rev == 3 and event.epoch == "E2"
    assert event.changes == [obsd.Change("a", obsd.UNKNOWN, 1), obsd.Change("b", obsd.UNKNOWN, None)]
    assert (w.rev, w.epoch) == (3, "E2")
    client.close()


def test_compacted_falls_back_to_a_snapshot_and_keeps_the_old_position_until_it_arrives(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, _ = start_watch(fake, pool, prefix="p/")
    conn.close()
    pending = pool.submit(w.next_event, WAIT)
    conn2 = fake.next_connection()
    resume = conn2.next_request("subscribe")
    conn2.error(resume, "compacted", "since 40 is before the history")  # a daemon without catch-up
    fallback = conn2.next_request("subscribe")
    assert fallback["initial"] is True and fallback["prefix"] == "p/" and "since" not in fallback and "catchup" not in fallback
    conn2.reply(fallback, sub=2, rev=90, epoch="E1")
    conn2.close()  # lost before the snapshot: the position is still 40 of E1
    conn3 = fake.next_connection()
    resume = conn3.next_request("subscribe")
    assert (resume["since"], resume["epoch"]) == (40, "E1")
    conn3.error(resume, "compacted")
    fallback = conn3.next_request("subscribe")
    conn3.reply(fallback, sub=1, rev=91, epoch="E1")
    conn3.send({"event": "snapshot", "sub": 1, "repo": "ui", "rev": 91, "values": {"p/x": 1}})
    event = pending.result(WAIT)
    assert event.kind == "reset" and event.changes == [obsd.Change("p/x", obsd.UNKNOWN, 1)] and w.rev == 91
    client.close()


def test_overflow_resumes_from_its_revision(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, _ = start_watch(fake, pool)
    conn.send(change(1, 41, "k", new=1), {"event": "overflow", "revs": {"1": 57}})
    conn.close()
    assert w.next_event(WAIT).rev == 41
    pending = pool.submit(w.next_event, WAIT)
    conn2 = fake.next_connection()
    resume = conn2.next_request("subscribe")
    assert resume["since"] == 57 and resume["epoch"] == "E1" and resume["catchup"] is True
    conn2.reply(resume, sub=1, rev=60, epoch="E1", catchup="replay")
    conn2.send(change(1, 58, "k", 1, 2), {"event": "synced", "sub": 1, "repo": "ui", "rev": 60})
    assert pending.result(WAIT).rev == 58
    client.close()


def test_a_slow_watch_is_cut_off_while_a_call_waits_and_resumes(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client = obsd.connect(fake.socket, queue_size=2)  # cut off at 2 * 32 unconsumed events
    conn = fake.next_connection()
    future = pool.submit(client.watch, "ui")
    conn.reply(conn.next_request("subscribe"), sub=1, rev=0, epoch="E1")
    w = future.result(WAIT)
    call = pool.submit(client.get, "ui", "k")
    get = conn.next_request("get")
    conn.send(*[change(1, rev, "k", new=rev) for rev in range(1, 101)])
    conn.reply(get, value="v", rev=9)
    assert call.result(WAIT) == obsd.Entry("v", 9, None)  # the reader went on reading for the reply
    assert [w.next_event(WAIT).rev for _ in range(64)] == list(range(1, 65))
    pending = pool.submit(w.next_event, WAIT)
    unsubscribe = conn.next_request("unsubscribe")
    assert unsubscribe["sub"] == 1
    conn.reply(unsubscribe)
    resume = conn.next_request("subscribe")
    assert resume["since"] == 64 and resume["epoch"] == "E1"
    conn.reply(resume, sub=2, rev=100, epoch="E1", catchup="replay")
    conn.send(change(1, 65, "k", new="dropped: sub 1 is gone"), change(2, 65, "k", 64, 65))
    event = pending.result(WAIT)
    assert event.rev == 65 and event.changes == [obsd.Change("k", 64, 65)]
    client.close()


def test_write_outcome_unknown_and_reads_retried(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    write = pool.submit(client.set, "r", "k", 1)
    conn.next_request("set")
    conn.close()
    with pytest.raises(obsd.ConnectionError) as raised:
        write.result(WAIT)
    assert "outcome is unknown" in raised.value.message
    read = pool.submit(client.get, "r", "k")  # reconnects first
    conn2 = fake.next_connection()
    conn2.next_request("get")
    conn2.close()  # lost before the reply: a read is sent again
    conn3 = fake.next_connection()
    conn3.reply(conn3.next_request("get"), value=1, rev=1, lease=3)
    assert read.result(WAIT) == obsd.Entry(1, 1, 3)
    client.close()


def test_refused_and_closed_connections_are_retried_with_backoff(fake: FakeServer) -> None:
    fake.refuse = 3
    fake.close_at_once = 2
    client = obsd.connect(fake.socket)
    assert fake.refused == 5
    client.close()
    fake.refuse = 1000
    with pytest.raises(obsd.ConnectionError) as raised:
        obsd.connect(fake.socket, reconnect_timeout=0.5)
    assert "overloaded" in raised.value.message or "too many connections" in raised.value.message


def test_a_call_after_a_lost_connection_waits_for_refusals_to_end(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    fake.refuse = 2
    conn.close()
    call = pool.submit(client.ping)
    call.result(WAIT)
    assert fake.refused == 2 and len(fake.connections) == 2
    client.close()


@pytest.mark.parametrize(
    "code,cls",
    [
        ("bad_json", obsd.BadJSON),
        ("bad_request", obsd.BadRequest),
        ("unknown_op", obsd.UnknownOp),
        ("not_found", obsd.NotFound),
        ("conflict", obsd.Conflict),
        ("forbidden", obsd.Forbidden),
        ("too_large", obsd.TooLarge),
        ("compacted", obsd.Compacted),
        ("overloaded", obsd.Overloaded),
        ("internal", obsd.Internal),
        ("a_future_code", obsd.ObsdError),
    ],
)
def test_every_error_code(fake: FakeServer, pool: ThreadPoolExecutor, code: str, cls: type) -> None:
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    call = pool.submit(client.set, "r", "k", 1)
    conn.error(conn.next_request("set"), code, "scripted refusal")
    with pytest.raises(obsd.ObsdError) as raised:
        call.result(WAIT)
    assert type(raised.value) is cls and raised.value.code == code and raised.value.message == "scripted refusal"
    client.close()


def test_event_members(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, _ = start_watch(fake, pool, writers=True, coalesce=True)
    conn.send(
        {
            "event": "change",
            "sub": 1,
            "repo": "ui",
            "rev": 50,
            "from": 42,
            "by": {"uid": 1000, "gid": 100, "pid": 4242},
            "changes": [{"key": "a", "old": 1, "new": 2}, {"key": "b", "new": None}],
        },
        {"event": "change", "sub": 1, "repo": "ui", "rev": 51, "changes": [{"key": "a", "old": 2}], "lease": {"id": 7, "end": "expired"}},
        {"event": "change", "sub": 1, "repo": "ui", "rev": 52, "changes": []},
        {"event": "some_future_event", "sub": 1},
        change(1, 53, "c", new=1),
    )
    first = w.next_event(WAIT)
    assert first.from_rev == 42 and first.writer == (1000, 100, 4242)
    assert first.changes == [obsd.Change("a", 1, 2), obsd.Change("b", obsd.ABSENT, None)]
    second = w.next_event(WAIT)
    assert second.lease_end == (7, "expired") and second.changes == [obsd.Change("a", 2, obsd.ABSENT)]
    assert w.next_event(WAIT).rev == 53  # the empty change and the unknown event are not yielded
    client.close()


def test_revoked_subscription_raises_forbidden(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, w, _ = start_watch(fake, pool)
    conn.send({"event": "revoked", "sub": 1, "repo": "ui", "error": {"code": "forbidden", "message": "policy changed"}})
    with pytest.raises(obsd.Forbidden) as raised:
        w.next_event(WAIT)
    assert raised.value.message == "policy changed"
    client.close()


def start_mirror(fake: FakeServer, pool: ThreadPoolExecutor, values: Dict[str, Any]) -> "tuple[obsd.Client, FakeConnection, obsd.Mirror]":
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    future = pool.submit(client.mirror, "ui")
    request = conn.next_request("subscribe")
    assert request["initial"] is True and request["coalesce"] is True and request["progress"] is True
    conn.reply(request, sub=1, rev=10, epoch="E1")
    conn.send({"event": "snapshot", "sub": 1, "repo": "ui", "rev": 10, "values": values})
    return client, conn, future.result(WAIT)


def test_mirror_sync_waits_for_the_events_before_the_reply(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, m = start_mirror(fake, pool, {"a": 1})
    assert dict(m) == {"a": 1} and m.rev == 10
    sync = pool.submit(m.sync, WAIT)
    request = conn.next_request("sync")
    assert request["sub"] == 1
    conn.send(change(1, 11, "a", 1, 2), change(1, 12, "b", new=3))
    conn.reply(request, rev=15)
    assert sync.result(WAIT) == 15
    assert dict(m) == {"a": 2, "b": 3} and m.rev == 15
    client.close()


def test_mirror_applies_catchups_in_place_and_resets_as_replacement(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, m = start_mirror(fake, pool, {"a": 1, "b": 2, "c": 3})
    seen: List[List[str]] = []
    m.on_change(seen.append)
    conn.close()
    conn2 = fake.next_connection()
    resume = conn2.next_request("subscribe")
    assert (resume["since"], resume["epoch"], resume["catchup"]) == (10, "E1", True)
    conn2.reply(resume, sub=1, rev=20, epoch="E1", catchup="diff")
    conn2.send(
        {"event": "catchup", "sub": 1, "repo": "ui", "from": 10, "rev": 20, "values": {"b": 5, "c": 3, "d": 4}, "deleted": ["a"]},
        {"event": "synced", "sub": 1, "repo": "ui", "rev": 20},
    )
    wait_until(lambda: m.rev == 20, "the catch-up to be applied")
    assert dict(m) == {"b": 5, "c": 3, "d": 4}
    assert seen == [["b", "d", "a"]]  # c is listed but its value is the same
    conn2.close()
    conn3 = fake.next_connection()
    resume = conn3.next_request("subscribe")
    assert resume["since"] == 20
    conn3.reply(resume, sub=1, rev=2, epoch="E2", catchup="snapshot")
    conn3.send({"event": "snapshot", "sub": 1, "repo": "ui", "rev": 2, "values": {"d": 4, "z": 0}})
    wait_until(lambda: m.epoch == "E2", "the reset to be applied")
    assert dict(m) == {"d": 4, "z": 0} and m.rev == 2
    assert seen[-1] == ["b", "c", "z"]
    client.close()


def test_mirror_sync_without_the_sync_op_waits_for_the_revision(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client, conn, m = start_mirror(fake, pool, {})
    sync = pool.submit(m.sync, WAIT)
    conn.error(conn.next_request("sync"), "unknown_op", 'unknown op "sync"')
    probe = conn.next_request("subscribe")
    assert probe["keys"] == [] and probe["repo"] == "ui"
    conn.reply(probe, sub=2, rev=30, epoch="E1")
    unsubscribe = conn.next_request("unsubscribe")
    assert unsubscribe["sub"] == 2
    conn.reply(unsubscribe)
    conn.send({"event": "progress", "sub": 1, "repo": "ui", "rev": 25})
    wait_until(lambda: m.rev == 25, "progress to move the mirror")
    assert not sync.done()
    conn.send({"event": "progress", "sub": 1, "repo": "ui", "rev": 30})
    assert sync.result(WAIT) == 30
    client.close()


def test_daemon_sending_garbage_drops_the_connection(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    write = pool.submit(client.set, "r", "k", 1)
    conn.next_request("set")
    conn.send_raw(b"this is not json\n")
    with pytest.raises(obsd.ConnectionError) as raised:
        write.result(WAIT)
    assert "not allow" in raised.value.message and "outcome is unknown" in raised.value.message
    client.close()


def test_concurrent_holds_are_written_again_after_a_reconnection(fake: FakeServer, pool: ThreadPoolExecutor) -> None:
    leases = iter(range(1, 100))
    lock = threading.Lock()

    def handler(conn: FakeConnection, request: Dict[str, Any]) -> bool:
        with lock:
            if request["op"] == "grant":
                conn.reply(request, lease=next(leases))
                return True
            if request["op"] in ("set", "revoke"):
                conn.requests.put(request)
                conn.reply(request, rev=1, changed=True) if request["op"] == "set" else conn.reply(request, revs={"svc": 2})
                return True
        return False

    fake.handler = handler
    client = obsd.connect(fake.socket)
    conn = fake.next_connection()
    with client.hold("svc", "up", True) as lease:
        assert conn.next_request("set")["lease"] == lease.id == 1
        conn.close()
        conn2 = fake.next_connection()
        assert conn2.next_request("set")["lease"] == 2
        wait_until(lambda: lease.id == 2, "the hold to move to its new lease")
    assert conn2.next_request("revoke")["lease"] == 2
    client.close()
