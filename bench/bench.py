#!/usr/bin/env python3
"""obsd benchmarks, side by side with Redis in the same run.

Runs each scenario against obsd and against redis-server (installed with apt when
missing, started on a temporary Unix socket, stopped afterwards), alternating the two
systems round by round, with the server pinned to one CPU and the load generator
(`obsbench`, written for the purpose) to another. Reports, per scenario, the median over
rounds of each system's figure and the median of the per-round ratios obsd / Redis —
these machines drift 15-40 % within minutes, so only same-round ratios are compared.

Usage: make bench            (builds release, runs everything)
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
        self.dir = tempfile.mkdtemp(prefix="obsd-bench-")
        self.socket = os.path.join(self.dir, "s.sock")

    def __enter__(self):
        if self.kind == "obsd":
            cmd = [os.path.join(BIN, "obsd"), "--socket", self.socket, "--log-level", "warning"]
            cmd += ["--in-memory"] if self.config == "memory" else ["--data-dir", os.path.join(self.dir, "data"), "--sync", self.config]
        else:
            cmd = ["redis-server", "--port", "0", "--unixsocket", self.socket, "--dir", self.dir, "--save", "",
                   "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log")]
            cmd += ["--appendonly", "no"] if self.config == "none" else ["--appendonly", "yes", "--appendfsync", self.config]
        self.proc = subprocess.Popen(["taskset", "-c", str(self.cpu)] + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_socket(self.socket, self.proc)
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
WRITE_POLICIES = [
    ("durable: fsync before ack", "always", "always"),
    ("relaxed: fsync every second", "relaxed", "everysec"),
    ("memory: no persistence", "memory", "none"),
]
WRITERS = [(1, 64), (16, 16)]


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


def print_row(row):
    print(f"| {row['scenario']} | {row['obsd']:,.0f} | {row['redis']:,.0f} | {row['ratio']:.2f} | {row['note']} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (each runs obsd and Redis once)")
    parser.add_argument("--seconds", type=float, default=3, help="measured seconds per run")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--only", choices=["writes"], help="run one scenario family")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    ensure_redis()
    print(f"# obsd vs Redis {sh(['redis-server', '--version'], capture_output=True).stdout.split()[2]}, "
          f"{os.cpu_count()} CPUs, server on CPU {args.server_cpu}, load generator on CPU {args.load_cpu}, "
          f"{args.rounds} rounds x {args.seconds}s, medians", flush=True)
    print("| scenario | obsd | Redis | obsd/Redis | notes |\n|---|---:|---:|---:|---|", flush=True)
    rows = []
    if args.only in (None, "writes"):
        rows += bench_writes(args.rounds, args.seconds, args.server_cpu, args.load_cpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
