"""Mirrors against the real daemon: a burst from another process, sync, on_change, restarts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import List

import obsd
from support import WAIT, Daemon, wait_until

# Another process writes: a raw socket client (not the library), pipelining its requests.
WRITER = textwrap.dedent(
    """
    import json, socket, sys
    path, repo, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    lines = []
    for i in range(count):
        key = "k%03d" % (i % 500)
        if i % 7 == 3:
            lines.append(json.dumps({"id": i, "op": "delete", "repo": repo, "key": key}))
        else:
            lines.append(json.dumps({"id": i, "op": "set", "repo": repo, "key": key, "value": {"i": i, "f": i / 2}}))
    s.sendall(("\\n".join(lines) + "\\n").encode())
    s.shutdown(socket.SHUT_WR)  # the daemon answers everything, then closes
    data, replies = b"", 0
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    for line in data.split(b"\\n"):
        if line:
            reply = json.loads(line)
            assert reply["ok"], reply
            replies += 1
    assert replies == count, replies
    print(replies)
    """
)


def write_burst(path: str, repo: str, count: int) -> None:
    out = subprocess.run([sys.executable, "-c", WRITER, path, repo, str(count)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(count)


def test_mirror_equals_the_daemon_after_a_burst_from_another_process(durable: Daemon) -> None:
    with obsd.connect(durable.socket) as c:
        c.set("burst", "before", "x")
        m = c.mirror("burst")
        assert dict(m) == {"before": "x"} and m.rev == 1
        write_burst(durable.socket, "burst", 10_000)
        rev = m.sync(WAIT)
        expected = c.items("burst")
        assert len(expected) > 400
        assert dict(m) == expected
        assert rev == m.rev >= [r["rev"] for r in c.repos() if r["name"] == "burst"][0]


def test_mirror_of_a_prefix_and_on_change(client: obsd.Client) -> None:
    client.set("cfg", "app/a", 1)
    client.set("cfg", "other", 1)
    m = client.mirror("cfg", prefix="app/")
    assert dict(m) == {"app/a": 1} and "other" not in m and len(m) == 1
    seen: List[List[str]] = []
    done = threading.Event()

    def changed(keys: List[str]) -> None:
        seen.append(keys)
        if "app/c" in keys:
            done.set()

    stop = m.on_change(changed)
    client.batch("cfg", [obsd.Set("app/a", 2), obsd.Set("app/b", 3), obsd.Set("other", 2)])
    client.delete("cfg", "app/b")
    client.set("cfg", "app/c", None)
    assert done.wait(WAIT)
    assert seen == [["app/a", "app/b"], ["app/b"], ["app/c"]]
    assert m.snapshot() == {"app/a": 2, "app/c": None}
    assert m.get("app/b", "gone") == "gone" and sorted(m) == ["app/a", "app/c"]
    assert m == {"app/a": 2, "app/c": None} and dict(m.items()) == {"app/a": 2, "app/c": None}
    assert sorted(m.keys()) == ["app/a", "app/c"] and sorted(m.values(), key=repr) == [2, None]
    stop()
    m.close()


def test_sync_shows_writes_acknowledged_to_anyone(daemon: Daemon) -> None:
    """Today's daemon has no sync op: the mirror reads the revision and waits for its events or progress."""
    with obsd.connect(daemon.socket) as reader, obsd.connect(daemon.socket) as writer:
        m = reader.mirror("s", prefix="watched/")
        for i in range(50):
            result = writer.set("s", f"watched/{i}", i)
            assert m.sync(WAIT) >= result.rev
            assert m[f"watched/{i}"] == i
        # writes the mirror does not select still move its revision (progress events)
        last = writer.set("s", "unselected", 1)
        assert m.sync(WAIT) >= last.rev


def test_mirror_across_restarts(durable: Daemon) -> None:
    with obsd.connect(durable.socket) as c:
        c.set("m", "a", 1)
        m = c.mirror("m")
        durable.restart()
        c.set("m", "b", 2)
        wait_until(lambda: m.get("b") == 2, "the mirror to resume after the restart")
        assert dict(m) == {"a": 1, "b": 2} and m.sync(WAIT) == 2
        durable.kill()
        durable.start()
        c.delete("m", "a")
        m.sync(WAIT)
        assert dict(m) == {"b": 2}


def test_mirror_across_a_restart_without_persistence(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as c:
        c.set("m", "old", 1)
        m = c.mirror("m")
        epoch = m.epoch
        resets: List[List[str]] = []
        m.on_change(resets.append)
        daemon.restart()
        c.set("m", "new", 1)
        wait_until(lambda: dict(m) == {"new": 1}, "the mirror to be replaced by the new history")
        assert m.epoch != epoch and m.rev == 1
        assert any("old" in keys for keys in resets)


def test_mirror_of_a_repository_that_does_not_exist(client: obsd.Client) -> None:
    m = client.mirror("nothing-here")
    assert dict(m) == {} and m.rev == 0
    assert m.sync(WAIT) == 0
    client.set("nothing-here", "k", 1)
    assert m.sync(WAIT) == 1 and dict(m) == {"k": 1}


def test_mirror_in_many_threads(daemon: Daemon) -> None:
    with obsd.connect(daemon.socket) as c:
        m = c.mirror("t")
        errors: List[BaseException] = []

        def writer(n: int) -> None:
            try:
                with obsd.connect(daemon.socket) as w:
                    for i in range(100):
                        w.set("t", f"w{n}", i)
                        assert m.sync(WAIT) >= 1
                        assert m[f"w{n}"] == i  # a read after sync shows this thread's own write
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(error)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert dict(m) == c.items("t")
