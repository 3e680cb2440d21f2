#!/usr/bin/env python3
"""A slow subscriber, with and without `coalesce` (issue 15's benchmark; not a timed test).

One writer sets keys k0…k{K-1} round-robin at a steady rate against a release obsd
(--in-memory, small queue so the limit is reached within seconds). In each run one
subscriber watches the whole repository and reads ten times slower than the write rate
(it consumes at most rate/10 events per second). Three runs, one daemon each:

  baseline   no subscriber: what the writes alone cost the daemon
  plain      a plain subscription: its queue fills, it gets `overflow` and is cut off
  coalesce   `coalesce: true`: never cut off; once the writer stops it reads at full speed
             and must end with exactly the repository's state (checked against `list`)

Reported per run: the daemon's RSS every few seconds, its CPU, the writes acknowledged
(the writer must not be slowed), the events and changes the subscriber received, whether
it was cut off, and whether its final state is the repository's.

Usage: bench/coalesce.py [--seconds 20] [--rate 20000] [--keys 1000]
       (build first: swift build -c release)
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class Lines:
    """Line reader over a blocking socket."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def next(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def request(path, message):
    s = connect(path)
    s.sendall(json.dumps(message).encode() + b"\n")
    reply = json.loads(Lines(s).next())
    s.close()
    return reply


def proc_sample(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, cpu


class Writer(threading.Thread):
    """Sets keys round-robin at `rate` per second, pipelined; counts acknowledgements."""

    def __init__(self, path, rate, keys, seconds):
        super().__init__(daemon=True)
        self.sock = connect(path)
        self.rate, self.keys, self.seconds = rate, keys, seconds
        self.sent = self.acked = self.last_rev = 0
        self.errors = []
        self.reader = threading.Thread(target=self.read_replies, daemon=True)

    def read_replies(self):
        lines = Lines(self.sock)
        while True:
            line = lines.next()
            if line is None:
                return
            reply = json.loads(line)
            if reply.get("ok"):
                self.acked += 1
                self.last_rev = max(self.last_rev, reply.get("rev", 0))
            else:
                self.errors.append(reply)

    def run(self):
        self.reader.start()
        start = time.monotonic()
        tick = 0.01
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= self.seconds:
                break
            due = int(elapsed * self.rate) + int(tick * self.rate)
            chunk = []
            while self.sent < due:
                i = self.sent
                chunk.append(b'{"id":%d,"op":"set","repo":"bench","key":"k%d","value":%d}\n' % (i, i % self.keys, i))
                self.sent += 1
            if chunk:
                self.sock.sendall(b"".join(chunk))
            time.sleep(tick)
        deadline = time.monotonic() + 30
        while self.acked + len(self.errors) < self.sent and time.monotonic() < deadline:
            time.sleep(0.01)


class Subscriber(threading.Thread):
    """Reads the whole repository's events at most `rate` per second until told to hurry."""

    def __init__(self, path, coalesce, rate):
        super().__init__(daemon=True)
        self.sock = connect(path)
        self.coalesce, self.rate = coalesce, rate
        self.events = self.changes = self.folded = 0
        self.state = {}
        self.last_rev = 0
        self.cut_off_at = None
        self.hurry = False
        self.start_time = time.monotonic()

    def run(self):
        lines = Lines(self.sock)
        message = {"id": 1, "op": "subscribe", "repo": "bench"}
        if self.coalesce:
            message["coalesce"] = True
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        started = time.monotonic()
        while True:
            line = lines.next()
            if line is None:
                if self.cut_off_at is None:
                    self.cut_off_at = time.monotonic() - self.start_time
                return
            m = json.loads(line)
            if m.get("event") == "overflow":
                self.cut_off_at = time.monotonic() - self.start_time
                continue
            if m.get("event") != "change":
                continue
            self.events += 1
            if "from" in m:
                self.folded += 1
            self.last_rev = m["rev"]
            for c in m["changes"]:
                self.changes += 1
                if "new" in c:
                    self.state[c["key"]] = c["new"]
                else:
                    self.state.pop(c["key"], None)
            if not self.hurry:
                ahead = self.events / self.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)


