"""Every method of the blocking client against the real daemon, and every error it raises."""

from __future__ import annotations

import builtins
import os
import pickle
import subprocess
import sys
import threading

import pytest

import obsd
from support import Daemon, wait_until


def test_sentinels() -> None:
    assert repr(obsd.ABSENT) == "obsd.ABSENT" and repr(obsd.UNKNOWN) == "obsd.UNKNOWN"
    assert not obsd.ABSENT and not obsd.UNKNOWN
    assert obsd.ABSENT is not None and obsd.ABSENT != obsd.UNKNOWN
    assert pickle.loads(pickle.dumps(obsd.ABSENT)) is obsd.ABSENT


def test_values_round_trip_exactly(client: obsd.Client) -> None:
    values = {
        "int64-max": 2**63 - 1,
        "int64-min": -(2**63),
        "beyond-double": 9007199254740993,
        "float-one": 1.0,
        "float": 0.1,
        "big-double": 1e100,
        "null": None,
        "true": True,
        "zero": 0,
        "text": "héllo \u2603 \U0001f600 \"quoted\" \\ \n",
        "nested": {"b": [1, 2.5, None, {"x": []}], "a": {}},
        "empty-list": [],
    }
    for key, value in values.items():
        client.set("values", key, value)
    for key, value in values.items():
        got = client.get("values", key).value
        assert got == value and type(got) is type(value), key
    assert type(client.get("values", "float-one").value) is float
    assert type(client.get("values", "zero").value) is int
    assert client.items("values")["nested"] == values["nested"]


def test_set_get_delete(client: obsd.Client) -> None:
    first = client.set("ui", "theme", "light")
    assert first == obsd.WriteResult(1, True, obsd.ABSENT)
    second = client.set("ui", "theme", "dark")
    assert second == obsd.WriteResult(2, True, "light")
    same = client.set("ui", "theme", "dark")
    assert same.changed is False and same.rev == 2 and same.old == "dark"
    forced = client.set("ui", "theme", "dark", force=True)
    assert forced.changed is True and forced.rev == 3
    assert client.get("ui", "theme") == obsd.Entry("dark", 3, None)
    # null is a value, distinct from ABSENT
    assert client.set("ui", "draft", None).old is obsd.ABSENT
    assert client.set("ui", "draft", 1).old is None
    deleted = client.delete("ui", "draft")
    assert deleted.changed and deleted.old == 1
    gone = client.delete("ui", "draft")
    assert gone.changed is False and gone.old is obsd.ABSENT
    with pytest.raises(obsd.NotFound) as raised:
        client.get("ui", "draft")
    assert raised.value.code == "not_found" and "draft" in raised.value.message


def test_compare_and_set(client: obsd.Client) -> None:
    created = client.set("cas", "k", 1, if_revision=0)
    with pytest.raises(obsd.Conflict) as raised:
        client.set("cas", "k", 2, if_revision=0)
    assert raised.value.code == "conflict"
    assert client.set("cas", "k", 2, if_revision=created.rev).changed
    with pytest.raises(obsd.Conflict):
        client.delete("cas", "k", if_revision=created.rev)
    assert client.delete("cas", "k", if_revision=client.get("cas", "k").rev).changed


def test_batch(client: obsd.Client) -> None:
    client.set("b", "gone", 1)
    result = client.batch("b", [obsd.Set("x", 1), obsd.Set("y", {"z": 2}), obsd.Delete("gone")])
    assert result == obsd.WriteResult(2, True, obsd.ABSENT)
    assert client.items("b") == {"x": 1, "y": {"z": 2}}
    assert client.batch("b", []) == obsd.WriteResult(2, False, obsd.ABSENT)
    with pytest.raises(obsd.Conflict):
        client.batch("b", [obsd.Set("x", 5), obsd.Set("new", 1, if_revision=7)])
    assert client.items("b") == {"x": 1, "y": {"z": 2}}  # atomic: nothing applied
    with pytest.raises(obsd.BadRequest) as raised:  # the daemon's: a key twice
        client.batch("b", [obsd.Set("x", 1), obsd.Delete("x")])
    assert raised.value.code == "bad_request"
    lease = client.grant()
    client.batch("b", [obsd.Set("leased", True, lease=lease), obsd.Set("forced", 1, force=True)])
    assert client.get("b", "leased").lease == lease.id


