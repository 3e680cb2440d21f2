"""A client process of the robustness suite: one role, seeded, speaking raw line-JSON to the
daemon(s) and recording everything (wire.py). Run as `python3 -m obsrobust.client CONFIG.json`
by the orchestrator (run.py); the roles and what each does are described in ../README.md.

Every random choice comes from the client's own `random.Random(seed)`, the seed derived from
the run's seed and the client's name: the same seed gives the same decisions in the same order
(what the daemon answers, and so what follows, depends on timing).
"""

import heapq
import json
import os
import random
import selectors
import sys
import time

from . import wire
from .wire import Conn, Recorder, now_ns

POOL = [0, 1, 1.0, -5, 2.5, "a", "b", "é", True, False, None, [1, 2], [1.0, 2],
        {"x": 1, "y": 2}, {"y": 2, "x": 1}, {"x": 1.0, "y": 2}, {"n": {"m": [True, None]}}]


class Runner:
    """The process's event loop: connections, timers, the traffic and drain phases."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.name = cfg["name"]
        self.rng = random.Random(cfg["seed"])
        self.rec = Recorder(cfg["out"])
        self.sel = selectors.DefaultSelector()
        self.masks = {}
        self.conns = []
        self.nconn = 0
        self.timers = []
        self.tseq = 0
        self.start_ns = cfg["start_ns"]
        self.end_ns = cfg["end_ns"]
        self.stop_ns = cfg["stop_ns"]
        # A self-test scenario may end the traffic early: the orchestrator writes the new end
        # (monotonic ns) into this file once what it waits for has happened.
        self.end_file = cfg.get("end_file")
        self.end_checked = 0.0
        self.sockets = cfg["sockets"]
        self.repos = cfg["repos"]
        self.keys = cfg["keys"]
        self.ops = 0

    # Connections

    def connect(self, on_event, on_close, daemon=None):
        if daemon is None:
            daemon = self.rng.randrange(len(self.sockets))
        self.nconn += 1
        c = Conn(f"{self.name}.{self.nconn}", self.rec, daemon, on_event, self._closed(on_close))
        if not c.connect(self.sockets[daemon], daemon):
            return None
        self.conns.append(c)
        self.sel.register(c.sock, selectors.EVENT_READ, c)
        self.masks[c] = selectors.EVENT_READ
        return c

    def early_end(self):
        try:
            with open(self.end_file) as f:
                end = int(f.read().strip())
        except (OSError, ValueError):
            return
        if end < self.end_ns:
            drain = self.stop_ns - self.end_ns
            self.end_ns = end
            self.stop_ns = end + drain

    def _closed(self, on_close):
        def closed(c):
            if c in self.masks:
                try:
                    self.sel.unregister(c.sock)
                except (KeyError, ValueError, OSError):
                    pass
                del self.masks[c]
            if c in self.conns:
                self.conns.remove(c)
            if on_close:
                on_close(c)
        return closed

    def later(self, delay_s, fn):
        self.tseq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay_s, self.tseq, fn))

    # The loop

    def run(self, role):
        self.rec.add(now_ns(), self.name, "M", wire.encode({"pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid()}))
        role.start(self)
        phase = "traffic"
        while True:
            t = now_ns()
            if self.end_file and phase == "traffic" and time.monotonic() - self.end_checked >= 0.1:
                self.end_checked = time.monotonic()
                self.early_end()
            if phase == "traffic" and t >= self.end_ns:
                phase = "drain"
                role.drain(self)
            if t >= self.stop_ns:
                break
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn = heapq.heappop(self.timers)
                fn()
            if phase == "traffic":
                role.tick(self)
            else:
                role.drain_tick(self)
            for c in list(self.conns):
                if c.out:
                    c.on_writable()
                if not c.alive:
                    continue
                want = (selectors.EVENT_READ if c.reading else 0) | (selectors.EVENT_WRITE if c.out else 0)
                if want != self.masks.get(c, 0):
                    if want == 0:
                        self.sel.unregister(c.sock)
                        del self.masks[c]
                    elif c in self.masks:
                        self.sel.modify(c.sock, want, c)
                        self.masks[c] = want
                    else:
                        self.sel.register(c.sock, want, c)
                        self.masks[c] = want
            timeout = 0.005
            if self.timers:
                timeout = max(0.0, min(timeout, self.timers[0][0] - time.monotonic()))
            if self.masks:
                for key, mask in self.sel.select(timeout):
                    c = key.data
                    if mask & selectors.EVENT_READ and c.alive:
                        c.on_readable()
                    if mask & selectors.EVENT_WRITE and c.alive:
                        c.on_writable()
            else:
                time.sleep(timeout)
        for c in list(self.conns):
            c.close("end of run")
        self.rec.add(now_ns(), self.name, "M", wire.encode({"ops": self.ops}))
        self.rec.close()


class Bucket:
    """A token bucket: at most `rate` operations a second, bursts up to `burst`."""

    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = 0.0
        self.t = time.monotonic()

    def take(self, most):
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        n = min(most, int(self.tokens))
        self.tokens -= n
        return n


def value_for(rng, name, seq):
    """A value: from the shared pool (equal values, no-op writes, changes back) or unique
    (so that the validators can tell which write made a revision)."""
    r = rng.random()
    if r < 0.35:
        return rng.choice(POOL)
    if r < 0.9:
        return f"{name}/{seq}"
    return {"w": name, "n": seq, "t": [seq, seq % 3 == 0]}


class Writer:
    """Pipelined sets, deletes, batches, gets and lists on a small key space, with ifRev and
    force; now and then a line cut in the middle, a half-close, a malformed or too long line."""

    def __init__(self, cfg):
        self.depth = cfg.get("depth", 32)
        self.bucket = Bucket(cfg.get("rate", 500), cfg.get("depth", 32))
        self.conn = None
        self.revs = {}
        self.seq = 0
        self.retry_at = 0.0
        self.halfclosing = None
        self.large = cfg.get("max_line", 65536) + 100

    def start(self, r):
        pass

    def closed(self, c):
        if c is self.halfclosing:
            self.halfclosing = None
        if c is self.conn:
            self.conn = None

    def ensure(self, r):
        if self.conn is not None and self.conn.alive:
            return True
        now = time.monotonic()
        if now < self.retry_at:
            return False
        self.conn = r.connect(lambda c, m, t: None, self.closed)
        if self.conn is None:
            self.retry_at = now + 0.02
            return False
        return True

    def reply(self, req, rep):
        if rep is None or not rep.get("ok"):
            return
        op = req["op"]
        if op == "get":
            self.revs[(req["repo"], req["key"])] = rep.get("rev", 0)
        elif op in ("set", "delete") and rep.get("changed"):
            self.revs[(req["repo"], req["key"])] = rep["rev"] if op == "set" else 0

    def tick(self, r):
        if not self.ensure(r):
            return
        c = self.conn
        rng = r.rng
        budget = self.bucket.take(self.depth - c.in_flight)
        while budget > 0 and c.alive:
            budget -= 1
            x = rng.random()
            if x < 0.0003:
                c.cut_mid_line(self.write_op(r))
                return
            if x < 0.0005:
                # Half-close: what was sent is answered, then end of file.
                for _ in range(rng.randrange(1, 6)):
                    c.request(self.write_op(r), self.reply)
                c.half_close()
                self.halfclosing = c
                self.conn = None
                return
            if x < 0.00055:
                c.raw_line('{"id":"big","op":"set","repo":"r0","key":"big","value":"' + "x" * self.large + '"}')
                continue
            if x < 0.0015:
                c.raw_line(rng.choice(['{"op":"set","repo":', '[1,2]', '{"id":1,"op":"get",}', '"text"']))
                continue
            y = rng.random()
            if y < 0.55:
                req = self.write_op(r)
            elif y < 0.8:
                req = {"op": "get", "repo": rng.choice(r.repos), "key": rng.choice(r.keys)}
            elif y < 0.95:
                req = {"op": "list", "repo": rng.choice(r.repos)}
                if rng.random() < 0.5:
                    req["prefix"] = rng.choice(["k0", "k1", "p/", "", "q"])
                if rng.random() < 0.7:
                    req["values"] = True
            else:
                req = {"op": rng.choice(["repos", "ping", "hello", "stats"])}
            c.request(req, self.reply)
            r.ops += 1

    def write_op(self, r):
        rng = r.rng
        repo = rng.choice(r.repos)
        self.seq += 1
        y = rng.random()
        if y < 0.7:
            key = rng.choice(r.keys)
            req = {"op": "set", "repo": repo, "key": key, "value": value_for(rng, r.name, self.seq)}
            if rng.random() < 0.15:
                req["ifRev"] = self.if_rev(rng, repo, key)
            if rng.random() < 0.05:
                req["force"] = True
            return req
        if y < 0.85:
            key = rng.choice(r.keys)
            req = {"op": "delete", "repo": repo, "key": key}
            if rng.random() < 0.15:
                req["ifRev"] = self.if_rev(rng, repo, key)
            return req
        ops = []
        for key in rng.sample(r.keys, rng.randrange(0, 6)):
            self.seq += 1
            if rng.random() < 0.75:
                op = {"op": "set", "key": key, "value": value_for(rng, r.name, self.seq)}
                if rng.random() < 0.05:
                    op["force"] = True
            else:
                op = {"op": "delete", "key": key}
            if rng.random() < 0.1:
                op["ifRev"] = self.if_rev(rng, repo, key)
            ops.append(op)
        return {"op": "batch", "repo": repo, "ops": ops}

    def if_rev(self, rng, repo, key):
        x = rng.random()
        if x < 0.75:
            return self.revs.get((repo, key), 0)
        if x < 0.9:
            return 0
        return rng.randrange(1, 50)

    def drain(self, r):
        pass

    def drain_tick(self, r):
        pass


class Sub:
    """What a watcher knows of one subscription: its request, and where to resume it."""

    __slots__ = ("spec", "sub", "conn", "last", "epoch", "live", "once", "done")

    def __init__(self, spec):
        self.spec = spec
        self.sub = None
        self.conn = None
        self.last = None
        self.epoch = None
        self.live = False
        self.once = spec.get("once", False)
        self.done = False


class Watcher:
    """Subscriptions of every kind (keys, prefix, all; initial, since with and without epoch,
    once, coalesce, writers, echo false, progress), unsubscribed and resumed from what they saw;
    writes of its own on the same connection (so that `echo: false` has something to skip);
    reconnects that resume every subscription."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.conn = None
        self.subs = {}  # sub id -> Sub (live on self.conn)
        self.parked = []  # Subs to resume on the next connection
        self.retry_at = 0.0
        self.seq = 0
        self.max_subs = cfg.get("max_subs", 5)
        self.bucket = Bucket(cfg.get("rate", 100), 6)
        self.auditor = cfg.get("auditor", False)
        self.catchup = cfg.get("catchup", False)
        self.sync = cfg.get("sync", False)
        # Where subscriptions stood a while ago (time, spec, last, epoch): resumed from there
        # later with `catchup`, past what the history holds — a diff (contract, "Catching up").
        self.old_positions = []
        self.next_note = 0.0
        self.stale_n = 0
        self.repo_rev = {}  # repo -> the highest revision seen in it (replies, events)
        self.history_limit = cfg.get("history_limit", 5000)
        self.next_sync = 0.0

    def start(self, r):
        pass

    def closed(self, c):
        if c is not self.conn:
            return
        for s in self.subs.values():
            if not s.done:
                s.live = False
                self.parked.append(s)
        self.subs = {}
        self.conn = None
        self.retry_at = time.monotonic() + 0.02

    def ensure(self, r):
        if self.conn is not None and self.conn.alive:
            return True
        if time.monotonic() < self.retry_at:
            return False
        self.conn = r.connect(self.event, self.closed, daemon=self.cfg.get("daemon"))
        if self.conn is None:
            self.retry_at = time.monotonic() + 0.02
            return False
        parked, self.parked = self.parked, []
        for s in parked:
            self.subscribe(r, s, resume=True)
        return True

    def new_spec(self, r):
        rng = r.rng
        spec = {"op": "subscribe", "repo": rng.choice(r.repos)}
        x = rng.random()
        if x < 0.4:
            spec["keys"] = rng.sample(r.keys, rng.randrange(1, 5))
        elif x < 0.7:
            spec["prefix"] = rng.choice(["k0", "k1", "p/", "q", ""])
        if rng.random() < 0.15:
            spec["once"] = True
        elif rng.random() < 0.2:
            spec["coalesce"] = True
        for opt, p in (("writers", 0.3), ("progress", 0.35)):
            if rng.random() < p:
                spec[opt] = True
        if rng.random() < 0.3:
            spec["echo"] = False
        return spec

    def subscribe(self, r, s, resume=False, catchup=None):
        req = dict(s.spec)
        rng = r.rng
        # `once` never goes with `catchup` (bad_request), nor does `catchup` without `since`.
        can_catch_up = self.catchup and not s.once
        if resume and s.last is not None:
            req["since"] = s.last
            if s.epoch is not None and (rng.random() < 0.85 or catchup is True):
                req["epoch"] = s.epoch
            if can_catch_up and (catchup if catchup is not None else rng.random() < 0.5):
                req["catchup"] = True
        elif rng.random() < 0.5:
            req["initial"] = True
        elif rng.random() < 0.15:
            # Deliberately bad resumes: another history, or a revision from the future (with
            # `catchup`: a snapshot, never compacted).
            req["since"] = rng.randrange(0, 5)
            if rng.random() < 0.5:
                req["epoch"] = "0" * 32
            if can_catch_up and rng.random() < 0.5:
                req["catchup"] = True
        if self.catchup and "catchup" not in req and rng.random() < 0.05:
            req["catchup"] = False  # the same as leaving it out
        s.conn = self.conn
        s.live = False
        rid = self.conn.request(req, lambda q, rep: self.subscribed(r, s, q, rep))
        if rid is not None:
            r.ops += 1

    def subscribed(self, r, s, req, rep):
        if rep is None:
            # The connection ended before the reply: resume it on the next one.
            if not s.done and s not in self.parked:
                self.parked.append(s)
            return
        if rep.get("ok"):
            s.sub = rep["sub"]
            s.live = True
            s.epoch = rep.get("epoch")
            # A catch-up by diff or snapshot brings the subscription to the reply's revision
            # (which may be below `since`: another history's).
            s.last = req["since"] if "since" in req and rep.get("catchup") in (None, "replay") else rep["rev"]
            self.subs[s.sub] = s
        elif rep.get("error", {}).get("code") == "compacted":
            spec = dict(s.spec)
            s2 = Sub(spec)
            s2.conn = self.conn
            req2 = dict(spec)
            req2["initial"] = True
            if self.conn is not None and self.conn.alive:
                self.conn.request(req2, lambda q, rep2: self.subscribed(r, s2, q, rep2))
                r.ops += 1

    def note_rev(self, q, rep):
        if rep is not None and isinstance(rep.get("rev"), int) and isinstance(q.get("repo"), str):
            if rep["rev"] > self.repo_rev.get(q["repo"], 0):
                self.repo_rev[q["repo"]] = rep["rev"]

    def event(self, c, m, t):
        ev = m["event"]
        s = self.subs.get(m.get("sub"))
        if ev == "overflow":
            for k, v in m.get("revs", {}).items():
                s2 = self.subs.get(int(k))
                if s2 is not None:
                    s2.last = v
            return
        if s is None:
            return
        rev = m.get("rev")
        if rev is not None and (s.last is None or rev > s.last):
            s.last = rev
        if rev is not None and rev > self.repo_rev.get(m.get("repo"), 0):
            self.repo_rev[m.get("repo")] = rev
        if ev == "change" and s.once:
            s.done = True
            s.live = False
            self.subs.pop(s.sub, None)
        elif ev == "revoked":
            s.done = True
            self.subs.pop(s.sub, None)

    def tick(self, r):
        if not self.ensure(r):
            return
        rng = r.rng
        c = self.conn
        if len(self.subs) < self.max_subs and c.in_flight < 4 and rng.random() < 0.05:
            self.subscribe(r, Sub(self.new_spec(r)))
        if self.auditor:
            return
        now = time.monotonic()
        if self.catchup:
            self.stale_resumes(r, now)
        if self.sync and now >= self.next_sync:
            self.next_sync = now + rng.uniform(0.05, 0.5)
            self.sync_request(r)
        x = rng.random()
        if x < 0.01 and self.subs:
            s = rng.choice(list(self.subs.values()))
            del self.subs[s.sub]
            resume = rng.random() < 0.7

            def unsubscribed(q, rep, s=s, resume=resume):
                if rep is not None and rep.get("ok") and resume and self.conn is not None and self.conn.alive:
                    s.done = False
                    self.subscribe(r, s, resume=True)
            c.request({"op": "unsubscribe", "sub": s.sub}, unsubscribed)
            r.ops += 1
        elif x < 0.012:
            c.request({"op": "unsubscribe", "sub": rng.randrange(1000, 2000)})  # not_found
            r.ops += 1
        elif x < 0.0125:
            c.close("watcher reconnects")
            return
        elif x < 0.0128 and self.catchup:
            # catchup: true without since, or with once: bad_request.
            spec = self.new_spec(r)
            if rng.random() < 0.5:
                spec["once"] = True
                spec["since"] = rng.randrange(0, 5)
            else:
                spec["initial"] = True
            spec["catchup"] = True
            c.request(spec)
            r.ops += 1
        elif x < 0.0131 and self.sync:
            # sync without a sub, with one that is not an integer (bad_request), with an unknown one (not_found).
            c.request(rng.choice([{"op": "sync"}, {"op": "sync", "sub": "1"}, {"op": "sync", "sub": rng.randrange(1000, 2000)}]))
            r.ops += 1
        # Writes of its own, on keys it watches.
        for _ in range(self.bucket.take(6 - c.in_flight)):
            self.seq += 1
            repo = rng.choice(r.repos)
            key = rng.choice(r.keys)
            if rng.random() < 0.8:
                req = {"op": "set", "repo": repo, "key": key, "value": value_for(rng, r.name, self.seq)}
            elif rng.random() < 0.5:
                req = {"op": "delete", "repo": repo, "key": key}
            else:
                req = {"op": "get", "repo": repo, "key": key}
            c.request(req, self.note_rev)
            r.ops += 1

    def sync_request(self, r):
        if self.subs and self.conn is not None and self.conn.alive and self.conn.in_flight < 8:
            self.conn.request({"op": "sync", "sub": r.rng.choice(list(self.subs))})
            r.ops += 1

    def stale_resumes(self, r, now):
        """Every 1-3 s notes where a live subscription stands; once its repository has moved
        on by 1.2 histories (--history-limit) — or 40 s later at the latest — subscribes
        again from there with `catchup`: the history no longer reaches back so far, and the
        reply is a diff. The first such resume, and every third after it, names another
        history's epoch: a snapshot. (By revisions, not time: a slow machine makes them all
        the same.)"""
        rng = r.rng
        if now >= self.next_note:
            self.next_note = now + rng.uniform(1.0, 3.0)
            live = [s for s in self.subs.values() if s.live and s.last is not None and not s.once]
            if live and len(self.old_positions) < 8:
                s = rng.choice(live)
                self.old_positions.append((now, dict(s.spec), s.last, s.epoch))
        if self.old_positions and len(self.subs) < self.max_subs + 2 and self.conn.in_flight < 4:
            t, spec, last, epoch = self.old_positions[0]
            moved = self.repo_rev.get(spec["repo"], 0) - last
            if moved > 1.2 * self.history_limit or now - t >= self.cfg.get("stale_after_max", 40.0):
                self.old_positions.pop(0)
                self.stale_n += 1
                s = Sub(spec)
                s.last = last
                s.epoch = "0" * 32 if self.stale_n % 3 == 1 else epoch
                self.subscribe(r, s, resume=True, catchup=True)

    def drain(self, r):
        pass

    def drain_tick(self, r):
        if self.conn is None or not self.conn.alive:
            self.ensure(r)


