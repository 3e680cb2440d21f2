"""Reading a run back: the fault log (daemon incarnations, stalls, data generations, faults)
and the client histories (wire.py's format), connection by connection, each request paired
with its reply in order. Files are read one at a time (`connections(path)`), so the validators
can go over a long run in two passes without holding every event at once."""

import bisect
import json
import os
from collections import deque

from .wire import decode


class Req:
    __slots__ = ("t", "obj", "ln", "rt", "rep", "rln", "idx", "line")

    def __init__(self, t, obj, ln, idx, line):
        self.t = t
        self.obj = obj
        self.ln = ln
        self.idx = idx
        self.rt = None
        self.rep = None
        self.rln = None
        self.line = line

    @property
    def op(self):
        return self.obj.get("op") if isinstance(self.obj, dict) else None

    @property
    def ok(self):
        return self.rep is not None and self.rep.get("ok") is True

    @property
    def code(self):
        if self.rep is None or self.rep.get("ok"):
            return None
        return (self.rep.get("error") or {}).get("code")

    @property
    def message(self):
        return ((self.rep or {}).get("error") or {}).get("message", "")


class Connection:
    """One connection's life: requests (with replies), the received messages in order
    (`items`: (t, kind, obj, ln) with kind "rep" (obj is the Req) or "ev"), how it ended."""

    __slots__ = ("name", "client", "file", "daemon", "t_open", "t_end", "end", "why", "reqs", "items", "partial",
                 "half", "inc", "notes", "unpaired")

    def __init__(self, name, file):
        self.name = name
        self.client = name.rsplit(".", 1)[0]
        self.file = file
        self.daemon = 0
        self.t_open = None
        self.t_end = None
        self.end = None
        self.why = None
        self.reqs = []
        self.items = []
        self.partial = None
        self.half = None
        self.inc = None
        self.notes = []
        self.unpaired = []


NOTES = {}  # history file -> [(t, client, data)]: the client's own notes (its pid, its count)


def connections(path):
    """Every connection of one history file, in the order they were opened."""
    conns = {}
    order = []
    pending = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for ln, line in enumerate(f, 1):
            line = line.rstrip("\n")
            sp1 = line.find(" ")
            sp2 = line.find(" ", sp1 + 1)
            if sp1 < 0 or sp2 < 0:
                continue
            t = int(line[:sp1])
            name = line[sp1 + 1:sp2]
            kind = line[sp2 + 1:sp2 + 2]
            data = line[sp2 + 3:]
            c = conns.get(name)
            if c is None:
                if kind == "M":
                    NOTES.setdefault(path, []).append((t, name, data))
                    continue
                c = Connection(name, path)
                conns[name] = c
                order.append(c)
                pending[name] = deque()
            if kind == "O":
                info = decode(data)
                c.daemon = info["daemon"]
                c.t_open = t
            elif kind == ">":
                try:
                    obj = decode(data)
                except ValueError:
                    obj = None
                r = Req(t, obj, ln, len(c.reqs), len(data.encode()) if len(data) > 60000 else len(data))
                c.reqs.append(r)
                pending[name].append(r)
            elif kind == "<":
                try:
                    obj = decode(data)
                except ValueError:
                    c.unpaired.append((t, data, ln))
                    continue
                if "event" in obj:
                    c.items.append((t, "ev", obj, ln))
                else:
                    q = pending[name]
                    if q:
                        r = q.popleft()
                        r.rt = t
                        r.rep = obj
                        r.rln = ln
                        c.items.append((t, "rep", r, ln))
                    else:
                        c.unpaired.append((t, obj, ln))
            elif kind == "P":
                c.partial = (t, decode(data), ln)
            elif kind == "H":
                c.half = t
            elif kind in ("E", "R", "X"):
                c.t_end = t
                c.end = kind
                c.why = data
            elif kind == "M":
                c.notes.append((t, data, ln))
            elif kind == "F":
                c.end = "F"
    return order