def test_keys_and_items_sorted_by_utf8_bytes(client: obsd.Client) -> None:
    names = ["b", "a/2", "a/10", "é", "z", "\U0001f600", "a/1"]
    for i, name in enumerate(names):
        client.set("k", name, i)
    expected = sorted(names, key=lambda s: s.encode())
    assert client.keys("k") == expected
    assert list(client.items("k")) == expected
    assert client.keys("k", prefix="a/") == ["a/1", "a/10", "a/2"]
    assert client.items("k", prefix="a/1") == {"a/1": 6, "a/10": 2}
    assert client.keys("empty") == [] and client.items("empty") == {}


def test_ping_repos_stats_server(client: obsd.Client) -> None:
    client.ping()
    assert client.server.startswith("obsd/")
    client.set("r1", "k", 1)
    repos = client.repos()
    assert [r["name"] for r in repos] == ["r1"] and repos[0]["rev"] == 1 and repos[0]["keys"] == 1
    stats = client.stats()
    assert stats["connections"] >= 1 and "id" not in stats


def test_local_argument_errors(client: obsd.Client) -> None:
    cases = [
        lambda: client.set("bad name", "k", 1),
        lambda: client.set("", "k", 1),
        lambda: client.set("r" * 129, "k", 1),
        lambda: client.set("r", "", 1),
        lambda: client.set("r", 5, 1),  # type: ignore[arg-type]
        lambda: client.set("r", "x" * 1025, 1),
        lambda: client.set("r", "\ud800", 1),
        lambda: client.set("r", "k", 2**63),
        lambda: client.set("r", "k", float("nan")),
        lambda: client.set("r", "k", {1: "a"}),
        lambda: client.set("r", "k", {1, 2}),
        lambda: client.set("r", "k", obsd.ABSENT),
        lambda: client.set("r", "k", 1, if_revision=-1),
        lambda: client.set("r", "k", 1, if_revision=True),
        lambda: client.set("r", "k", 1, lease=0),
        lambda: client.set("r", "k", 1, force="yes"),  # type: ignore[arg-type]
        lambda: client.batch("r", [("k", 1)]),  # type: ignore[list-item]
        lambda: client.watch("r", keys="abc"),
        lambda: client.watch("r", keys=["a"], prefix="a"),
        lambda: client.watch("r", epoch="e"),
        lambda: client.grant(ttl=0),
        lambda: client.grant(ttl=10**9),
        lambda: client.mirror("r", prefix=3),  # type: ignore[arg-type]
    ]
    for case in cases:
        with pytest.raises(obsd.BadRequest) as raised:
            case()
        assert raised.value.code == "bad_request" and raised.value.message
        assert isinstance(raised.value, ValueError)


def test_daemon_errors() -> None:
    d = Daemon(in_memory=True, args=["--max-value-bytes", "1000", "--max-leases-per-uid", "2", "--max-line", "4096"]).start()
    try:
        with obsd.connect(d.socket) as c:
            with pytest.raises(obsd.TooLarge) as too_large:  # the daemon's limit on values
                c.set("r", "k", "x" * 2000)
            assert too_large.value.code == "too_large"
            with pytest.raises(obsd.TooLarge) as too_long:  # over the daemon's line length: refused before sending
                c.set("r", "k", "x" * 5000)
            assert "4096" in too_long.value.message
            c.grant()
            c.grant()
            with pytest.raises(obsd.Overloaded) as overloaded:
                c.grant()
            assert overloaded.value.code == "overloaded"
            with pytest.raises(obsd.NotFound):
                c.revoke(999)
            with pytest.raises(obsd.NotFound):
                c.keepalive(999)
            with pytest.raises(obsd.NotFound):
                c.set("r", "k", 1, lease=999)
            c.ping()  # the connection is still usable after each refusal
    finally:
        d.cleanup()


def test_connection_error_when_no_daemon() -> None:
    path = "/tmp/obsd-py-no-such-dir/obsd.sock"
    with pytest.raises(obsd.ConnectionError) as raised:
        obsd.connect(path)
    error = raised.value
    assert isinstance(error, builtins.ConnectionError) and isinstance(error, obsd.ObsdError)
    assert error.code == "connection" and path in error.message and "is obsd running" in error.message