class Auditor(Watcher):
    """One subscription to every key of every repository (writers, progress), resumed with
    `since` and the epoch after every reconnect: the record of every revision."""

    def __init__(self, cfg):
        cfg = dict(cfg)
        cfg["auditor"] = True
        super().__init__(cfg)
        self.started = False

    def ensure(self, r):
        fresh = self.conn is None or not self.conn.alive
        ok = super().ensure(r)
        if ok and fresh and not self.started:
            self.started = True
            for repo in r.repos:
                s = Sub({"op": "subscribe", "repo": repo, "writers": True, "progress": True})
                self.subscribe(r, s)
        return ok

    def subscribe(self, r, s, resume=False, catchup=None):
        req = dict(s.spec)
        if resume and s.last is not None:
            req["since"] = s.last
            if s.epoch is not None:
                req["epoch"] = s.epoch
            if self.catchup and r.rng.random() < 0.5:
                req["catchup"] = True
        else:
            req["initial"] = True
        s.conn = self.conn
        rid = self.conn.request(req, lambda q, rep: self.audit_subscribed(r, s, q, rep))
        if rid is not None:
            r.ops += 1

    def audit_subscribed(self, r, s, req, rep):
        if rep is None:
            if s not in self.parked:
                self.parked.append(s)
            return
        if rep.get("ok"):
            s.sub = rep["sub"]
            s.live = True
            s.epoch = rep.get("epoch")
            if "since" not in req or rep.get("catchup") in ("diff", "snapshot"):
                s.last = rep["rev"]
            self.subs[s.sub] = s
        elif rep.get("error", {}).get("code") == "compacted" or rep.get("error", {}).get("code") == "internal":
            s.last = None
            if self.conn is not None and self.conn.alive:
                self.subscribe(r, s)
        elif self.conn is not None and self.conn.alive:
            self.subscribe(r, s, resume=True)

    def tick(self, r):
        if self.ensure(r) and self.sync:
            now = time.monotonic()
            if now >= self.next_sync:
                lo, hi = self.cfg.get("sync_every", (0.1, 0.6))
                self.next_sync = now + r.rng.uniform(lo, hi)
                self.sync_request(r)


