"""obsd.aio against the real daemon and, for what it cannot send, the scripted fake daemon."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Awaitable, Dict, List, TypeVar

import pytest

import obsd
import obsd.aio
from support import WAIT, Daemon, FakeServer
from test_fake import change

T = TypeVar("T")


def run(coroutine: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, 300)

    return asyncio.run(bounded())


async def in_thread(function: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def test_calls(daemon: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(daemon.socket) as c:
            assert c.server.startswith("obsd/")
            await c.ping()
            assert await c.set("r", "k", 1.0) == obsd.WriteResult(1, True, obsd.ABSENT)
            assert await c.set("r", "k", 2**62) == obsd.WriteResult(2, True, 1.0)
            entry = await c.get("r", "k")
            assert entry == obsd.Entry(2**62, 2, None) and type(entry.value) is int
            assert (await c.delete("r", "k")).old == 2**62
            with pytest.raises(obsd.NotFound):
                await c.get("r", "k")
            with pytest.raises(obsd.Conflict):
                await c.set("r", "k", 1, if_revision=5)
            assert (await c.batch("r", [obsd.Set("a", None), obsd.Set("b", [1]), obsd.Delete("c")])).rev == 4
            assert await c.keys("r") == ["a", "b"] and await c.items("r", prefix="b") == {"b": [1]}
            assert [r["name"] for r in await c.repos()] == ["r"]
            assert (await c.stats())["connections"] >= 1
            with pytest.raises(obsd.BadRequest):
                await c.set("no spaces", "k", 1)
        assert c.closed
        c2 = await obsd.aio.connect(daemon.socket)
        await c2.ping()
        await c2.close()
        with pytest.raises(obsd.ConnectionError):
            await c2.ping()
        with pytest.raises(obsd.ConnectionError):
            await obsd.aio.connect("/tmp/obsd-py-no-such-dir/obsd.sock")

    run(main())


def test_pipelined_writes_and_a_watch(daemon: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(daemon.socket) as c:
            w = c.watch("p", keys=["n"])  # sent at once: the writes below are after it
            results = await asyncio.gather(*(c.set("p", "n", i) for i in range(1, 501)))
            assert [r.rev for r in results] == list(range(1, 501))
            seen = []
            async for event in w:
                seen.append(event.changes[0].new)
                if len(seen) == 500:
                    break
            assert seen == list(range(1, 501))
            assert w.rev == 500 and w.epoch
            await w.aclose()

    run(main())


def test_watch_refusal_is_raised_when_awaited(daemon: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(daemon.socket) as c:
            w = c.watch("r", since=10**6, epoch="not-this-history")  # resets rather than failing
            await w
            c2 = c.watch("r", keys=[])
            async with c2:
                with pytest.raises(TimeoutError):
                    await c2.next_event(0.2)
            event = await w.next_event(WAIT)
            assert event.kind == "reset" and event.changes == []

    run(main())


def test_watch_across_a_restart(durable: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(durable.socket) as watcher, obsd.aio.connect(durable.socket) as writer:
            w = await watcher.watch("r")
            for i in range(1, 21):
                await writer.set("r", "n", i)
            await in_thread(durable.restart)
            for i in range(21, 41):
                await writer.set("r", "n", i)
            seen = []
            while len(seen) < 40:
                event = await w.next_event(WAIT)
                assert event.kind == "change"
                seen.append(event.changes[0].new)
            assert seen == list(range(1, 41))

    run(main())


def test_slow_consumer_overflow() -> None:
    d = Daemon(in_memory=True, args=["--queue-bytes", "65536", "--queue-events", "64"]).start()

    async def main() -> None:
        async with obsd.aio.connect(d.socket, queue_size=16) as watcher, obsd.aio.connect(d.socket) as writer:
            w = await watcher.watch("slow")
            padding = "x" * 400
            await asyncio.gather(*(writer.set("slow", "n", [i, padding]) for i in range(1, 2001)))
            while (await writer.stats()).get("overflows", 0) < 1:
                await asyncio.sleep(0.01)
            assert w._follower.route is not None and len(w._follower.route.items) <= 17
            values: List[int] = []
            while len(values) < 2000:
                event = await w.next_event(WAIT)
                values.extend(c.new[0] for c in event.changes)
            assert values == list(range(1, 2001))

    try:
        run(main())
    finally:
        d.cleanup()


def test_mirror_sync_and_on_change(daemon: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(daemon.socket) as c:
            await c.set("m", "a", 1)
            m = await c.mirror("m")
            assert dict(m) == {"a": 1} and m.rev == 1
            seen: List[List[str]] = []
            m.on_change(seen.append)

            async def also(keys: List[str]) -> None:
                seen.append(["async"] + keys)

            m.on_change(also)
            await c.set("m", "b", 2)
            assert await m.sync(WAIT) >= 2
            assert dict(m) == {"a": 1, "b": 2} and m["b"] == 2 and "a" in m and len(m) == 2
            assert seen == [["b"], ["async", "b"]]
            await in_thread(daemon.restart)
            await c.set("m", "c", 3)
            while dict(m) != {"c": 3}:
                await m.sync(WAIT)
            m.close()

    run(main())


def test_hold_and_leases(daemon: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(daemon.socket) as c:
            w = await c.watch("svc")
            async with c.hold("svc", "up", True) as lease:
                assert (await c.get("svc", "up")).lease == lease.id
                assert (await w.next_event(WAIT)).changes[0].new is True
            gone = await w.next_event(WAIT)
            assert gone.lease_end == (lease.id, "revoked")
            async with await c.grant(ttl=2) as ttl_lease:
                await c.set("svc", "t", 1, lease=ttl_lease)
                assert (await w.next_event(WAIT)).rev == 3
                with pytest.raises(TimeoutError):
                    await w.next_event(4.0)  # kept alive by its task past its TTL
                assert await ttl_lease.keepalive() == 2
            assert (await w.next_event(WAIT)).lease_end == (ttl_lease.id, "revoked")
            bound = await c.grant()
            await c.set("svc", "b", 1, lease=bound.id)
            assert await bound.revoke() == {"svc": 6}
            assert await c.revoke((await c.grant(ttl=5)).id) == {}

    run(main())


def test_resume_with_catchup_against_the_fake() -> None:
    fake = FakeServer()

    async def main() -> None:
        c = await obsd.aio.connect(fake.socket)
        conn = fake.next_connection()
        w = c.watch("ui", keys=["a", "b"])  # sent before any await
        request = await in_thread(conn.next_request, "subscribe")
        assert request["keys"] == ["a", "b"] and "since" not in request
        conn.reply(request, sub=1, rev=5, epoch="E1")
        await w
        conn.send({"event": "progress", "sub": 1, "repo": "ui", "rev": 9})
        conn.send(change(1, 10, "a", new=1))
        assert (await w.next_event(WAIT)).rev == 10
        conn.close()
        pending = asyncio.ensure_future(w.next_event(WAIT))
        conn2 = await in_thread(fake.next_connection)
        resume = await in_thread(conn2.next_request, "subscribe")
        assert (resume["since"], resume["epoch"], resume["catchup"]) == (10, "E1", True)
        conn2.reply(resume, sub=3, rev=20, epoch="E1", catchup="diff")
        conn2.send({"event": "catchup", "sub": 3, "repo": "ui", "from": 10, "rev": 20, "values": {"b": 2}, "deleted": ["a"]})
        event = await pending
        assert event.kind == "catchup" and event.changes == [
            obsd.Change("b", obsd.UNKNOWN, 2),
            obsd.Change("a", obsd.UNKNOWN, obsd.ABSENT),
        ]
        conn2.close()
        pending = asyncio.ensure_future(w.next_event(WAIT))  # a watch resumes when it is read
        conn3 = await in_thread(fake.next_connection)
        resume = await in_thread(conn3.next_request, "subscribe")
        assert resume["since"] == 20
        conn3.error(resume, "compacted")
        fallback = await in_thread(conn3.next_request, "subscribe")
        assert fallback["initial"] is True
        conn3.reply(fallback, sub=1, rev=1, epoch="E2")
        conn3.send({"event": "snapshot", "sub": 1, "repo": "ui", "rev": 1, "values": {}})
        event = await pending
        assert event.kind == "reset" and event.changes == [] and w.epoch == "E2"
        await c.close()

    try:
        run(main())
    finally:
        fake.close()


def test_cut_off_sync_and_unknown_outcome_against_the_fake() -> None:
    fake = FakeServer()

    async def main() -> None:
        c = await obsd.aio.connect(fake.socket, queue_size=2)
        conn = fake.next_connection()
        w = c.watch("ui")
        conn.reply(await in_thread(conn.next_request, "subscribe"), sub=1, rev=0, epoch="E1")
        await w
        call = asyncio.ensure_future(c.get("ui", "k"))
        get = await in_thread(conn.next_request, "get")
        conn.send(*[change(1, rev, "k", new=rev) for rev in range(1, 101)])
        conn.reply(get, value="v", rev=9)
        assert await call == obsd.Entry("v", 9, None)
        assert [(await w.next_event(WAIT)).rev for _ in range(64)] == list(range(1, 65))
        pending = asyncio.ensure_future(w.next_event(WAIT))
        unsubscribe = await in_thread(conn.next_request, "unsubscribe")
        assert unsubscribe["sub"] == 1
        conn.reply(unsubscribe)
        resume = await in_thread(conn.next_request, "subscribe")
        assert resume["since"] == 64
        conn.reply(resume, sub=2, rev=100, epoch="E1", catchup="replay")
        conn.send(change(2, 65, "k", 64, 65))
        assert (await pending).rev == 65

        mirror_task = asyncio.ensure_future(c.mirror("ui"))
        request = await in_thread(conn.next_request, "subscribe")
        conn.reply(request, sub=3, rev=100, epoch="E1")
        conn.send({"event": "snapshot", "sub": 3, "repo": "ui", "rev": 100, "values": {"k": 100}})
        m = await mirror_task
        sync = asyncio.ensure_future(m.sync(WAIT))
        request = await in_thread(conn.next_request, "sync")
        assert request["sub"] == 3
        conn.send({"event": "change", "sub": 3, "repo": "ui", "rev": 101, "from": 101, "changes": [{"key": "k", "old": 100, "new": 101}]})
        conn.reply(request, rev=101)
        assert await sync == 101 and m["k"] == 101

        write = asyncio.ensure_future(c.set("ui", "k", 1))
        await in_thread(conn.next_request, "set")
        fake.refuse = 2  # the next two connection attempts (the mirror's or the read's) are refused
        conn.close()
        with pytest.raises(obsd.ConnectionError) as raised:
            await write
        assert "outcome is unknown" in raised.value.message
        read = asyncio.ensure_future(c.get("ui", "k"))
        conn2 = await in_thread(fake.next_connection)
        assert fake.refused == 2
        while True:  # the watch and the mirror resubscribe on the new connection too
            request = await in_thread(conn2.next_request)
            if request["op"] == "get":
                conn2.reply(request, value=1, rev=102)
                break
            conn2.reply(request, sub=9, rev=102, epoch="E1")
        assert (await read).value == 1
        await c.close()

    try:
        run(main())
    finally:
        fake.close()


def test_environment_socket(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OBSD_SOCKET", daemon.socket)

    async def main() -> Dict[str, Any]:
        async with obsd.aio.connect() as c:
            assert c.socket == daemon.socket
            return await c.stats()

    assert run(main())["connections"] >= 1
    assert os.environ["OBSD_SOCKET"] == daemon.socket


def test_a_dropped_watch_does_not_hold_the_connection_up(daemon: Daemon) -> None:
    import gc

    async def main() -> None:
        async with obsd.aio.connect(daemon.socket, queue_size=4) as c, obsd.aio.connect(daemon.socket) as writer:
            dropped = await c.watch("d")
            kept = await c.watch("d")
            del dropped
            gc.collect()
            await asyncio.gather(*(writer.set("d", "n", i) for i in range(100)))
            assert [(await kept.next_event(WAIT)).changes[0].new for _ in range(100)] == list(range(100))

    run(main())


def test_hold_is_written_again_after_a_restart(durable: Daemon) -> None:
    async def main() -> None:
        async with obsd.aio.connect(durable.socket) as c:
            async with c.hold("svc", "up", "yes") as lease:
                first = lease.id
                await in_thread(durable.restart)
                async with obsd.aio.connect(durable.socket) as other:
                    while True:
                        try:
                            entry = await other.get("svc", "up")
                            if entry.lease == lease.id != first:
                                break
                        except obsd.NotFound:
                            pass
                        await asyncio.sleep(0.01)
                    assert entry.value == "yes"
            async with obsd.aio.connect(durable.socket) as other:
                assert await other.keys("svc") == []

    run(main())