def test_socket_from_environment(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OBSD_SOCKET", daemon.socket)
    with obsd.connect() as c:
        assert c.socket == daemon.socket
        c.ping()
    monkeypatch.delenv("OBSD_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", daemon.dir)  # the daemon's socket is DIR/obsd.sock
    with obsd.connect() as c:
        assert c.socket == os.path.join(daemon.dir, "obsd.sock")
        c.ping()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    from obsd._wire import resolve_socket  # the system's default comes last

    assert resolve_socket(None) == "/run/obsd/obsd.sock"


def test_calls_from_many_threads(client: obsd.Client) -> None:
    errors = []

    def work(n: int) -> None:
        try:
            for i in range(200):
                client.set("threads", f"t{n}", i)
                assert client.get("threads", f"t{n}").value == i
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.items("threads") == {f"t{n}": 199 for n in range(8)}


def test_forbidden_for_another_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("running a client as another uid needs root (CI runs as root)")
    d = Daemon(in_memory=True, args=["--socket-mode", "0666", "--access-default", "read"])
    os.chmod(d.dir, 0o755)  # so that nobody reaches the socket
    d.start()
    try:
        with obsd.connect(d.socket) as c:
            c.set("shared", "k", 1)
            lease = c.grant(ttl=60)
            script = (
                "import sys, os; sys.path.insert(0, sys.argv[1]); import obsd, obsd.aio\n"
                "os.setgid(65534); os.setuid(65534)  # after the imports: root's home is not readable by nobody\n"
                "c = obsd.connect(sys.argv[2])\n"
                "assert c.get('shared', 'k').value == 1\n"
                "for call in (lambda: c.set('shared', 'k', 2), lambda: c.keepalive(int(sys.argv[3]))):\n"
                "    try:\n        call()\n    except obsd.Forbidden as e:\n        print('forbidden', e.code)\n"
            )
            src = os.path.join(os.path.dirname(obsd.__file__), "..")
            out = subprocess.run(
                [sys.executable, "-c", script, src, d.socket, str(lease.id)], capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.split("\n")[:2] == ["forbidden forbidden", "forbidden forbidden"]
            lease.revoke()
    finally:
        d.cleanup()


def test_closed_client(daemon: Daemon) -> None:
    c = obsd.connect(daemon.socket)
    c.close()
    assert c.closed
    with pytest.raises(obsd.ConnectionError):
        c.ping()


def test_refused_connections_are_retried() -> None:
    """At its connection limit the daemon accepts, says overloaded and closes: the client tries again, more slowly."""
    d = Daemon(in_memory=True, args=["--max-connections", "2"]).start()
    try:
        first = obsd.connect(d.socket)
        second = obsd.connect(d.socket)
        result: list = []

        def third() -> None:
            try:
                c = obsd.connect(d.socket, reconnect_timeout=120)
                c.set("r", "k", "third")
                result.append(c)
            except BaseException as error:  # pragma: no cover - reported below
                result.append(error)

        thread = threading.Thread(target=third)
        thread.start()
        wait_until(lambda: second.stats().get("connectionsRefused", 0) >= 2, "two refused attempts")
        assert not result
        first.close()
        thread.join(120)
        assert result and isinstance(result[0], obsd.Client), result
        assert second.get("r", "k").value == "third"
        result[0].close()
        second.close()
    finally:
        d.cleanup()


def test_error_classes() -> None:
    from obsd._errors import error_from_reply

    expected = {
        "bad_json": obsd.BadJSON,
        "bad_request": obsd.BadRequest,
        "unknown_op": obsd.UnknownOp,
        "not_found": obsd.NotFound,
        "conflict": obsd.Conflict,
        "forbidden": obsd.Forbidden,
        "too_large": obsd.TooLarge,
        "compacted": obsd.Compacted,
        "overloaded": obsd.Overloaded,
        "internal": obsd.Internal,
    }
    for code, cls in expected.items():
        error = error_from_reply({"code": code, "message": "m"})
        assert type(error) is cls and error.code == code and error.message == "m"
        assert isinstance(error, obsd.ObsdError)
        assert str(error) == f"{code}: m"
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is cls and copy.code == code
    newer = error_from_reply({"code": "some_new_code", "message": "m"})
    assert type(newer) is obsd.ObsdError and newer.code == "some_new_code"
    assert issubclass(obsd.ConnectionError, builtins.ConnectionError) and issubclass(obsd.ConnectionError, obsd.ObsdError)