class SlowReader:
    """Stops reading until its connection overflows, reads the `overflow` event, and resumes
    every subscription from the event's `revs`; or, with coalescing subscriptions only, stops
    reading and must never be cut off."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.conn = None
        self.subs = {}
        self.resume = {}  # repo -> (since, epoch)
        self.state = "idle"
        self.until = 0.0
        self.retry_at = 0.0
        self.coalesce = False
        # With stall_revs (the self-test, which needs an overflow on any machine): a stall
        # lasts until that many revisions were written (counted on a second connection that
        # reads them all), not a time: a busy machine writes slowly.
        self.stall_revs = cfg.get("stall_revs")
        self.counter = None
        self.counter_retry_at = 0.0
        self.counted = 0
        self.stall_from = 0

    def start(self, r):
        pass

    def closed(self, c):
        if c is self.conn:
            self.conn = None
            self.state = "idle"
            self.retry_at = time.monotonic() + 0.05
        elif c is self.counter:
            self.counter = None
            self.counter_retry_at = time.monotonic() + 0.05

    def count(self, c, m, t):
        if m.get("event") == "change":
            self.counted += 1

    def ensure_counter(self, r):
        if self.counter is not None and self.counter.alive or time.monotonic() < self.counter_retry_at:
            return
        self.counter = r.connect(self.count, self.closed)
        if self.counter is None:
            self.counter_retry_at = time.monotonic() + 0.05
        if self.counter is not None:
            for repo in r.repos:
                self.counter.request({"op": "subscribe", "repo": repo})
                r.ops += 1

    def event(self, c, m, t):
        if m["event"] == "overflow":
            for k, v in m.get("revs", {}).items():
                repo = self.subs.get(int(k))
                if repo is not None:
                    self.resume[repo] = (v, self.resume.get(repo, (None, None))[1])
            return
        repo = self.subs.get(m.get("sub"))
        if repo is not None and "rev" in m:
            self.resume[repo] = (m["rev"], self.resume.get(repo, (None, None))[1])

    def tick(self, r):
        now = time.monotonic()
        rng = r.rng
        if self.stall_revs:
            self.ensure_counter(r)
        if self.state == "idle":
            if now < self.retry_at:
                return
            self.conn = r.connect(self.event, self.closed)
            if self.conn is None:
                self.retry_at = now + 0.05
                return
            self.subs = {}
            self.coalesce = rng.random() < self.cfg.get("coalesce_p", 0.35)
            for repo in r.repos:
                req = {"op": "subscribe", "repo": repo}
                if self.coalesce:
                    req["coalesce"] = True
                    if rng.random() < 0.3:
                        req["echo"] = False
                since, epoch = self.resume.get(repo, (None, None))
                if since is not None and not self.coalesce:
                    req["since"] = since
                    if epoch is not None:
                        req["epoch"] = epoch
                    if self.cfg.get("catchup") and rng.random() < 0.5:
                        req["catchup"] = True
                else:
                    req["initial"] = True
                if rng.random() < 0.3:
                    req["writers"] = True

                def done(q, rep, repo=repo):
                    if rep is not None and rep.get("ok"):
                        self.subs[rep["sub"]] = repo
                        if "since" not in q or rep.get("catchup") in ("diff", "snapshot"):
                            self.resume[repo] = (rep["rev"], rep.get("epoch"))
                        elif repo in self.resume:
                            self.resume[repo] = (self.resume[repo][0], rep.get("epoch"))
                    elif rep is not None and rep.get("error", {}).get("code") == "compacted":
                        self.resume.pop(repo, None)
                self.conn.request(req, done)
                r.ops += 1
            self.state = "reading"
            self.until = now + rng.uniform(0.2, 1.0)
        elif self.state == "reading":
            if now >= self.until:
                self.conn.reading = False
                self.conn.note({"slow": "stops reading"})
                self.state = "stalled"
                self.until = now + (30.0 if self.stall_revs else rng.uniform(1.5, 5.0))
                self.stall_from = self.counted
        elif self.state == "stalled":
            if (now >= self.until or (self.stall_revs and self.counted - self.stall_from >= self.stall_revs)) \
                    and self.conn is not None:
                self.conn.reading = True
                self.conn.note({"slow": "reads again"})
                self.state = "catching"
                self.until = now + rng.uniform(1.0, 3.0)
        elif self.state == "catching":
            if now >= self.until and self.conn is not None:
                if self.coalesce and rng.random() < 0.5:
                    self.state = "reading"
                    self.until = now + rng.uniform(0.2, 1.0)
                else:
                    self.conn.close("slow reader cycles")

    def drain(self, r):
        if self.conn is not None:
            self.conn.reading = True

    def drain_tick(self, r):
        pass


class Leaser:
    """Leases of both kinds: grants, keys attached by set and batch (and moved by an
    equal-value set, detached by a plain set or a delete), keepalives (some leases left to
    expire), revokes, connections closed with their connection-bound leases, writes and
    keepalives naming ended leases."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.conn = None
        self.other = None
        self.leases = {}  # id -> {"ttl", "keep", "conn", "next_keep"}
        self.ended = []
        self.values = {}  # (repo, key) -> value we last wrote
        self.retry_at = 0.0
        self.seq = 0
        self.min_ttl = cfg.get("min_ttl", 1)
        self.cross = cfg.get("cross_connection", False)
        self.nkeys = cfg.get("lease_keys", 12)

    def start(self, r):
        self.rng = r.rng
        self.lkeys = [f"L/{r.name}/{i:02d}" for i in range(self.nkeys)]

    def closed(self, c):
        if c is self.conn:
            self.conn = None
            for lid, l in list(self.leases.items()):
                if l["ttl"] is None:
                    self.ended.append(lid)
                    del self.leases[lid]
        if c is self.other:
            self.other = None
        self.retry_at = time.monotonic() + 0.02

    def ensure(self, r):
        if self.conn is not None and self.conn.alive:
            if self.cross and (self.other is None or not self.other.alive):
                self.other = r.connect(lambda c, m, t: None, self.closed, daemon=self.conn.daemon)
            return True
        if time.monotonic() < self.retry_at:
            return False
        self.conn = r.connect(lambda c, m, t: None, self.closed)
        if self.conn is None:
            self.retry_at = time.monotonic() + 0.02
            return False
        return True

    def granted(self, q, rep):
        if rep is not None and rep.get("ok"):
            ttl = q.get("ttl")
            self.leases[rep["lease"]] = {"ttl": ttl, "keep": ttl is not None and self.rng.random() < 0.6,
                                         "next_keep": time.monotonic() + (ttl or 1) / 3.0}

    def tick(self, r):
        if not self.ensure(r):
            return
        c = self.conn
        rng = r.rng
        now = time.monotonic()
        for lid, l in list(self.leases.items()):
            if l["keep"] and now >= l["next_keep"]:
                l["next_keep"] = now + l["ttl"] / 3.0
                c.request({"op": "keepalive", "lease": lid}, self.kept(lid))
                r.ops += 1
        if c.in_flight > 8:
            return
        x = rng.random()
        if self.cross and x < 0.004 and self.leases and self.other is not None and self.other.alive:
            # A large batch naming a lease from one connection, its revoke from another at once
            # (issue 32 item 1: the race that leaves keys on a dead lease).
            lid = rng.choice(list(self.leases))
            repo = rng.choice(r.repos)
            self.seq += 1
            ops = [{"op": "set", "key": f"L/{r.name}/r{i:03d}", "value": f"r/{self.seq}/{i}", "lease": lid}
                   for i in range(rng.randrange(200, 800))]
            self.other.request({"op": "batch", "repo": repo, "ops": ops}, self.wrote)
            c.request({"op": "revoke", "lease": lid}, self.revoked(lid))
            del self.leases[lid]
            self.ended.append(lid)
            r.ops += 2
            return
        if x < 0.04 and len(self.leases) < 6:
            req = {"op": "grant"}
            if rng.random() < 0.6:
                req["ttl"] = rng.choice(self.cfg.get("ttl_choices", [1, 2, 3, 4]))
                if req["ttl"] < self.min_ttl:
                    req["ttl"] = self.min_ttl
            c.request(req, self.granted)
        elif x < 0.25 and self.leases:
            lid = rng.choice(list(self.leases))
            repo = rng.choice(r.repos)
            w = self.other if self.cross and self.other is not None and rng.random() < 0.5 else c
            if rng.random() < 0.7:
                key = rng.choice(self.lkeys)
                self.seq += 1
                v = self.lease_value(rng, repo, key)
                w.request({"op": "set", "repo": repo, "key": key, "value": v, "lease": lid}, self.wrote)
            else:
                ops = []
                for key in rng.sample(self.lkeys, rng.randrange(1, 4)):
                    self.seq += 1
                    op = {"op": "set", "key": key, "value": self.lease_value(rng, repo, key)}
                    if rng.random() < 0.8:
                        op["lease"] = lid
                    ops.append(op)
                w.request({"op": "batch", "repo": repo, "ops": ops}, self.wrote)
        elif x < 0.29 and self.leases:
            lid = rng.choice(list(self.leases))
            w = self.other if self.cross and self.other is not None and rng.random() < 0.5 else c
            w.request({"op": "revoke", "lease": lid}, self.revoked(lid))
            del self.leases[lid]
            self.ended.append(lid)
        elif x < 0.32:
            # A plain set (detaches), or a delete (detaches).
            repo = rng.choice(r.repos)
            key = rng.choice(self.lkeys)
            if rng.random() < 0.5:
                self.seq += 1
                c.request({"op": "set", "repo": repo, "key": key, "value": f"{r.name}/p{self.seq}"}, self.wrote)
            else:
                c.request({"op": "delete", "repo": repo, "key": key})
        elif x < 0.4:
            c.request({"op": "get", "repo": rng.choice(r.repos), "key": rng.choice(self.lkeys)})
        elif x < 0.41 and self.ended:
            lid = rng.choice(self.ended[-20:])
            c.request(rng.choice([{"op": "keepalive", "lease": lid}, {"op": "revoke", "lease": lid},
                                  {"op": "set", "repo": rng.choice(r.repos), "key": rng.choice(self.lkeys),
                                   "value": 1, "lease": lid}]))
        elif x < 0.415:
            c.close("leaser drops its connection")
            return
        else:
            return
        r.ops += 1

    def lease_value(self, rng, repo, key):
        # Sometimes the value the key holds already (from our own last write): an equal-value
        # set that changes nothing but moves the key's attachment.
        if rng.random() < 0.2 and (repo, key) in self.values:
            return self.values[(repo, key)]
        return rng.choice(POOL) if rng.random() < 0.3 else f"l/{self.seq}"

    def wrote(self, q, rep):
        if rep is not None and rep.get("ok"):
            if q["op"] == "set":
                self.values[(q["repo"], q["key"])] = q["value"]
            else:
                for op in q["ops"]:
                    self.values[(q["repo"], op["key"])] = op.get("value")

    def kept(self, lid):
        def done(q, rep):
            if rep is not None and not rep.get("ok") and rep.get("error", {}).get("code") == "not_found":
                self.leases.pop(lid, None)
        return done

    def revoked(self, lid):
        return lambda q, rep: None

    def drain(self, r):
        pass

    def drain_tick(self, r):
        pass


ROLES = {"writer": Writer, "watcher": Watcher, "auditor": Auditor, "slow": SlowReader, "leaser": Leaser}


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    role = ROLES[cfg["role"]](cfg)
    r = Runner(cfg)
    # Wait for the common start.
    delay = (cfg["start_ns"] - now_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)
    r.run(role)


if __name__ == "__main__":
    main()