def run(args, kind):
    obsd = os.path.join(args.build, "obsd")
    with tempfile.TemporaryDirectory(prefix="obsd-coalesce-") as tmp:
        path = os.path.join(tmp, "obsd.sock")
        cmd = [obsd, "--socket", path, "--in-memory", "--threads", "1",
               "--queue-bytes", str(args.queue_bytes), "--overflow-grace", "5"]
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(1000):  # until it accepts
                try:
                    connect(path).close()
                    break
                except OSError:
                    time.sleep(0.01)
            request(path, {"id": 0, "op": "set", "repo": "bench", "key": "k0", "value": -1})
            subscriber = None
            if kind != "baseline":
                subscriber = Subscriber(path, kind == "coalesce", args.rate / 10)
                subscriber.start()
                time.sleep(0.2)
            writer = Writer(path, args.rate, args.keys, args.seconds)
            rss0, cpu0 = proc_sample(daemon.pid)
            start = time.monotonic()
            writer.start()
            timeline = []
            while writer.is_alive():
                rss, _ = proc_sample(daemon.pid)
                timeline.append((time.monotonic() - start, rss))
                time.sleep(1)
            writer.join()
            write_seconds = time.monotonic() - start
            rss_end, cpu_end = proc_sample(daemon.pid)
            result = {
                "kind": kind, "writes": writer.acked, "write_errors": len(writer.errors),
                "writes_per_s": writer.acked / write_seconds, "final_rev": writer.last_rev,
                "rss_start_kb": rss0, "rss_peak_kb": max(r for _, r in timeline + [(0, rss_end)]),
                "rss_end_kb": rss_end, "cpu_s": cpu_end - cpu0,
                "timeline": [(round(t), r) for t, r in timeline],
            }
            if subscriber:
                result["events_while_writing"] = subscriber.events
                if kind == "coalesce":
                    subscriber.hurry = True
                    deadline = time.monotonic() + 60
                    while subscriber.last_rev < writer.last_rev and time.monotonic() < deadline:
                        time.sleep(0.05)
                    listed = request(path, {"id": 2, "op": "list", "repo": "bench", "values": True})
                    result["caught_up"] = subscriber.last_rev >= writer.last_rev
                    result["state_correct"] = subscriber.state == listed["values"] and listed["rev"] == subscriber.last_rev
                else:
                    subscriber.join(timeout=30)
                result.update(events=subscriber.events, changes=subscriber.changes,
                              coalesced_events=subscriber.folded, cut_off_at_s=subscriber.cut_off_at)
            return result
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rate", type=int, default=20000, help="writes per second")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--queue-bytes", type=int, default=1 << 20, help="the daemon's --queue-bytes")
    p.add_argument("--build", default=os.path.join(HERE, "..", ".build", "release"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    results = [run(args, kind) for kind in ("baseline", "plain", "coalesce")]
    print(f"**Slow subscriber, plain and coalescing** — {time.strftime('%Y-%m-%d')}; writer {args.rate} sets/s "
          f"for {args.seconds:g} s over {args.keys} keys; subscriber reads ≤ {args.rate // 10} events/s; "
          f"obsd --in-memory --threads 1 --queue-bytes {args.queue_bytes} --overflow-grace 5. "
          f"Command: `{' '.join(['bench/coalesce.py'] + sys.argv[1:])}`\n")
    print("| run | writes acked (/s) | daemon CPU s | RSS start → peak → end (MB) | events received | changes | cut off | final state |")
    print("|---|---:|---:|---|---:|---:|---|---|")
    for r in results:
        rss = f"{r['rss_start_kb'] / 1024:.0f} → {r['rss_peak_kb'] / 1024:.0f} → {r['rss_end_kb'] / 1024:.0f}"
        cut = "—" if r["kind"] == "baseline" else ("after %.1f s" % r["cut_off_at_s"] if r.get("cut_off_at_s") else "never")
        state = {"baseline": "—", "plain": "lost (cut off)"}.get(r["kind"])
        if r["kind"] == "coalesce":
            state = "= repository (rev %d)" % r["final_rev"] if r.get("state_correct") else "**WRONG**"
        print(f"| {r['kind']} | {r['writes']:,} ({r['writes_per_s']:,.0f}) | {r['cpu_s']:.1f} | {rss} "
              f"| {r.get('events', '—'):,} | {r.get('changes', '—'):,} | {cut} | {state} |"
              if r["kind"] != "baseline" else
              f"| {r['kind']} | {r['writes']:,} ({r['writes_per_s']:,.0f}) | {r['cpu_s']:.1f} | {rss} | — | — | — | — |")
    print("\nRSS over time (MB): " + "; ".join(
        r["kind"] + " " + " ".join(f"{r_kb / 1024:.0f}" for t, r_kb in r["timeline"][::max(1, len(r["timeline"]) // 10)])
        for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if r["write_errors"] or (r["kind"] == "coalesce" and not r.get("state_correct"))]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
