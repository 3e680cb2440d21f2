#!/usr/bin/env python3
"""obsd benchmarks, side by side with Redis in the same run.

Runs each scenario against obsd and against redis-server (installed with apt when
missing, started on a temporary Unix socket, stopped afterwards), alternating the two
systems round by round, with the server pinned to one CPU and the load generator
(`obsbench`, built for the purpose: raw epoll sockets, every event checked) to another.
Reports, per scenario, the median over rounds of each system's figure and the median of
the per-round ratios obsd / Redis -- these machines drift 15-40 % within minutes, so only
same-round ratios are compared. The output is a markdown table, headed with the machine
and the command, then a text chart; --out also gets the table, the rows as JSON and an
SVG chart of events/s against subscribers.

Scenarios (obsd --in-memory against Redis without persistence, unless stated):
  fanout   one key, 1/10/100/1000 subscribers, 64 writes in flight: delivered events/s
  keyed    10/100/1000 subscribers each on its own key, writes round-robin: events/s
  latency  fan-out to 10 and 100, keyed 1000, 1 write in flight: send -> event p50/p99/p99.9
  idle     10,000 connections each subscribed to its own key: server RSS per connection
  writes   acknowledged writes/s, 1x1, 1x64 and 16x16 in flight, per durability policy
Every event is checked for order, loss and duplicates (obsbench fails the run otherwise).

--calibrate checks the load generator instead: for each pub/sub and writes scenario that
the neutral driver busbench (../shared/busbench) also runs, busbench and obsbench drive
the same Redis in the same round (Redis on the server CPU, each driver in turn on the
load CPU, order alternating) and the table shows both figures and obsbench/busbench.

Usage: make bench            (builds release, runs everything, about 15 minutes)
       bench/bench.py --only fanout --rounds 5
       bench/bench.py --calibrate [--busbench PATH]
       bench/bench.py --help
"""

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".build", "release")
DEFAULT_BUSBENCH = os.path.join(os.path.dirname(ROOT), "shared", "busbench")


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


# ---------------------------------------------------------------- scenarios

@dataclass
class Metric:
    key: str                 # obsbench's output name
    label: str               # what the row says
    unit: str
    busbench: str = ""       # busbench's output name, when it measures the same
    lower_is_better: bool = False


EVENTS = [Metric("events/s", "", "events/s", "deliv_per_s")]
LATENCY = [Metric(k, f", {p}", "µs", b, True) for p, k, b in
           (("p50", "p50-us", "p50_us"), ("p99", "p99-us", "p99_us"), ("p99.9", "p999-us", "p999_us"))]
ACKS = [Metric("acks/s", "", "acks/s", "ops_per_s")]


@dataclass
class Scenario:
    name: str                # short id (busbench/compare.sh style)
    family: str
    label: str
    obsbench: list           # obsbench arguments (after the target and socket)
    metrics: list
    busbench: list = None    # busbench arguments for the same load, if it has one
    persistence: str = "memory"   # memory | always | relaxed
    subscribers: int = 0     # for the chart
    note: str = ""


