"""Watches against the real daemon: events, selections, resuming across restarts, kill -9, slow consumers."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List

import pytest

import obsd
from support import WAIT, Daemon, wait_until


def apply(state: Dict[str, Any], event: obsd.Event) -> None:
    """What an application does with an event."""
    if event.kind == "reset":
        state.clear()
    for change in event.changes:
        if change.new is obsd.ABSENT:
            state.pop(change.key, None)
        else:
            state[change.key] = change.new


def test_change_events(client: obsd.Client) -> None:
    w = client.watch("ui")
    client.set("ui", "theme", "light")
    client.set("ui", "theme", "dark")
    client.set("ui", "theme", "dark")  # changes nothing: no event
    client.delete("ui", "theme")
    client.set("ui", "n", None)
    events = [w.next_event(WAIT) for _ in range(4)]
    assert [e.kind for e in events] == ["change"] * 4
    assert [e.rev for e in events] == [1, 2, 3, 4]
    assert [e.changes for e in events] == [
        [obsd.Change("theme", obsd.ABSENT, "light")],
        [obsd.Change("theme", "light", "dark")],
        [obsd.Change("theme", "dark", obsd.ABSENT)],
        [obsd.Change("n", obsd.ABSENT, None)],
    ]
    assert all(e.repo == "ui" and e.epoch and e.lease_end is None and e.writer is None for e in events)
    assert w.rev == 4 and w.epoch == events[0].epoch
    w.close()
    assert list(w) == []  # a closed watch ends


def test_watch_subscribes_when_called(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as watcher, obsd.connect(daemon.socket) as writer:
        w = watcher.watch("r", keys=["k"])
        writer.set("r", "k", "written right after watch() returned")
        assert w.next_event(WAIT).changes == [obsd.Change("k", obsd.ABSENT, "written right after watch() returned")]


def test_selection_and_empty_events(client: obsd.Client) -> None:
    by_key = client.watch("s", keys=["a", "c"])
    by_prefix = client.watch("s", prefix="p/")
    client.batch("s", [obsd.Set("a", 1), obsd.Set("b", 2), obsd.Set("p/1", 3)])
    client.set("s", "b", 3)  # selected by neither: no event for them
    client.set("s", "c", 4)
    assert by_key.next_event(WAIT).changes == [obsd.Change("a", obsd.ABSENT, 1)]
    event = by_key.next_event(WAIT)
    assert event.rev == 3 and event.changes == [obsd.Change("c", obsd.ABSENT, 4)]
    assert by_prefix.next_event(WAIT).changes == [obsd.Change("p/1", obsd.ABSENT, 3)]
    with pytest.raises(TimeoutError):
        by_prefix.next_event(0.2)


def test_writers_and_lease_end(client: obsd.Client) -> None:
    w = client.watch("svc", writers=True)
    lease = client.grant()
    client.set("svc", "web/ready", True, lease=lease)
    created = w.next_event(WAIT)
    assert created.writer == (os.getuid(), os.getgid(), os.getpid())
    lease.revoke()
    ended = w.next_event(WAIT)
    assert ended.changes == [obsd.Change("web/ready", True, obsd.ABSENT)]
    assert ended.lease_end == (lease.id, "revoked")
    assert lease.ended


def test_since_replays_within_one_history(client: obsd.Client) -> None:
    for i in range(1, 6):
        client.set("h", "n", i)
    epoch = client.watch("h").epoch
    w = client.watch("h", since=2, epoch=epoch)
    assert [(e.kind, e.rev, e.changes[0].new) for e in (w.next_event(WAIT) for _ in range(3))] == [
        ("change", 3, 3),
        ("change", 4, 4),
        ("change", 5, 5),
    ]
    client.set("h", "n", 6)
    assert w.next_event(WAIT).rev == 6


def test_since_from_another_history_is_a_reset(client: obsd.Client) -> None:
    client.set("h", "a", 1)
    client.set("h", "b", 2)
    w = client.watch("h", since=1, epoch="0123456789abcdef0123456789abcdef")
    event = w.next_event(WAIT)
    assert event.kind == "reset" and event.rev == 2
    assert sorted(event.changes) == [obsd.Change("a", obsd.UNKNOWN, 1), obsd.Change("b", obsd.UNKNOWN, 2)]
    assert w.epoch == event.epoch != "0123456789abcdef0123456789abcdef"


def test_since_past_the_history_is_a_catchup_or_reset() -> None:
    """A history too short to replay: today's daemon answers compacted (the client resets), one with catch-up a diff."""
    d = Daemon(in_memory=True, args=["--history-limit", "5"]).start()
    try:
        with obsd.connect(d.socket) as c:
            c.set("h", "stays", 0)
            c.set("h", "goes", 0)
            epoch = c.watch("h").epoch
            for i in range(20):
                c.set("h", "n", i)
            c.delete("h", "goes")
            w = c.watch("h", since=2, epoch=epoch)
            event = w.next_event(WAIT)
            assert event.kind in ("reset", "catchup")
            state = {"stays": 0, "goes": 0}
            apply(state, event)
            assert state == c.items("h") == {"stays": 0, "n": 19}
            assert all(change.old is obsd.UNKNOWN for change in event.changes)
            c.set("h", "n", 20)
            assert w.next_event(WAIT).changes == [obsd.Change("n", 19, 20)]
    finally:
        d.cleanup()