class Timeline:
    """The fault log: daemon incarnations (spawn, serving, end), data generations, stalls
    (SIGSTOP → SIGCONT), etcd faults, injected faults."""

    def __init__(self, path):
        self.incs = {}  # daemon -> list of dicts (sorted by spawn)
        self.stalls = {}  # daemon -> [(t0, t1)]
        self.faults = []
        self.etcd_faults = []
        self.generation_changes = []  # (t, gen)
        self.notes = []
        self.traffic = {}
        self.disk_real = False
        self.proxy_pid = None
        gen = 0
        # Repairs (`obsd --repair-log` after a `truncate`) so far: a repair cuts grants and
        # ends of leases away with the log, so the leases of the incarnations after it are
        # another set than those before, though the ids go on (see Ctx.lease_gen_of).
        repairs = 0
        stop_at = {}
        open_etcd = {}
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                ev = e.get("event")
                if ev == "generation":
                    gen = e["gen"]
                    self.generation_changes.append((e["t"], gen))
                elif ev == "spawn":
                    self.incs.setdefault(e["daemon"], []).append(
                        {"inc": e["inc"], "spawn": e["t"], "serving": None, "end": None, "gen": gen, "repairs": repairs,
                         "args": e.get("args", []), "how": None})
                elif ev == "repair":
                    repairs += 1
                elif ev == "serving":
                    self._inc(e["daemon"], e["inc"])["serving"] = e["t"]
                elif ev in ("kill", "term"):
                    i = self._inc(e["daemon"], e["inc"])
                    i["how"] = i["how"] or ev
                    i["stop_t"] = i.get("stop_t") or e["t"]
                elif ev == "exit":
                    i = self._inc(e["daemon"], e["inc"])
                    i["end"] = e["t"]
                    i["rc"] = e.get("rc")
                    if i["how"] is None:
                        i["how"] = "crash"  # died by a failpoint (or on its own)
                        i["stop_t"] = e["t"]
                elif ev == "sigstop":
                    stop_at[e["daemon"]] = e["t"]
                elif ev == "sigcont":
                    t0 = stop_at.pop(e["daemon"], None)
                    if t0 is not None:
                        self.stalls.setdefault(e["daemon"], []).append((t0, e["t"]))
                elif ev == "fault":
                    if e["phase"] == "start":
                        self.faults.append({"kind": e["kind"], "params": e["params"], "t0": e["t"], "t1": None})
                    else:
                        for fl in reversed(self.faults):
                            if fl["t0"] == e.get("started"):
                                fl["t1"] = e["t"]
                                break
                elif ev in ("etcd-kill", "etcd-sigstop"):
                    open_etcd[e["member"]] = e["t"]
                elif ev in ("etcd-spawn", "etcd-sigcont"):
                    t0 = open_etcd.pop(e.get("member"), None)
                    if t0 is not None:
                        self.etcd_faults.append((t0, e["t"]))
                elif ev == "traffic":
                    self.traffic[e["phase"]] = e["t"]
                elif ev == "proxy":
                    self.proxy_pid = e["pid"]
                elif ev == "disk":
                    self.disk_real = e.get("real", False)
                elif ev in ("fault-note", "start-failed"):
                    self.notes.append(e)
        for d, incs in self.incs.items():
            incs.sort(key=lambda i: i["spawn"])
            self._spawns = None
        self.spawn_index = {d: [i["spawn"] for i in incs] for d, incs in self.incs.items()}

    def _inc(self, d, n):
        for i in self.incs.get(d, []):
            if i["inc"] == n:
                return i
        raise KeyError((d, n))

    def incarnation(self, daemon, t):
        """The incarnation a connection opened at `t` reached (the last spawned before it)."""
        spawns = self.spawn_index.get(daemon, [])
        k = bisect.bisect_right(spawns, t) - 1
        if k < 0:
            return None
        return self.incs[daemon][k]

    def stalled(self, daemon, t0, t1):
        """Seconds of [t0, t1] (ns) during which `daemon` was stopped (SIGSTOP) or down, or its
        disk failed (the suite's EIO and full-disk windows, with the restart that may follow:
        no revision can be stored then, a lease's end included)."""
        total = 0
        for f in self.faults:
            if f["kind"] in ("eio", "diskfull") and f["t1"] is not None and f["params"].get("daemon", 0) == daemon:
                total += max(0, min(f["t1"], t1) - max(f["t0"], t0))
        for a, b in self.stalls.get(daemon, []):
            total += max(0, min(b, t1) - max(a, t0))
        incs = self.incs.get(daemon, [])
        for i, inc in enumerate(incs):
            if i + 1 < len(incs):
                down0 = inc.get("stop_t") or inc["end"]
                down1 = incs[i + 1]["serving"] or incs[i + 1]["spawn"]
                if down0 is not None and down1 is not None:
                    total += max(0, min(down1, t1) - max(down0, t0))
        return total / 1e9

    def etcd_fault_between(self, t0, t1, slack_ns=0):
        return any(a <= t1 + slack_ns and b + slack_ns >= t0 for a, b in self.etcd_faults) or any(
            f["kind"].startswith("etcd_") and f["t0"] <= t1 + slack_ns and (f["t1"] or f["t0"]) + slack_ns >= t0
            for f in self.faults)


def history_files(run_dir):
    return sorted(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.startswith("h-") and f.endswith(".log"))