def plural(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def scenarios():
    out = []
    for n in (1, 10, 100, 1000):
        out.append(Scenario(f"fanout{n}-w64", "fanout", f"fan-out: 1 key, {plural(n, 'subscriber')}, 64 writes in flight",
                            ["pubsub", "--mode", "fanout", "--subscribers", str(n), "--inflight", "64"], EVENTS,
                            ["--scenario", "fanout", "--subs", str(n), "--window", "64"], subscribers=n))
    for n in (10, 100, 1000):
        out.append(Scenario(f"keyed{n}-w64", "keyed", f"keyed: {n:,} subscribers, one key each, writes round-robin, 64 in flight",
                            ["pubsub", "--mode", "keyed", "--subscribers", str(n), "--inflight", "64"], EVENTS,
                            ["--scenario", "keyed", "--subs", str(n), "--window", "64"] if n == 1000 else None, subscribers=n))
    for mode, n in (("fanout", 10), ("fanout", 100), ("keyed", 1000)):
        what = f"fan-out to {n}" if mode == "fanout" else f"keyed {n:,}"
        out.append(Scenario(f"{mode}{n}-w1", "latency", f"latency set → event, {what}, 1 write in flight",
                            ["pubsub", "--mode", mode, "--subscribers", str(n), "--inflight", "1"], LATENCY,
                            ["--scenario", mode, "--subs", str(n), "--window", "1"]))
    out.append(Scenario("idle10000", "idle", "idle: 10,000 connections, each subscribed to its own key",
                        ["idle", "--connections", "10000"], [Metric("KiB/connection", "", "KiB RSS/connection", "", True)]))
    for policy, label in (("always", "durable: fsync before ack"), ("relaxed", "relaxed: fsync every second"),
                          ("memory", "memory: no persistence")):
        for writers, inflight in ((1, 1), (1, 64), (16, 16)):
            bb = None
            if writers == 1 and (policy != "relaxed" or inflight == 64):
                bb = ["--scenario", "writes", "--window", str(inflight), "--keys", "1000"]
            prefix = {"always": "durable", "relaxed": "relaxed", "memory": "writes"}[policy]
            out.append(Scenario(f"{prefix}-{writers}x{inflight}", "writes",
                                f"writes, {label}, {plural(writers, 'writer')} x {inflight} in flight",
                                ["writes", "--writers", str(writers), "--inflight", str(inflight)], ACKS, bb, policy))
    return out


FAMILIES = ["fanout", "keyed", "latency", "idle", "writes"]


# ------------------------------------------------------------------ servers

def ensure_redis():
    if shutil.which("redis-server"):
        return
    print("installing redis-server (apt)...", file=sys.stderr, flush=True)
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
    """obsd or Redis pinned to `cpu`, on a fresh temporary directory, with `persistence`
    (memory: obsd --in-memory / Redis without persistence; always: obsd --sync always /
    appendfsync always; relaxed: obsd --sync relaxed / appendfsync everysec)."""

    def __init__(self, kind, persistence, cpu):
        self.kind, self.persistence, self.cpu = kind, persistence, cpu
        self.pid = None
        self.dir = tempfile.mkdtemp(prefix="obsd-bench-")
        self.socket = os.path.join(self.dir, "s.sock")

    def __enter__(self):
        if self.kind == "obsd":
            cmd = [os.path.join(BIN, "obsd"), "--socket", self.socket, "--log-level", "warning", "--max-connections-per-uid", "20000"]
            if self.persistence == "memory":
                cmd += ["--in-memory"]
            else:
                cmd += ["--data-dir", os.path.join(self.dir, "data"), "--sync", self.persistence]
        else:
            cmd = ["redis-server", "--port", "0", "--unixsocket", self.socket, "--dir", self.dir, "--save", "",
                   "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log"), "--maxclients", "20000"]
            cmd += {"memory": ["--appendonly", "no"], "always": ["--appendonly", "yes", "--appendfsync", "always"],
                    "relaxed": ["--appendonly", "yes", "--appendfsync", "everysec"]}[self.persistence]
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
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------ drivers

def parse_pairs(text):
    return dict(re.findall(r"([\w/.-]+)=([\d.]+)", text))


def run_driver(cmd, name):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def obsbench(cpu, scenario, kind, server, seconds):
    args = list(scenario.obsbench)
    if args[0] == "idle":
        args += ["--pid", str(server.pid)]
    else:
        args += ["--seconds", str(seconds)]
    out = run_driver(["taskset", "-c", str(cpu), os.path.join(BIN, "obsbench"), args[0], "--target", kind,
                      "--socket", server.socket, *args[1:]], "obsbench")
    return parse_pairs(out)


def busbench(path, cpu, scenario, server, seconds):
    out = run_driver(["taskset", "-c", str(cpu), path, "--proto", "redis", "--socket", server.socket,
                      "--server-pid", str(server.pid), "--duration", str(seconds), "--timeout", "120",
                      *scenario.busbench], "busbench")
    pairs = parse_pairs(out)
    if "status=ok" not in out:
        raise RuntimeError(f"busbench did not report status=ok:\n{out}")
    return pairs