def _collect(w: obsd.Watch, until: int, into: List[obsd.Event], done: threading.Event) -> None:
    try:
        while True:
            event = w.next_event(WAIT * 2)
            into.append(event)
            if any(c.key == "n" and c.new == until for c in event.changes):
                return
    finally:
        done.set()


def test_watch_across_a_restart_with_persistence(durable: Daemon) -> None:
    with obsd.connect(durable.socket) as watcher, obsd.connect(durable.socket) as writer:
        w = watcher.watch("r", keys=["n"])
        events: List[obsd.Event] = []
        done = threading.Event()
        thread = threading.Thread(target=_collect, args=(w, 100, events, done))
        thread.start()
        for i in range(1, 51):
            writer.set("r", "n", i)
        durable.restart()
        for i in range(51, 101):
            writer.set("r", "n", i)  # the first call reconnects first
        assert done.wait(WAIT * 3)
        thread.join()
        assert [e.kind for e in events] == ["change"] * 100, [e.kind for e in events]
        assert [e.changes[0].new for e in events] == list(range(1, 101))  # none missed, none repeated
        assert [e.rev for e in events] == list(range(1, 101))
        assert len({e.epoch for e in events}) == 1  # one history across the restart


def test_watch_across_kill_9(durable: Daemon) -> None:
    with obsd.connect(durable.socket) as watcher, obsd.connect(durable.socket) as writer:
        w = watcher.watch("r")
        for i in range(1, 31):
            writer.set("r", "n", i)
        durable.kill()
        durable.start()
        for i in range(31, 61):
            writer.set("r", "n", i)
        events: List[obsd.Event] = []
        done = threading.Event()
        _collect(w, 60, events, done)
        assert [e.kind for e in events] == ["change"] * 60
        assert [e.changes[0].new for e in events] == list(range(1, 61))


def test_watch_across_a_restart_without_persistence(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as watcher, obsd.connect(daemon.socket) as writer:
        w = watcher.watch("r")
        writer.set("r", "old", 1)
        writer.set("r", "n", 0)
        first = w.next_event(WAIT)
        assert w.next_event(WAIT).rev == 2
        daemon.restart()  # in memory: a new history
        writer.set("r", "new", 1)
        writer.set("r", "n", 1)
        state = {"old": 1, "n": 0}
        kinds = []
        while state != {"new": 1, "n": 1}:
            event = w.next_event(WAIT)
            kinds.append(event.kind)
            apply(state, event)
        assert kinds[0] == "reset", kinds  # the old history's keys are dropped
        assert event.epoch != first.epoch


def test_slow_consumer_overflow_resumes_with_nothing_missed() -> None:
    d = Daemon(in_memory=True, args=["--queue-bytes", "65536", "--queue-events", "64"]).start()
    try:
        with obsd.connect(d.socket, queue_size=16) as watcher, obsd.connect(d.socket) as writer:
            w = watcher.watch("slow")
            padding = "x" * 400
            for i in range(1, 3001):
                writer.set("slow", "n", [i, padding])
            wait_until(lambda: writer.stats().get("overflows", 0) >= 1, "the daemon to cut the slow reader off")
            route = w._follower.route
            assert route is not None and len(route.items) <= 16 + 1  # bounded: the reader stopped reading
            values = []
            while len(values) < 3000:
                event = w.next_event(WAIT)
                assert event.kind == "change"
                values.extend(c.new[0] for c in event.changes)
            assert values == list(range(1, 3001))
    finally:
        d.cleanup()


def test_slow_coalescing_consumer_gets_the_state() -> None:
    d = Daemon(in_memory=True, args=["--queue-bytes", "65536", "--queue-events", "64"]).start()
    try:
        with obsd.connect(d.socket, queue_size=16) as watcher, obsd.connect(d.socket) as writer:
            w = watcher.watch("slow", coalesce=True)
            padding = "x" * 400
            for i in range(1, 3001):
                writer.set("slow", "n", [i, padding])
            values, coalesced = [], 0
            while not values or values[-1] != 3000:
                event = w.next_event(WAIT)
                coalesced += event.from_rev is not None
                values.extend(c.new[0] for c in event.changes)
            assert values == sorted(values) and len(values) < 3000 and coalesced >= 1
            assert writer.stats().get("overflows", 0) == 0
    finally:
        d.cleanup()


def test_watch_iterator_ends_when_the_client_closes(daemon: Daemon) -> None:
    c = obsd.connect(daemon.socket)
    w = c.watch("r")
    result: List[Any] = []
    thread = threading.Thread(target=lambda: result.append(list(w)))
    thread.start()
    c.set("r", "k", 1)
    wait_until(lambda: w.rev == 1, "the watch to see the write")
    c.close()
    thread.join(WAIT)
    assert not thread.is_alive() and len(result[0]) == 1


def test_a_dropped_watch_does_not_hold_the_connection_up(daemon: Daemon) -> None:
    import gc

    with obsd.connect(daemon.socket, queue_size=4) as c:
        dropped = c.watch("d")
        kept = c.watch("d")
        del dropped
        gc.collect()
        with obsd.connect(daemon.socket) as writer:
            for i in range(100):
                writer.set("d", "n", i)
        assert [kept.next_event(WAIT).changes[0].new for _ in range(100)] == list(range(100))
