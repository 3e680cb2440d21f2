#!/usr/bin/env python3
"""obsd benchmarks, side by side with Redis in the same run.

Runs each scenario against obsd and against redis-server (installed with apt when
missing, started on a temporary Unix socket, stopped afterwards), alternating the two
systems round by round, with the server pinned to one CPU and the load generator
(`obsbench`, written for the purpose) to another. Reports, per scenario, the median over
rounds of each system's figure and the median of the per-round ratios obsd / Redis —
these machines drift 15-40 % within minutes, so only same-round ratios are compared.

Scenarios (obsd --in-memory against Redis without persistence, unless stated):
  fanout   one key, 1/10/100/1000 subscribers, 64 writes in flight: delivered events/s
  keyed    10/100/1000 subscribers each on its own key, writes round-robin: events/s
  latency  writes at 2,000/s, one subscriber: p50/p99/p99.9 from send to event
  idle     10,000 connections each subscribed to its own key: server RSS per connection
  writes   acknowledged writes/s, 1x1, 1x64 and 16x16 in flight, per durability policy
Every event is checked for order and loss (obsbench fails the run otherwise).

Usage: make bench            (builds release, runs everything, about 12 minutes)
       bench/bench.py --only fanout --rounds 5
       bench/bench.py --help
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".build", "release")


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def ensure_redis():
    if shutil.which("redis-server"):
        return
    print("installing redis-server (apt)...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(["apt-get", "install", "-y", "redis-server"], env=env, capture_output=True).returncode != 0:
        sh(["apt-get", "update"], env=env, capture_output=True)
        sh(["apt-get", "install", "-y", "redis-server"], env=env, capture_output=True)
    # The package may start a system instance; the bench uses its own.
    subprocess.run(["service", "redis-server", "stop"], capture_output=True)


def wait_for_socket(path, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{path} did not come up")


class Server:
    """A server process pinned to `cpu`, on a fresh temporary directory."""

    def __init__(self, kind, config, cpu):
        self.kind, self.config, self.cpu = kind, config, cpu
        self.pid = None
        self.dir = tempfile.mkdtemp(prefix="obsd-bench-")
        self.socket = os.path.join(self.dir, "s.sock")

    def __enter__(self):
        if self.kind == "obsd":
            cmd = [os.path.join(BIN, "obsd"), "--socket", self.socket, "--log-level", "warning", "--max-connections-per-uid", "20000"]
            cmd += ["--in-memory"] if self.config == "memory" else ["--data-dir", os.path.join(self.dir, "data"), "--sync", self.config]
        else:
            cmd = ["redis-server", "--port", "0", "--unixsocket", self.socket, "--dir", self.dir, "--save", "",
                   "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log"), "--maxclients", "20000"]
            cmd += ["--appendonly", "no"] if self.config == "none" else ["--appendonly", "yes", "--appendfsync", self.config]
        self.proc = subprocess.Popen(["taskset", "-c", str(self.cpu)] + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_socket(self.socket, self.proc)
        self.pid = self.proc.pid  # taskset execs the server in place
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def obsbench(cpu, *args):
    out = sh(["taskset", "-c", str(cpu), os.path.join(BIN, "obsbench"), *args], capture_output=True).stdout
    return dict(re.findall(r"([\w/-]+)=([\d.]+)", out))


# Pairs of comparable durability settings: (label, obsd --sync, redis appendfsync).
FAMILIES = ["fanout", "keyed", "latency", "idle", "writes"]

WRITE_POLICIES = [
    ("durable: fsync before ack", "always", "always"),
    ("relaxed: fsync every second", "relaxed", "everysec"),
    ("memory: no persistence", "memory", "none"),
]
WRITERS = [(1, 1), (1, 64), (16, 16)]


def bench_writes(rounds, seconds, server_cpu, load_cpu):
    rows = []
    for label, obsd_sync, redis_fsync in WRITE_POLICIES:
        for writers, inflight in WRITERS:
            samples = {"obsd": [], "redis": [], "fsyncs": [], "ratio": [], "loadgen": []}
            for r in range(rounds):
                order = [("obsd", obsd_sync), ("redis", redis_fsync)]
                if r % 2:
                    order.reverse()
                result = {}
                for kind, config in order:
                    with Server(kind, config, server_cpu) as server:
                        out = obsbench(load_cpu, "writes", "--target", kind, "--socket", server.socket, "--writers", str(writers),
                                       "--inflight", str(inflight), "--seconds", str(seconds))
                    result[kind] = out
                samples["obsd"].append(float(result["obsd"]["acks/s"]))
                samples["redis"].append(float(result["redis"]["acks/s"]))
                samples["fsyncs"].append(float(result["obsd"]["fsyncs/s"]))
                samples["loadgen"].append(max(float(result["obsd"]["loadgen-cpu"]), float(result["redis"]["loadgen-cpu"])))
                samples["ratio"].append(samples["obsd"][-1] / samples["redis"][-1])
            rows.append({
                "scenario": f"writes, {label}, {writers} writer{'s' if writers > 1 else ''} x {inflight} in flight",
                "obsd": statistics.median(samples["obsd"]), "redis": statistics.median(samples["redis"]),
                "ratio": statistics.median(samples["ratio"]), "unit": "acks/s",
                "note": f"obsd fsyncs/s {statistics.median(samples['fsyncs']):.1f}; loadgen CPU <= {max(samples['loadgen']):.0f}%",
            })
            print_row(rows[-1])
    return rows


def alternate(rounds, run):
    """Runs `run(kind)` for obsd and Redis once per round, alternating which goes first."""
    results = []
    for r in range(rounds):
        order = ["obsd", "redis"] if r % 2 == 0 else ["redis", "obsd"]
        results.append({kind: run(kind) for kind in order})
    return results


def summarize(scenario, results, key, unit, note="", lower_is_better=False):
    obsd = [float(r["obsd"][key]) for r in results]
    redis = [float(r["redis"][key]) for r in results]
    loadgen = {k: max(float(r[k].get("loadgen-cpu", 0)) for r in results) for k in ("obsd", "redis")}
    row = {
        "scenario": scenario, "obsd": statistics.median(obsd), "redis": statistics.median(redis),
        "ratio": statistics.median(o / r for o, r in zip(obsd, redis)), "unit": unit,
        "note": "; ".join(part for part in (note, f"loadgen CPU <= {loadgen['obsd']:.0f}% / {loadgen['redis']:.0f}%" if loadgen["redis"] else "",
                                             "lower is better" if lower_is_better else "") if part),
    }
    print_row(row)
    return row


def in_memory(kind, cpu):
    """obsd --in-memory, or Redis without persistence."""
    return Server(kind, "memory" if kind == "obsd" else "none", cpu)


def bench_pubsub(mode, counts, label, rounds, seconds, server_cpu, load_cpu):
    rows = []
    for n in counts:
        def run(kind):
            with in_memory(kind, server_cpu) as server:
                return obsbench(load_cpu, "pubsub", "--target", kind, "--socket", server.socket, "--mode", mode,
                                "--subscribers", str(n), "--seconds", str(seconds))
        rows.append(summarize(label(n), alternate(rounds, run), "events/s", "events/s"))
    return rows


def bench_fanout(rounds, seconds, server_cpu, load_cpu):
    return bench_pubsub("fanout", (1, 10, 100, 1000),
                        lambda n: f"fan-out: 1 key, {n} subscriber{'s' if n > 1 else ''}, 64 writes in flight",
                        rounds, seconds, server_cpu, load_cpu)


def bench_keyed(rounds, seconds, server_cpu, load_cpu):
    return bench_pubsub("keyed", (10, 100, 1000), lambda n: f"keyed: {n} subscribers, one key each, writes round-robin",
                        rounds, seconds, server_cpu, load_cpu)


def bench_latency(rounds, seconds, server_cpu, load_cpu, rate=2000):
    def run(kind):
        with in_memory(kind, server_cpu) as server:
            return obsbench(load_cpu, "pubsub", "--target", kind, "--socket", server.socket, "--mode", "latency",
                            "--rate", str(rate), "--seconds", str(max(seconds, 5)))
    results = alternate(rounds, run)
    return [summarize(f"latency set → event at {rate}/s, {label}", results, key, "µs", lower_is_better=True)
            for label, key in (("p50", "p50-us"), ("p99", "p99-us"), ("p99.9", "p999-us"))]


def bench_idle(rounds, server_cpu, load_cpu, connections=10_000):
    def run(kind):
        with in_memory(kind, server_cpu) as server:
            return obsbench(load_cpu, "idle", "--target", kind, "--socket", server.socket, "--pid", str(server.pid),
                            "--connections", str(connections))
    return [summarize(f"idle: {connections:,} connections, each subscribed to its own key", alternate(rounds, run),
                      "KiB/connection", "KiB RSS/connection", lower_is_better=True)]


def print_row(row):
    digits = 1 if row["obsd"] < 100 else 0
    print(f"| {row['scenario']} ({row['unit']}) | {row['obsd']:,.{digits}f} | {row['redis']:,.{digits}f} | {row['ratio']:.2f} "
          f"| {row['note']} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (each runs obsd and Redis once)")
    parser.add_argument("--seconds", type=float, default=3, help="measured seconds per run")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--only", choices=FAMILIES, help="run one scenario family")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    ensure_redis()
    print(f"# obsd vs Redis {sh(['redis-server', '--version'], capture_output=True).stdout.split()[2]}, "
          f"{os.cpu_count()} CPUs, server on CPU {args.server_cpu}, load generator on CPU {args.load_cpu}, "
          f"{args.rounds} rounds x {args.seconds}s, medians", flush=True)
    print("| scenario | obsd | Redis | obsd/Redis | notes |\n|---|---:|---:|---:|---|", flush=True)
    rows = []
    cpus = (args.server_cpu, args.load_cpu)
    if args.only in (None, "fanout"):
        rows += bench_fanout(args.rounds, args.seconds, *cpus)
    if args.only in (None, "keyed"):
        rows += bench_keyed(args.rounds, args.seconds, *cpus)
    if args.only in (None, "latency"):
        rows += bench_latency(args.rounds, args.seconds, *cpus)
    if args.only in (None, "idle"):
        rows += bench_idle(args.rounds, *cpus)
    if args.only in (None, "writes"):
        rows += bench_writes(args.rounds, args.seconds, *cpus)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