def busy_cpus(interval=1.0):
    """CPUs in use by anything over `interval` seconds (/proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle
    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    hz = os.sysconf("SC_CLK_TCK")
    return ((t1 - t0) - (i1 - i0)) / hz / interval


class Quiet:
    """--wait-idle: before each round, wait (up to `limit` seconds) until the rest of the
    machine uses less than `threshold` CPUs, so that a round shares the machine as little
    as possible with other work; counts the rounds that had to start anyway."""

    def __init__(self, limit, threshold=0.3):
        self.limit, self.threshold = limit, threshold
        self.rounds = self.forced = 0
        self.waited = 0.0

    def __call__(self):
        if not self.limit:
            return
        self.rounds += 1
        start = time.time()
        while busy_cpus() >= self.threshold:
            if time.time() - start > self.limit:
                self.forced += 1
                break
        self.waited += time.time() - start

    def describe(self):
        if not self.limit:
            return ""
        return (f"each round started once the machine was idle (< {self.threshold:g} CPU busy for 1 s; "
                f"{self.forced} of {self.rounds} rounds started anyway after {self.limit:g} s)")


# ---------------------------------------------------------------- reporting

def median(xs):
    return statistics.median(xs) if xs else float("nan")


def number(x, unit):
    if x != x:
        return "–"
    if unit == "µs" or x < 100:
        return f"{x:,.1f}"
    return f"{x:,.0f}"


def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    virt = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Hypervisor vendor:\s*(\S+)", lscpu)
        virt = f", {m.group(1)} guest" if m else ""
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs{virt}, Linux {platform.release()}"


def revision():
    try:
        rev = sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True).stdout.strip()
        dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line():
    return os.environ.get("BENCH_COMMAND") or "bench/bench.py " + shlex.join(sys.argv[1:])


class Report:
    """Prints as it goes and keeps every line, for --out."""

    def __init__(self):
        self.lines = []

    def __call__(self, line=""):
        print(line, flush=True)
        self.lines.append(line)


# ------------------------------------------------------------- obsd vs Redis

def bench(args, report):
    todo = [s for s in scenarios() if args.only in (None, s.family)]
    report("| scenario | obsd | Redis | obsd/Redis | notes |")
    report("|---|---:|---:|---:|---|")
    rows = []
    for s in todo:
        samples = []  # per round: {"obsd": pairs, "redis": pairs}
        for r in range(args.rounds):
            args.quiet()
            order = ["obsd", "redis"] if r % 2 == 0 else ["redis", "obsd"]
            result = {}
            for kind in order:
                with Server(kind, s.persistence, args.server_cpu) as server:
                    result[kind] = obsbench(args.load_cpu, s, kind, server, args.seconds)
            samples.append(result)
        for m in s.metrics:
            obsd = [float(x["obsd"][m.key]) for x in samples]
            redis = [float(x["redis"][m.key]) for x in samples]
            notes = []
            if s.persistence != "memory" or s.family == "writes":
                notes.append(f"obsd fsyncs/s {median([float(x['obsd']['fsyncs/s']) for x in samples]):.1f}")
            cpu = {k: max(float(x[k].get("loadgen-cpu", 0)) for x in samples) for k in ("obsd", "redis")}
            if s.family != "idle":
                notes.append(f"loadgen CPU ≤ {cpu['obsd']:.0f} % / {cpu['redis']:.0f} %")
            if m.lower_is_better:
                notes.append("lower is better")
            row = {"name": s.name, "family": s.family, "scenario": s.label + m.label, "unit": m.unit,
                   "subscribers": s.subscribers, "obsd": median(obsd), "redis": median(redis),
                   "ratio": median([o / r for o, r in zip(obsd, redis) if r]), "rounds": {"obsd": obsd, "redis": redis},
                   "note": "; ".join(notes)}
            rows.append(row)
            report(f"| {row['scenario']} ({row['unit']}) | {number(row['obsd'], m.unit)} | {number(row['redis'], m.unit)} "
                   f"| {row['ratio']:.2f} | {row['note']} |")
    return rows


def text_chart(rows, report, width=40):
    """Bars of events/s by subscribers, both servers, for the fan-out and keyed families."""
    series = [r for r in rows if r["family"] in ("fanout", "keyed") and r["unit"] == "events/s"]
    if not series:
        return
    top = max(max(r["obsd"], r["redis"]) for r in series) or 1
    lines = []
    for family, title in (("fanout", "fan-out, 64 in flight"), ("keyed", "keyed, 64 in flight")):
        fam = [r for r in series if r["family"] == family]
        if not fam:
            continue
        lines += [""] if lines else []
        lines.append(f"events/s by subscribers — {title}")
        for r in fam:
            for kind, name in (("obsd", "obsd "), ("redis", "Redis")):
                bar = "█" * max(1, round(r[kind] / top * width))
                lines.append(f"{r['subscribers']:>6,} {name} {bar} {r[kind] / 1e6:.2f} M")
    for line in ["```"] + lines + ["```"]:
        report(line)


def svg_chart(rows, path):
    """events/s against subscribers (log scale), obsd and Redis, fan-out solid, keyed dashed."""
    series = [r for r in rows if r["family"] in ("fanout", "keyed") and r["unit"] == "events/s"]
    if not series:
        return False
    import math
    w, h, left, right, top, bottom = 640, 360, 70, 150, 30, 50
    xs = sorted({r["subscribers"] for r in series})
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    ymax = max(max(r["obsd"], r["redis"]) for r in series)
    step = 10 ** math.floor(math.log10(ymax)) if ymax > 0 else 1
    ymax = math.ceil(ymax / step) * step if ymax > 0 else 1

    def px(n):
        return left + (0 if hi == lo else (math.log10(n) - lo) / (hi - lo)) * (w - left - right)

    def py(v):
        return top + (1 - v / ymax) * (h - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">delivered events/s against subscribers (64 writes in flight)</text>']
    for i in range(0, int(round(ymax / step)) + 1):
        v = i * step
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{w - right}" y2="{py(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v / 1e6:g} M</text>')
    for n in xs:
        out.append(f'<text x="{px(n):.1f}" y="{h - bottom + 18}" text-anchor="middle">{n:,}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">subscribers</text>')
    colors = {"obsd": "#d62728", "redis": "#1f77b4"}
    legend_y = top + 10
    for family, dash in (("fanout", ""), ("keyed", ' stroke-dasharray="6 4"')):
        for kind, name in (("obsd", "obsd"), ("redis", "Redis")):
            pts = [(px(r["subscribers"]), py(r[kind])) for r in series if r["family"] == family]
            if not pts:
                continue
            out.append(f'<polyline fill="none" stroke="{colors[kind]}" stroke-width="2"{dash} points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colors[kind]}"/>' for x, y in pts]
            lx = w - right + 12
            out.append(f'<line x1="{lx}" y1="{legend_y}" x2="{lx + 24}" y2="{legend_y}" stroke="{colors[kind]}" stroke-width="2"{dash}/>')
            out.append(f'<text x="{lx + 30}" y="{legend_y + 4}">{name} {"fan-out" if family == "fanout" else "keyed"}</text>')
            legend_y += 18
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True


# --------------------------------------------------------- driver calibration

def calibrate(args, report):
    bb = os.path.join(args.busbench, "busbench")
    sh(["make", "-s", "-C", args.busbench, "busbench"], stdout=subprocess.DEVNULL)
    todo = [s for s in scenarios() if s.busbench and args.only in (None, s.family)]
    report("| scenario | metric | busbench | obsbench | obsbench/busbench | within 10 % | driver CPU busbench / obsbench "
           "| other load (CPUs) |")
    report("|---|---|---:|---:|---:|:---:|---|---:|")
    rows = []
    for s in todo:
        samples = []
        for r in range(args.rounds):
            args.quiet()
            order = ["busbench", "obsbench"] if r % 2 == 0 else ["obsbench", "busbench"]
            result = {}
            with Server("redis", s.persistence, args.server_cpu) as server:
                for driver in order:
                    if driver == "busbench":
                        result[driver] = busbench(bb, args.load_cpu, s, server, args.seconds)
                    else:
                        result[driver] = obsbench(args.load_cpu, s, "redis", server, args.seconds)
            samples.append(result)
        for m in s.metrics:
            b = [float(x["busbench"][m.busbench]) for x in samples]
            o = [float(x["obsbench"][m.key]) for x in samples]
            ratio = median([y / x for x, y in zip(b, o) if x])
            cpu_b = median([float(x["busbench"].get("drv_cpu", "nan")) * 100 for x in samples])
            cpu_o = median([float(x["obsbench"].get("loadgen-cpu", "nan")) for x in samples])
            # busbench's other_cpu: CPU used by everything else on the machine during its run.
            other = median([float(x["busbench"].get("other_cpu", "nan")) for x in samples])
            ok = abs(ratio - 1) <= 0.10
            row = {"name": s.name, "scenario": s.label, "metric": m.key, "unit": m.unit, "busbench": median(b),
                   "obsbench": median(o), "ratio": ratio, "within": ok, "rounds": {"busbench": b, "obsbench": o},
                   "cpu": {"busbench": cpu_b, "obsbench": cpu_o}, "other_cpu": other}
            rows.append(row)
            report(f"| {s.name}: {s.label} | {m.key} ({m.unit}) | {number(median(b), m.unit)} | {number(median(o), m.unit)} "
                   f"| {ratio:.2f} | {'yes' if ok else '**no**'} | {cpu_b:.0f} % / {cpu_o:.0f} % | {other:.2f} |")
    within = sum(r["within"] for r in rows)
    report()
    report(f"{within} of {len(rows)} figures within 10 % of busbench's (median of {args.rounds} per-round ratios).")
    return rows


# --------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (each runs both systems once)")
    parser.add_argument("--seconds", type=float, default=3, help="measured seconds per run")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--only", choices=FAMILIES, help="run one scenario family")
    parser.add_argument("--calibrate", action="store_true",
                        help="compare obsbench with busbench against the same Redis instead of obsd with Redis")
    parser.add_argument("--busbench", default=DEFAULT_BUSBENCH, help="busbench's directory (built with make)")
    parser.add_argument("--out", help="also write results.md, results.json and (bench) pubsub.svg into this directory")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before each round, wait up to SECONDS for the rest of the machine to go idle "
                             "(a shared machine); the table's footer says how many rounds started anyway")
    args = parser.parse_args()
    args.quiet = Quiet(args.wait_idle)

    ensure_redis()
    redis_version = sh(["redis-server", "--version"], capture_output=True).stdout.split()[2].removeprefix("v=")
    report = Report()
    what = "obsbench against busbench, both driving Redis" if args.calibrate else "obsd against Redis"
    report(f"**{what}**, {time.strftime('%Y-%m-%d')}: {machine()}; Redis {redis_version}; obsd {revision()}; "
           f"server pinned to CPU {args.server_cpu}, load generator to CPU {args.load_cpu}; "
           f"{args.rounds} rounds × {args.seconds:g} s, medians. Command: `{command_line()}`")
    report()
    rows = calibrate(args, report) if args.calibrate else bench(args, report)
    if args.quiet.describe():
        report()
        report(f"Rounds: {args.quiet.describe()}.")
    if not args.calibrate:
        report()
        text_chart(rows, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "calibration" if args.calibrate else "results"
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write("\n".join(report.lines) + "\n")
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(rows, f, indent=2)
        if not args.calibrate and svg_chart(rows, os.path.join(args.out, "pubsub.svg")):
            print(f"chart: {os.path.join(args.out, 'pubsub.svg')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
