#!/usr/bin/env python3
"""The Python client's overhead as a figure: obsd.aio next to a hand-written asyncio client.

Each run is one process with two connections: a writer that pipelines N ``set``s of one key
(``--window`` requests in flight, each a coroutine awaiting its reply) and a watcher of that
key that reads until it has the event of the last revision. The same process shape twice:

- ``obsd.aio``: ``writer.set(...)`` and ``async for event in watcher.watch(...)``;
- ``raw``: asyncio streams, request lines written by hand with ``%``-formatting, replies
  matched in order by a reader task, every line read back with ``json.loads``.

Reported per run: events/s (N / the time from the first write to the last event), the
process's CPU seconds (``time.process_time``: user + system, both connections) and CPU µs
per event. Runs alternate between the two clients, each in a fresh process.

    python3 clients/python/bench/bench.py                         # starts .build/release/obsd (else debug), in memory
    python3 clients/python/bench/bench.py --socket /run/obsd/obsd.sock -n 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "src"))


# MARK: the two clients


async def run_library(path: str, repo: str, count: int, window: int) -> Dict[str, float]:
    import obsd.aio

    async with obsd.aio.connect(path) as writer, obsd.aio.connect(path) as watcher:
        base = (await writer.set(repo, "n", -1)).rev
        watch = await watcher.watch(repo, keys=["n"])
        last = base + count
        received = 0

        async def watch_all() -> None:
            nonlocal received
            async for event in watch:
                received += 1
                if event.rev >= last:
                    return

        async def write(start: int) -> None:
            for i in range(start, count, window):
                await writer.set(repo, "n", i)

        cpu, wall = time.process_time(), time.perf_counter()
        watching = asyncio.ensure_future(watch_all())
        await asyncio.gather(*(write(k) for k in range(window)))
        await watching
        return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "events": received}


async def run_raw(path: str, repo: str, count: int, window: int) -> Dict[str, float]:
    loop = asyncio.get_running_loop()
    w_reader, w_writer = await asyncio.open_unix_connection(path, limit=1 << 22)
    s_reader, s_writer = await asyncio.open_unix_connection(path, limit=1 << 22)
    from collections import deque

    queue: "deque[asyncio.Future[Dict[str, Any]]]" = deque()
    next_id = 0

    def request(line: bytes) -> "asyncio.Future[Dict[str, Any]]":
        future = loop.create_future()
        queue.append(future)
        w_writer.write(line)
        return future

    async def read_replies() -> None:
        while True:
            line = await w_reader.readline()
            if not line:
                return
            message = json.loads(line)
            if "event" not in message:
                queue.popleft().set_result(message)

    replies = asyncio.ensure_future(read_replies())
    repo_bytes = repo.encode()

    async def set_value(i: int) -> Dict[str, Any]:
        nonlocal next_id
        next_id += 1
        reply = await request(b'{"id":%d,"op":"set","repo":"%s","key":"n","value":%d}\n' % (next_id, repo_bytes, i))
        if not reply.get("ok"):
            raise RuntimeError(reply)
        return reply

    base = (await set_value(-1))["rev"]
    s_writer.write(b'{"id":1,"op":"subscribe","repo":"%s","keys":["n"]}\n' % repo_bytes)
    subscribed = json.loads(await s_reader.readline())
    assert subscribed.get("ok"), subscribed
    last = base + count
    received = 0

    async def watch_all() -> None:
        nonlocal received
        while True:
            message = json.loads(await s_reader.readline())
            if message.get("event") == "change":
                received += 1
                if message["rev"] >= last:
                    return

    async def write(start: int) -> None:
        for i in range(start, count, window):
            await set_value(i)

    cpu, wall = time.process_time(), time.perf_counter()
    watching = asyncio.ensure_future(watch_all())
    await asyncio.gather(*(write(k) for k in range(window)))
    await watching
    result = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "events": received}
    replies.cancel()
    for stream in (w_writer, s_writer):
        stream.close()
    return result


# MARK: the driver


def child(args: argparse.Namespace) -> None:
    function = run_library if args.child == "obsd.aio" else run_raw
    result = asyncio.run(function(args.socket, args.repo, args.count, args.window))
    print(json.dumps(result))


def start_daemon(binary: str, durable: bool) -> "tuple[subprocess.Popen[bytes], str, str]":
    directory = tempfile.mkdtemp(prefix="obsd-bench-", dir="/tmp")
    path = os.path.join(directory, "obsd.sock")
    command = [binary, "--socket", path, "--log-level", "warning", "--log-target", "stderr"]
    command += ["--data-dir", os.path.join(directory, "data")] if durable else ["--in-memory"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBSD_")}
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(path)
                s.sendall(b'{"id":1,"op":"ping"}\n')
                if b'"ok":true' in s.recv(4096):
                    return process, path, directory
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"obsd did not start: {command}")
        time.sleep(0.02)


def server_name(path: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b'{"id":1,"op":"hello"}\n')
        return str(json.loads(s.makefile().readline()).get("server", "?"))


def main() -> None:
    parser = argparse.ArgumentParser(description="obsd.aio against a hand-written asyncio client: events/s and client CPU.")
    parser.add_argument("-n", "--count", type=int, default=50_000, help="sets per run (default 50000)")
    parser.add_argument("--window", type=int, default=64, help="requests in flight (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each client, alternating (default 3)")
    parser.add_argument("--socket", help="use the daemon at this socket instead of starting one")
    parser.add_argument("--obsd", help="the obsd binary to start (default: .build/release/obsd, else .build/debug/obsd)")
    parser.add_argument("--durable", action="store_true", help="start the daemon with a data directory (default: in memory)")
    parser.add_argument("--repo", default="bench-py")
    parser.add_argument("--child", choices=["obsd.aio", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    process = None
    directory = None
    binary = "(an already running daemon)"
    if args.socket is None:
        binary = args.obsd or next(
            (str(p) for p in (REPO / ".build/release/obsd", REPO / ".build/debug/obsd") if p.exists()), ""
        )
        if not binary:
            raise SystemExit("no obsd binary: build one (swift build -c release --product obsd) or pass --obsd/--socket")
        process, args.socket, directory = start_daemon(binary, args.durable)
    try:
        server = server_name(args.socket)
        results: Dict[str, List[Dict[str, float]]] = {"obsd.aio": [], "raw": []}
        for round_number in range(args.rounds):
            for name in ("obsd.aio", "raw"):
                repo = f"{args.repo}-{round_number}-{name.replace('.', '-')}"
                command = [sys.executable, __file__, "--child", name, "--socket", args.socket, "-n", str(args.count), "--window", str(args.window), "--repo", repo]
                out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{out.stderr}")
                result = json.loads(out.stdout)
                if result["events"] != args.count:
                    raise SystemExit(f"{name} received {result['events']} events of {args.count}")
                results[name].append(result)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    script = os.path.relpath(sys.argv[0]) if os.path.exists(sys.argv[0]) else sys.argv[0]
    print(f"command: {shlex.join(['python3', script] + sys.argv[1:])}")
    print(
        f"machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}; "
        f"daemon {server} ({binary}{', durable' if args.durable else ', in memory'}); "
        f"{args.count} sets per run, {args.window} in flight, {args.rounds} runs each (median; all runs in brackets)"
    )
    print()
    print("| client | events/s | client CPU s | client CPU µs/event |")
    print("|---|---:|---:|---:|")
    medians: Dict[str, float] = {}
    for name, runs in results.items():
        rates = [r["events"] / r["wall"] for r in runs]
        cpus = [r["cpu"] for r in runs]
        medians[name] = statistics.median(cpus)
        print(
            f"| {name} | {statistics.median(rates):,.0f} [{', '.join(f'{x:,.0f}' for x in rates)}] "
            f"| {statistics.median(cpus):.2f} [{', '.join(f'{x:.2f}' for x in cpus)}] "
            f"| {statistics.median(cpus) / args.count * 1e6:.1f} |"
        )
    print()
    print(f"library CPU / raw CPU: {medians['obsd.aio'] / medians['raw']:.2f}")


if __name__ == "__main__":
    main()
