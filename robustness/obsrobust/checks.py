"""Pass 2: what one connection saw, checked against the model (model.py) that pass 1 built.

- replies: one per request, in request order, `id` echoed;
- reads (`get`, `list`, `repos`, a `subscribe` reply's revision): the state returned is the
  model's state at some revision inside the read's real-time window — at least every revision
  anybody had been told of before the read was sent (in etcd mode: by any daemon when the read
  took under a second, else by the daemon that answered, as docs/PROTOCOL.md allows), at most
  the last revision whose write had been sent before the reply came;
- writes answered `changed: false` or `conflict`: decided as the model decides them at some
  revision inside the window; a write's new revision comes after every revision already told;
- subscriptions (the watch validator): snapshot, `since` replay and `synced`, every change event
  (ordered, unique, atomic — exactly the selected changes of its revision in order, `old` the
  previous `new`, `lease` and `by` right — and reliable: no selected revision skipped), `once`,
  `echo: false` (exactly its own revisions skipped), coalesced events (the state they leave is
  the model's state, keys changed back left out), progress (never below an earlier message,
  never above the repository, nothing selected up to it undelivered), `overflow` (`revs`
  honest, the last message, never for a connection whose subscriptions all coalesce),
  unsubscribe, and at the end of the run everything written delivered.
"""

import bisect

from .jsonv import canon
from .model import UNKNOWN, selected, write_changes

NS = 1_000_000_000


def ms(ns):
    return f"{ns / 1e6:.1f} ms"


class ConnCheck:
    def __init__(self, ctx, conn, validator_mod):
        self.ctx = ctx
        self.res = ctx.result
        self.conn = conn
        self.V = validator_mod
        self.inc = conn.inc["inc"] if conn.inc else 0
        self.subs = {}
        self.ended_subs = {}
        self.unchecked = set()  # live subscriptions not checked (history unknown, or a violation already reported)
        self.overflowed = None

    def hist(self, repo):
        if not isinstance(repo, str):
            return None
        return self.ctx.histories.get((repo, self.ctx.hid(repo, self.conn.daemon, self.inc)))

    def ref(self, ln):
        return (self.conn.file, ln)

    # Reads and windows

    def window(self, h, r, is_read):
        """[lo, hi] of revisions the request may have been served at."""
        if self.ctx.mode == "etcd" and is_read and ((r.rt - r.t) >= 0.9 * NS or self.V.may_serve_own_state(self.ctx, self.conn.daemon, r.t, r.rt)):
            lo = h.r_lo_daemon(r.t, self.conn.daemon)
        else:
            lo = h.r_lo(r.t)
        hi = max(h.r_hi(r.rt), lo)
        return lo, hi

    def lo_source(self, h, lo):
        return "durability" if self.ctx.mode == "local" and self.crossed_restart(h, lo) else "kv"

    def crossed_restart(self, h, rev):
        content = h.revs.get(rev)
        if content is not None and content.inc is not None:
            return content.inc != (self.conn.daemon, self.inc)
        for w in h.acked.get(rev, []):
            return w.inc != self.inc
        return False

    def check_reply_order(self):
        for r in self.conn.reqs:
            if r.rep is None:
                continue
            is_obj = isinstance(r.obj, dict)
            want = r.obj.get("id") if is_obj else None
            got = r.rep.get("id")
            code = r.code
            if code == "too_large" and got is None:
                if r.line <= self.ctx.max_line:
                    self.res.add("kv", f"too_large for a line within the limit on {self.conn.name}", [self.ref(r.ln), self.ref(r.rln)])
                continue
            if code == "bad_json" and got is None:
                if is_obj:
                    self.res.add("kv", f"bad_json for a valid JSON object on {self.conn.name}", [self.ref(r.ln), self.ref(r.rln)])
                continue
            if got != want:
                self.res.add("kv", f"a reply out of request order on {self.conn.name}", [self.ref(r.ln), self.ref(r.rln)],
                             f"the reply to the request with id {want!r} has id {got!r}")
                return False
        if self.conn.unpaired:
            t, obj, ln = self.conn.unpaired[0]
            self.res.add("kv", f"a reply to no request on {self.conn.name}", [self.ref(ln)])
        if self.conn.half is not None and self.conn.end == "E":
            inc = self.conn.inc
            stop = inc.get("stop_t") if inc is not None else None
            if stop is not None and inc.get("how") == "crash":
                # A crash (a failpoint's SIGKILL) is logged when the suite reaps the process,
                # a moment after it died: it died after the last fault before then began.
                stop = max((f["t0"] for f in self.ctx.tl.faults if f["t0"] <= stop), default=stop)
            alive = inc is not None and (stop is None or stop > self.conn.t_end)
            missing = [r for r in self.conn.reqs if r.rep is None and r.t < self.conn.half]
            if alive and missing:
                self.res.add("kv", f"a half-closed connection ended before answering: {self.conn.name}",
                             [self.ref(missing[0].ln)],
                             f"{len(missing)} requests sent before the half-close had no reply at end of file")
        return True

    def check_request(self, r):
        obj = r.obj
        if not isinstance(obj, dict) or r.rep is None:
            return
        op = obj.get("op")
        if op in ("get", "list", "set", "delete", "batch") and r.ok or r.code == "conflict":
            h = self.hist(obj.get("repo"))
            if h is None:
                return
            if op == "get":
                self.check_get(h, r)
            elif op == "list":
                self.check_list(h, r)
            else:
                self.check_write(h, r)
        elif op == "get" and r.code == "not_found":
            h = self.hist(obj.get("repo"))
            if h is not None:
                self.check_get(h, r)
        elif op == "repos" and r.ok:
            for e in r.rep.get("repos", []):
                h = self.hist(e["name"])
                if h is None:
                    continue
                lo, hi = self.window(h, r, True)
                if not lo <= e["rev"] <= hi:
                    self.res.add(self.lo_source(h, lo) if e["rev"] < lo else "kv",
                                 f"repos reports a revision outside the request's window: {e['name']} {e['rev']} not in [{lo}, {hi}]",
                                 [self.ref(r.ln), self.ref(r.rln)])
                    continue
                st = h.full_state_at(e["rev"])
                if st is not UNKNOWN and len(st) != e["keys"]:
                    self.res.add("kv", f"repos counts other keys than the repository holds: {e['name']} at {e['rev']}",
                                 [self.ref(r.rln)], f"keys {e['keys']}, the model holds {len(st)}")

    def check_get(self, h, r):
        self.res.checked["kv"] += 1
        key = r.obj.get("key")
        lo, hi = self.window(h, r, True)
        kh = h.keys.get(key)
        if r.ok:
            want_v = canon(r.rep.get("value"))
            want_r = r.rep.get("rev")
            # After a re-base on a full state (a new history), key revisions are not known.
            pred = lambda v, kr: v == want_v and (kr is UNKNOWN or kr == want_r)
        else:
            pred = lambda v, kr: v is None
        if kh is None:
            if h.known_from is not None and lo >= h.known_from and r.ok:
                self.res.add("kv", f"get returns a key the repository never held: {h.repo}/{key}", [self.ref(r.ln), self.ref(r.rln)])
            return
        if kh.unknown_between(lo, hi):
            self.res.skip("read in an unknown state")
            return
        if kh.holds_within(pred, lo, hi):
            self.check_get_lease(h, r, key, lo, hi)
            return
        # Not in the window: stale (below lo) or from the future, or never.
        ivs = kh.intervals(pred)
        where = ", ".join(f"[{a}, {b if b is not None else '∞'})" for a, b in ivs[:4]) or "never"
        stale = any(b is not None and b <= lo for a, b in ivs)
        self.res.add(self.lo_source(h, lo) if stale else "kv",
                     f"get returns a state outside its window: {h.repo}/{key}",
                     [self.ref(r.ln), self.ref(r.rln)] + self.lo_refs(h, lo),
                     f"the reply holds at revisions {where}; the read was served between revision {lo} (told before it was sent) "
                     f"and {hi}")

    def check_get_lease(self, h, r, key, lo, hi):
        """`get` reports the key's lease: checked where the attachment is one and the same
        throughout the read's window."""
        if not r.ok:
            return
        # (An attachment a no-op write moved after this read was answered is left out: it is
        # logged at the revision the write was answered at, which the read's window may hold.)
        # Read in place (a key's log is long, and every get looks at it): the entries of the
        # window, and the last one before it, of those answered before this read was.
        log = h.attach_log.get(key)
        if not log:
            return
        revs = h.attach_revs(key)
        kept = lambda x: x[2] is None or x[2] < r.rt
        first = bisect.bisect_right(revs, lo)
        j = bisect.bisect_right(revs, hi)
        vals = {log[k][1] for k in range(first, j) if kept(log[k])}
        before = next((log[k] for k in range(first - 1, -1, -1) if kept(log[k])), None)
        if before is not None:
            vals.add(before[1])
        elif not vals and not any(kept(log[k]) for k in range(j, len(log))):
            return  # no entry answered before this read
        else:
            vals.add(None)
        if len(vals) != 1 or UNKNOWN in vals or h.amb_until.get(key, 0) > r.t:
            return
        lid = vals.pop()
        got = r.rep.get("lease")
        if got != lid and not self.noop_moved(h, key, r):
            self.res.checked["lease"] += 1
            self.res.add("lease", f"get reports the wrong lease for a key: {h.repo}/{key}", [self.ref(r.ln), self.ref(r.rln)],
                         f"lease {got}, the key's last set named {lid}")

    def noop_moved(self, h, key, r):
        for w in h.noops:
            if w.t < r.rt and key in self.V.touched_keys(w.req) and w.rt is not None and w.rt > r.t - 5 * NS:
                return True
        return False

    def lo_refs(self, h, lo):
        rv = h.revs.get(lo)
        return [rv.src] if rv is not None else []

    def check_list(self, h, r):
        self.res.checked["kv"] += 1
        rev = r.rep["rev"]
        lo, hi = self.window(h, r, True)
        if not lo <= rev <= hi:
            self.res.add(self.lo_source(h, lo) if rev < lo else "kv",
                         f"list at a revision outside its window: {h.repo} at {rev}, window [{lo}, {hi}]",
                         [self.ref(r.ln), self.ref(r.rln)] + self.lo_refs(h, lo))
            return
        prefix = r.obj.get("prefix") or None
        st = h.full_state_at(rev, prefix)
        if st is UNKNOWN:
            self.res.skip("list in an unknown state")
            return
        keys = r.rep.get("keys", [])
        want = sorted(st, key=lambda k: k.encode())
        if keys != want:
            self.res.add("kv", f"list returns other keys than the model holds: {h.repo} at {rev}", [self.ref(r.ln), self.ref(r.rln)],
                         f"got {keys}, the model holds {want}")
            return
        if r.obj.get("values"):
            vals = r.rep.get("values", {})
            for k in want:
                if k not in vals or canon(vals[k]) != st[k]:
                    self.res.add("kv", f"list returns a value the key did not hold: {h.repo}/{k} at {rev}",
                                 [self.ref(r.ln), self.ref(r.rln)], f"got {vals.get(k)!r}, the model holds {st[k]}")
                    return
        ep = r.rep.get("epoch")
        if ep is not None and ep != h.hid.split("#")[0] and not h.hid.startswith("?"):
            self.res.add("durability", f"list reports another epoch than its history's: {h.repo}", [self.ref(r.rln)])

    def check_write(self, h, r):
        lo, hi = self.window(h, r, False)
        self.res.checked["kv"] += 1
        if r.ok and r.rep.get("changed"):
            if r.rep["rev"] <= lo:
                self.res.add(self.lo_source(h, lo), f"a write's revision is not after one already told: {h.repo} {r.rep['rev']} ≤ {lo}",
                             [self.ref(r.ln), self.ref(r.rln)] + self.lo_refs(h, lo),
                             "revision " + str(lo) + " had been told to a client before this write was sent")
            return
        # changed: false at revision R, or conflict somewhere in the window.
        if r.ok:
            at = r.rep["rev"]
            if not lo <= at <= hi:
                self.res.add(self.lo_source(h, lo) if at < lo else "kv",
                             f"a no-op write answered at a revision outside its window: {h.repo} {at} not in [{lo}, {hi}]",
                             [self.ref(r.ln), self.ref(r.rln)])
                return
            ch = write_changes(r.obj, lambda k: h.state_at(k, at))
            if ch is UNKNOWN:
                self.res.skip("no-op in an unknown state")
            elif ch is None or ch[0] == "conflict" or ch[0]:
                self.res.add("kv", f"a write answered changed: false would change the state: {h.repo} at {at}",
                             [self.ref(r.ln), self.ref(r.rln)],
                             f"on the model's state at {at} it {'fails its ifRev' if ch and ch[0] == 'conflict' else 'makes ' + self.V.describe_changes(ch[0] if ch else ())}")
            elif r.obj.get("op") in ("set", "delete"):
                v = h.state_at(r.obj["key"], at)[0]
                old = canon(r.rep["old"]) if "old" in r.rep else None
                if v is not UNKNOWN and old != v:
                    self.res.add("kv", f"a no-op write's reply has the wrong old: {h.repo}/{r.obj['key']} at {at}",
                                 [self.ref(r.ln), self.ref(r.rln)], f"old {old}, the key held {v}")
            return
        # conflict: some revision in [lo, hi] where an ifRev fails.
        points = {lo}
        for k in self.V.touched_keys(r.obj):
            kh = h.keys.get(k)
            if kh is None:
                continue
            i = bisect.bisect_right(kh.revs, lo)
            j = bisect.bisect_right(kh.revs, hi)
            points.update(kh.revs[i:j])
        decided = False
        for at in sorted(points):
            ch = write_changes(r.obj, lambda k: h.state_at(k, at))
            if ch is UNKNOWN:
                self.res.skip("conflict in an unknown state")
                return
            if ch is not None and ch[0] == "conflict":
                decided = True
                break
        if not decided:
            self.res.add("kv", f"a write answered conflict although its ifRev held throughout its window: {h.repo}",
                         [self.ref(r.ln), self.ref(r.rln)], f"window [{lo}, {hi}]")

    # Subscriptions

    def run(self):
        if not self.check_reply_order():
            return
        for r in self.conn.reqs:
            self.check_request(r)
        self.check_stream()

    def check_stream(self):
        ctx = self.ctx
        last_t = None
        after_overflow = None
        for t, kind, obj, ln in self.conn.items:
            if after_overflow is not None:
                self.res.add("watch", f"a message after overflow on {self.conn.name}", [after_overflow, self.ref(ln)],
                             "overflow is the connection's last message")
                after_overflow = None
                self.overflowed = "reported"
            if kind == "rep":
                r = obj
                if not isinstance(r.obj, dict):
                    continue
                op = r.obj.get("op")
                if op == "subscribe":
                    self.subscribed(r)
                elif op == "unsubscribe":
                    self.unsubscribed(r)
                elif op == "sync" and r.code != "unknown_op":
                    self.sync_reply(r)
                continue
            ev = obj.get("event")
            if ev == "overflow":
                self.overflow(obj, t, ln)
                if self.overflowed is None:
                    after_overflow = self.ref(ln)
                continue
            sid = obj.get("sub")
            s = self.subs.get(sid)
            if s is None:
                if sid in self.unchecked:
                    continue
                if sid in self.ended_subs:
                    self.res.add("watch", f"an event after its subscription ended: sub {sid} on {self.conn.name}",
                                 [self.ended_subs[sid], self.ref(ln)])
                else:
                    self.res.add("watch", f"an event for no live subscription: sub {sid} on {self.conn.name}", [self.ref(ln)])
                continue
            s.event(obj, t, ln)
            if s.done is not None:
                self.ended_subs[sid] = s.done
                del self.subs[sid]
        # The end of the run: what was written before it is delivered to those still reading.
        if self.conn.why == "end of run" and not self.conn.client.startswith("slow"):
            for s in self.subs.values():
                s.at_end()

    def subscribed(self, r):
        cu = r.obj.get("catchup")
        if cu is True and (r.obj.get("since") is None or r.obj.get("once")):
            # Contract, "Catching up": only with since, never with once.
            self.res.checked["watch"] += 1
            if r.ok or r.code != "bad_request":
                self.res.add("watch", f"catchup {'with once' if r.obj.get('once') else 'without since'} not refused as bad_request",
                             [self.ref(r.ln), self.ref(r.rln)], f"the reply: {r.rep}")
            if r.ok:
                self.unchecked.add(r.rep.get("sub"))
            return
        if not r.ok:
            self.subscribe_refused(r)
            return
        h = self.hist(r.obj.get("repo"))
        sid = r.rep["sub"]
        if sid in self.subs or sid in self.ended_subs:
            self.res.add("watch", f"a sub number given twice on {self.conn.name}: {sid}", [self.ref(r.rln)])
        if h is None:
            self.unchecked.add(sid)
            return
        lo, hi = self.window(h, r, True)
        if not lo <= r.rep["rev"] <= hi:
            self.res.add(self.lo_source(h, lo) if r.rep["rev"] < lo else "kv",
                         f"subscribe reply at a revision outside its window: {h.repo} {r.rep['rev']} not in [{lo}, {hi}]",
                         [self.ref(r.ln), self.ref(r.rln)])
        since = r.obj.get("since")
        ep = r.obj.get("epoch")
        if since is not None and r.obj.get("catchup") is True:
            mode = self.catchup_reply(r, h, lo)
            if mode is not None:
                self.subs[sid] = SubCheck(self, r, h, catchup=mode)
            else:
                self.unchecked.add(sid)
            return
        if "catchup" in r.rep:
            self.res.add("watch", f"a reply with catchup to a subscribe without it: {h.repo}", [self.ref(r.ln), self.ref(r.rln)])
        if since is not None:
            if ep is not None and ep != r.rep.get("epoch"):
                self.res.add("watch", f"since with another history's epoch was not compacted: {h.repo}",
                             [self.ref(r.ln), self.ref(r.rln)], f"asked epoch {ep}, the repository's is {r.rep.get('epoch')}")
                self.unchecked.add(sid)
                return
            if since > r.rep["rev"]:
                self.res.add("watch", f"since above the repository's revision was not compacted: {h.repo} since {since}",
                             [self.ref(r.ln), self.ref(r.rln)])
                self.unchecked.add(sid)
                return
        self.subs[sid] = SubCheck(self, r, h)

    def catchup_reply(self, r, h, lo):
        """`catchup: true` (contract, "Catching up"): never compacted; the reply says how the
        subscription is brought up to its revision. Whether it is a replay, a diff or a snapshot
        follows from the epoch, `since` and what the history holds."""
        mode = r.rep.get("catchup")
        since = r.obj.get("since")
        ep = r.obj.get("epoch")
        R0 = r.rep["rev"]
        refs = [self.ref(r.ln), self.ref(r.rln)]
        if mode not in ("replay", "diff", "snapshot"):
            self.res.add("watch", f"a catch-up reply without catchup: {h.repo}", refs)
            return None
        self.res.checked["watch"] += 1
        self.res.seen[mode] += 1
        foreign = ep is not None and ep != r.rep.get("epoch")
        if (foreign or since > R0) and mode != "snapshot":
            self.res.add("watch", f"a catch-up from another history or the future not by snapshot: {h.repo} since {since}", refs,
                         f"catchup {mode}; asked epoch {ep}, the repository's {r.rep.get('epoch')}; revision {R0}")
            return None
        if not foreign and since <= R0 and R0 - since < 0.4 * self.ctx.history_limit and h.known_from is not None \
                and since >= h.known_from and mode != "replay" and lo >= since:
            self.res.add("watch", f"a catch-up by {mode} though the history holds every revision above since: {h.repo} since {since}",
                         refs, f"revision {R0}; the history keeps the last {self.ctx.history_limit}")
        elif not foreign and since <= R0 and mode == "snapshot" and self.ctx.tombstones_kept and h.known_from is not None \
                and since >= h.known_from:
            # docs/PROTOCOL.md: a snapshot only for another epoch, a since from the future, or
            # deletions forgotten past the tombstone limit — which this run's few keys never reach.
            # (Only for a since within this history: one from before its epoch began — no epoch
            # given — may be below the floor a repaired log or a new data directory left.)
            self.res.add("watch", f"a catch-up by snapshot though the daemon remembers every deletion: {h.repo} since {since}",
                         refs, f"same epoch ({r.rep.get('epoch')}), since {since} ≤ revision {R0}; the suite deletes far fewer keys "
                               f"than the tombstone limit (100,000 per repository), so the answer is a replay or a diff")
        return mode

    def sync_reply(self, r):
        """`sync` (contract, "Sync"): answered after every selected change up to its revision;
        `bad_request` for a missing or non-integer sub, `not_found` for one not live."""
        sid = r.obj.get("sub")
        self.res.checked["watch"] += 1
        if not isinstance(sid, int) or isinstance(sid, bool):
            if r.ok or r.code != "bad_request":
                self.res.add("watch", f"sync with sub {sid!r} not refused as bad_request", [self.ref(r.ln), self.ref(r.rln)],
                             f"the reply: {r.rep}")
            return
        if sid in self.unchecked:
            return
        s = self.subs.get(sid)
        if s is None:
            if not r.ok and r.code not in ("not_found", "internal"):
                self.res.add("watch", f"sync of a subscription that is not live answered {r.code}, not not_found: sub {sid}",
                             [self.ref(r.ln), self.ref(r.rln)])
            if r.ok:
                self.res.add("watch", f"sync of a subscription that is not live answered: sub {sid}", [self.ref(r.ln), self.ref(r.rln)])
            return
        if not r.ok:
            if r.code == "not_found":
                self.res.add("watch", f"sync of a live subscription answered not_found: sub {sid}", [self.ref(r.ln), self.ref(r.rln)])
            return
        s.sync_check(r)

    def subscribe_refused(self, r):
        if r.obj.get("catchup") is True and r.obj.get("since") is not None:
            # Contract, "Catching up": the reply succeeds, never compacted (nor refused for its
            # size, docs/PROTOCOL.md).
            self.res.checked["watch"] += 1
            if r.code in ("compacted", "bad_request", "overloaded"):
                self.res.add("watch", f"a catch-up refused: {r.code}: {r.obj.get('repo')} since {r.obj.get('since')}",
                             [self.ref(r.ln), self.ref(r.rln)], f"the reply: {r.rep}")
            return
        if r.code != "compacted":
            return
        since = r.obj.get("since")
        ep = r.obj.get("epoch")
        h = self.hist(r.obj.get("repo"))
        if h is None or since is None:
            return
        if ep is not None and ep != h.hid:
            return  # another history: compacted is right
        lo, hi = self.window(h, r, True)
        if since <= lo and hi - since < 0.4 * self.ctx.history_limit and h.known_from is not None and since >= h.known_from and lo > 0:
            self.res.add("watch", f"since within the history answered compacted: {h.repo} since {since}",
                         [self.ref(r.ln), self.ref(r.rln)],
                         f"the repository was at revision {lo} or more, the history holds the last 50,000 revisions")

    def unsubscribed(self, r):
        sid = r.obj.get("sub")
        if sid in self.unchecked:
            if r.ok:
                self.unchecked.discard(sid)
                self.ended_subs[sid] = self.ref(r.rln)
            return
        s = self.subs.get(sid)
        if r.ok:
            if s is None:
                if sid in self.ended_subs:
                    self.res.add("watch", f"unsubscribe of an ended subscription succeeded: sub {sid}",
                                 [self.ended_subs[sid], self.ref(r.rln)])
                else:
                    self.res.add("watch", f"unsubscribe of an unknown subscription succeeded: sub {sid}", [self.ref(r.rln)])
                return
            self.ended_subs[sid] = self.ref(r.rln)
            del self.subs[sid]
        elif r.code == "not_found" and s is not None:
            self.res.add("watch", f"unsubscribe of a live subscription answered not_found: sub {sid}",
                         [self.ref(s.req.rln), self.ref(r.rln)])

    def overflow(self, obj, t, ln):
        revs = obj.get("revs", {})
        live = list(self.subs.values())
        if live and all(s.coalesce for s in live):
            self.res.add("watch", f"overflow for a connection whose subscriptions all coalesce: {self.conn.name}",
                         [self.ref(ln)] + [self.ref(s.req.ln) for s in live[:3]])
        for s in live:
            v = revs.get(str(s.sid))
            if v is None:
                self.res.add("watch", f"overflow leaves out a live subscription: sub {s.sid} on {self.conn.name}", [self.ref(ln)])
                continue
            s.overflow_check(v, ln)
        for s in live:
            self.ended_subs[s.sid] = self.ref(ln)
        self.subs = {}


class SubCheck:
    """One subscription's events against the model."""

    def __init__(self, cc, r, h, catchup=None):
        self.cc = cc
        self.res = cc.res
        self.req = r
        self.h = h
        spec = r.obj
        self.spec = spec
        self.sid = r.rep["sub"]
        self.R0 = r.rep["rev"]
        self.since = spec.get("since")
        self.initial = bool(spec.get("initial"))
        self.once = bool(spec.get("once"))
        self.coalesce = bool(spec.get("coalesce"))
        self.echo = spec.get("echo", True) is not False
        self.writers = bool(spec.get("writers"))
        self.progress = bool(spec.get("progress"))
        self.phase = "snapshot" if self.initial else ("replay" if self.since is not None else "live")
        # A catch-up (contract, "Catching up"): a diff or a snapshot, then synced.
        self.catchup = catchup
        if catchup == "diff":
            self.phase = "catchup"
        elif catchup == "snapshot":
            self.phase = "snapshot"
        self.told = self.since if self.since is not None else self.R0
        self.last_rev = self.R0  # of any message (for progress)
        self.done = None
        self.seen_new = {}
        self.complete = False  # seen_new holds every selected key (after a snapshot)
        self.view = None
        self.uncertain = False
        self.conn_name = cc.conn.name
        keys = spec.get("keys")
        self.keys = None
        if keys is not None:
            self.keys = list(dict.fromkeys(keys))
        self.prefix = spec.get("prefix") or None
        self._keys = None
        if self.coalesce:
            start = self.told
            self.view = self.state_view(start)

    def ref(self, ln):
        return self.cc.ref(ln)

    def refs(self, *lns):
        return [self.ref(self.req.ln), self.ref(self.req.rln)] + [self.ref(x) for x in lns if x is not None]

    def state_view(self, rev):
        st = self.h.full_state_at(rev, self.prefix)
        if st is UNKNOWN:
            return UNKNOWN
        if self.keys is not None:
            return {k: v for k, v in st.items() if k in self.keys}
        return st

    def sel(self, key):
        if self.keys is not None:
            return key in self.keys
        if self.prefix:
            return key.startswith(self.prefix)
        return True

    def own(self, rev):
        """Whether revision `rev` was written by this subscription's connection."""
        w = self.h.writer_of.get(rev)
        return w is not None and w.conn == self.conn_name

    def own_changes(self, upto):
        """This connection's own revisions in (told, upto), each as [(key, value after)] for the
        keys it selects — from the write requests, which say what a key holds after them."""
        own = self.h.own_revs.get(self.conn_name)
        if not own:
            return []
        i = bisect.bisect_right(own, self.told)
        j = bisect.bisect_left(own, upto)
        out = []
        for r in own[i:j]:
            w = self.h.writer_of[r]
            ops = w.req.get("ops") if w.req.get("op") == "batch" else [w.req]
            out.append((r, [(o["key"], canon(o["value"]) if (o.get("op") or w.req.get("op")) == "set" else None)
                            for o in ops or [] if isinstance(o.get("key"), str) and self.sel(o["key"])]))
        return out

    def selected_changes(self, content):
        return tuple(c for c in content.changes if self.sel(c[0]))

    def selected_keys(self):
        if self._keys is None:
            self._keys = [k for k in self.h.key_changes if self.sel(k)]
        return self._keys

    def next_selected(self, x):
        """The first revision after x this subscription must get (None: none known), and
        whether a revision of unknown content lies before it (then nothing is asserted)."""
        h = self.h
        unc = False
        while True:
            if self.keys is None and not self.prefix:
                r = x + 1
                if r > h.final_rev:
                    return None, unc
                c = h.revs.get(r)
                if c is None:
                    unc = True
                    x = r
                    continue
            else:
                best = None
                for k in self.selected_keys():
                    kc = h.key_changes[k]
                    i = bisect.bisect_right(kc, x)
                    if i < len(kc) and (best is None or kc[i] < best):
                        best = kc[i]
                gi = bisect.bisect_right(h.gaps_all, x)
                if gi < len(h.gaps_all) and (best is None or h.gaps_all[gi] < best):
                    unc = True
                if best is None:
                    return None, unc
                r = best
                c = h.revs[r]
            if (not self.echo and self.own(r)) or not self.selected_changes(c):
                x = r
                continue
            return r, unc

    def event(self, m, t, ln):
        ev = m.get("event")
        rev = m.get("rev")
        if m.get("repo") != self.spec.get("repo"):
            self.res.add("watch", f"an event of another repository: sub {self.sid}", self.refs(ln))
            return
        if ev == "snapshot":
            return self.snapshot(m, ln)
        if ev == "catchup":
            return self.catchup_event(m, ln)
        if self.phase == "catchup":
            self.res.add("watch", f"a {ev} event before the catch-up event: sub {self.sid}", self.refs(ln))
            self.phase = "replay"
        if self.phase == "snapshot":
            self.res.add("watch", f"a {ev} event before the snapshot asked for: sub {self.sid}", self.refs(ln))
            self.phase = "live"
        if ev == "synced":
            return self.synced(m, ln)
        if ev == "progress":
            return self.progress_event(m, t, ln)
        if ev == "change":
            if "from" in m:
                return self.coalesced(m, t, ln)
            return self.change(m, t, ln)
        if ev == "revoked":
            self.done = self.ref(ln)

    def snapshot(self, m, ln):
        if self.phase != "snapshot":
            self.res.add("watch", f"a snapshot not asked for, or twice: sub {self.sid}", self.refs(ln))
            return
        self.phase = "live"
        self.res.checked["watch"] += 1
        if m.get("rev") != self.R0:
            self.res.add("watch", f"snapshot at another revision than the reply's: sub {self.sid} {m.get('rev')} ≠ {self.R0}",
                         self.refs(ln))
        want = self.state_view(m.get("rev"))
        if want is UNKNOWN:
            self.res.skip("snapshot in an unknown state")
        else:
            got = {k: canon(v) for k, v in m.get("values", {}).items()}
            if got != want:
                diff = sorted(set(got.items()) ^ set(want.items()))[:6]
                self.res.add("watch", f"snapshot differs from the state at its revision: {self.h.repo} at {m.get('rev')} sub {self.sid}",
                             self.refs(ln), f"differences (key, value): {diff}")
        self.told = self.R0
        self.last_rev = self.R0
        self.seen_new = {k: canon(v) for k, v in m.get("values", {}).items()}
        self.complete = True
        if self.catchup == "snapshot":
            self.phase = "replay"  # synced follows
        if self.coalesce:
            self.view = self.state_view(self.R0)

    def catchup_event(self, m, ln):
        h = self.h
        self.res.checked["watch"] += 1
        self.res.seen["catchup event"] += 1
        if self.phase != "catchup":
            self.res.add("watch", f"a catch-up event not asked for, or twice: sub {self.sid}", self.refs(ln))
            return
        self.phase = "replay"
        if m.get("from") != self.since or m.get("rev") != self.R0:
            self.res.add("watch", f"a catch-up event's from or rev is not the request's since or the reply's rev: sub {self.sid}",
                         self.refs(ln), f"from {m.get('from')} rev {m.get('rev')}; since {self.since}, reply rev {self.R0}")
        if "by" in m or "lease" in m:
            self.res.add("watch", f"a catch-up event carries by or lease: sub {self.sid}", self.refs(ln))
        before = self.state_view(self.since)
        after = self.state_view(self.R0)
        if before is UNKNOWN or after is UNKNOWN:
            self.res.skip("catch-up in an unknown state")
        else:
            want_values = {}
            for k, v in after.items():
                krev = h.state_at(k, self.R0)[1]
                if krev is UNKNOWN:
                    want_values = UNKNOWN
                    break
                if krev > self.since:
                    want_values[k] = v
            got_values = {k: canon(v) for k, v in (m.get("values") or {}).items()}
            if want_values is not UNKNOWN and got_values != want_values:
                diff = sorted(set(got_values.items()) ^ set(want_values.items()))[:6]
                self.res.add("watch", f"a catch-up's values are not the keys changed above from: {h.repo} sub {self.sid}",
                             self.refs(ln), f"differences (key, value): {diff}")
            deleted = m.get("deleted") or []
            if deleted != sorted(deleted, key=lambda k: k.encode()):
                self.res.add("watch", f"a catch-up's deleted out of byte order: sub {self.sid}", self.refs(ln))
            required = set(before) - set(after)
            churned = set()
            for k in self.selected_keys():
                kc = h.key_changes.get(k, [])
                i = bisect.bisect_right(kc, self.since)
                if i < len(kc) and kc[i] <= self.R0 and k not in after:
                    churned.add(k)
            got = set(deleted)
            if not required <= got or not got <= required | churned:
                self.res.add("watch", f"a catch-up's deleted is not the keys gone since from: {h.repo} sub {self.sid}",
                             self.refs(ln), f"missing {sorted(required - got)}; not deletable {sorted(got - required - churned)}")
            self.seen_new = dict(after)
            self.complete = True
            if self.coalesce:
                self.view = dict(after)
        self.told = self.R0
        self.last_rev = max(self.last_rev, self.R0)

    def sync_check(self, r):
        h = self.h
        S = r.rep.get("rev")
        refs = [self.ref(r.ln), self.ref(r.rln)]
        lo, hi = self.cc.window(h, r, True)
        if S is None or not lo <= S <= hi:
            self.res.add("watch", f"sync at a revision outside its window: {h.repo} sub {self.sid} {S} not in [{lo}, {hi}]", refs)
            return
        if self.phase != "live":
            self.res.add("watch", f"sync answered before the subscription caught up: sub {self.sid}", refs)
            return
        if self.coalesce:
            # Its events may already have gone past S (the reply follows those up to S, not
            # only them); if not, what it received must be the selected state at S.
            self.apply_own(S)
            want = self.state_view(S) if self.told < S else UNKNOWN
            if self.view is not UNKNOWN and self.view is not None and want is not UNKNOWN and self.view != want:
                self.res.add("watch", f"sync answered before the coalescing subscription's state reached its revision: {h.repo} sub {self.sid}",
                             refs)
        else:
            nxt, unc = self.next_selected(self.told)
            if nxt is not None and nxt <= S and not unc:
                self.res.add("watch", f"sync answered before a selected change up to its revision: {h.repo} sub {self.sid} sync {S}, revision {nxt} not delivered",
                             refs + ([h.revs[nxt].src] if nxt in h.revs else []))
                return  # (the change may still come: checked as it does)
        self.res.seen["sync"] += 1
        if not self.echo:
            self.pass_own(S + 1)
        self.told = max(self.told, S)
        self.last_rev = max(self.last_rev, S)

    def synced(self, m, ln):
        self.res.checked["watch"] += 1
        if self.phase != "replay":
            self.res.add("watch", f"synced not after a since replay: sub {self.sid}", self.refs(ln))
            return
        if m.get("rev") != self.R0:
            self.res.add("watch", f"synced at another revision than the reply's: sub {self.sid} {m.get('rev')} ≠ {self.R0}",
                         self.refs(ln))
        nxt, unc = self.next_selected(self.told)
        if nxt is not None and nxt <= self.R0 and not unc:
            self.res.add("watch", f"synced before the replay held revision {nxt}: {self.h.repo} sub {self.sid}", self.refs(ln),
                         f"since {self.since}, replay up to {self.R0}; revision {nxt} selects "
                         f"{self.V_desc(nxt)}")
        self.phase = "live"
        if not self.echo:
            self.pass_own(self.R0 + 1)
        if self.coalesce:
            self.apply_own(self.R0)
        self.told = max(self.told, self.R0)
        self.last_rev = max(self.last_rev, self.R0)

    def V_desc(self, r):
        c = self.h.revs.get(r)
        return self.cc.V.describe_changes(self.selected_changes(c), c.lease) if c else "?"

    def change(self, m, t, ln):
        rev = m.get("rev")
        h = self.h
        self.res.checked["watch"] += 1
        if rev is None or rev <= self.told:
            self.res.add("watch", f"change events not in increasing revision order: {h.repo} sub {self.sid} got {rev} after {self.told}",
                         self.refs(ln))
            return
        if self.phase == "replay" and rev > self.R0:
            self.res.add("watch", f"a live change before synced: {h.repo} sub {self.sid} revision {rev} > {self.R0}", self.refs(ln))
            self.phase = "live"
        nxt, unc = self.next_selected(self.told)
        if nxt is not None and nxt < rev and not unc:
            self.res.add("watch", f"a selected revision skipped: {h.repo} sub {self.sid} got {rev}, missed {nxt}",
                         self.refs(ln) + ([h.revs[nxt].src] if nxt in h.revs else []),
                         f"revision {nxt} holds {self.V_desc(nxt)}" + (" (its own write: echo is true)" if self.echo else ""))
        content = h.revs.get(rev)
        got = self.changes_of(m)
        if not self.echo:
            self.pass_own(rev)
        # old equals the previous new, as this stream showed it (no model needed).
        for k, o, n in got:
            if (k in self.seen_new or self.complete) and self.seen_new.get(k) != o:
                self.res.add("watch", f"old is not the previous new in one subscription's events: {h.repo}/{k} sub {self.sid} revision {rev}",
                             self.refs(ln), f"old {o}, the previous event's new {self.seen_new.get(k)}")
                break
        for k, o, n in got:
            self.seen_new[k] = n
        if content is None:
            self.res.skip("event of unknown content")
        else:
            want = self.selected_changes(content)
            if not want:
                self.res.add("watch", f"an event for a revision that changes nothing selected: {h.repo} sub {self.sid} revision {rev}",
                             self.refs(ln) + [content.src])
            elif got != want:
                self.res.add("watch", f"an event holds other changes than its revision: {h.repo} sub {self.sid} revision {rev}",
                             self.refs(ln) + [content.src],
                             f"event {self.cc.V.describe_changes(got)}, revision {self.cc.V.describe_changes(want)}")
            lease = m.get("lease")
            lease = (lease.get("id"), lease.get("end")) if isinstance(lease, dict) else None
            if lease != content.lease:
                self.res.add("watch", f"an event's lease is not its revision's: {h.repo} sub {self.sid} revision {rev}",
                             self.refs(ln) + [content.src], f"event {lease}, revision {content.lease}")
            if not self.echo and self.own(rev):
                self.res.add("watch", f"echo: false delivered the connection's own write: {h.repo} sub {self.sid} revision {rev}",
                             self.refs(ln) + content.writer.refs())
            self.check_by(m, content, ln)
        if self.coalesce:
            self.apply_own(rev - 1)
        if self.coalesce and self.view is not UNKNOWN and self.view is not None:
            for k, o, n in got:
                if n is None:
                    self.view.pop(k, None)
                else:
                    self.view[k] = n
        self.told = rev
        self.last_rev = max(self.last_rev, rev)
        if self.once:
            self.done = self.ref(ln)

    def pass_own(self, rev):
        """echo: false skips this connection's own revisions: their news are the previous
        news of what follows."""
        # After its own write a key holds what the write set (or nothing, deleted) — so the
        # request says it even where no subscriber saw the revision.
        for r, kvs in self.own_changes(rev):
            for k, v in kvs:
                self.seen_new[k] = v

    def changes_of(self, m):
        return self.cc.V.changes_of(m)

    def check_by(self, m, content, ln):
        by = m.get("by")
        if not self.writers:
            if by is not None:
                self.res.add("watch", f"by without writers: sub {self.sid}", self.refs(ln))
            return
        if not isinstance(by, dict):
            self.res.add("watch", f"writers: true but no by: {self.h.repo} sub {self.sid} revision {m.get('rev')}", self.refs(ln))
            return
        w = content.writer
        pid = None
        pids = self.cc.ctx.pids
        if isinstance(w, tuple):
            for (g, i), l in self.cc.ctx.leases.items():
                if i == w[1] and l.grantor_pid is not None:
                    pid = pids.get(l.grantor_pid)
        elif w is not None:
            pid = pids.get(w.client)
        if pid is not None and by.get("pid") != pid:
            self.res.add("watch", f"by names another process than the writer: {self.h.repo} sub {self.sid} revision {m.get('rev')}",
                         self.refs(ln) + ([content.src] if content.src else []), f"by pid {by.get('pid')}, the writer's {pid}")

    def apply_own(self, upto):
        """echo: false with coalesce: the subscription's own writes count as received."""
        if self.echo or self.view is UNKNOWN or self.view is None:
            return
        for r, kvs in self.own_changes(upto + 1):
            for k, v in kvs:
                if v is None:
                    self.view.pop(k, None)
                else:
                    self.view[k] = v

    def coalesced(self, m, t, ln):
        h = self.h
        rev = m.get("rev")
        frm = m.get("from")
        self.res.checked["watch"] += 1
        if not self.coalesce:
            self.res.add("watch", f"a coalesced event for a subscription without coalesce: sub {self.sid}", self.refs(ln))
            return
        if rev is None or rev <= self.told or frm is None or frm <= self.told or frm > rev:
            self.res.add("watch", f"a coalesced event out of order: {h.repo} sub {self.sid} from {frm} rev {rev} after {self.told}",
                         self.refs(ln))
            return
        if "lease" in m:
            self.res.add("watch", f"a coalesced event carries lease: sub {self.sid}", self.refs(ln))
        if self.writers and not isinstance(m.get("by"), dict):
            self.res.add("watch", f"a coalesced event without by (writers: true): sub {self.sid}", self.refs(ln))
        got = self.changes_of(m)
        self.apply_own(rev)
        want_state = self.state_view(rev)
        if self.view is UNKNOWN or self.view is None or want_state is UNKNOWN:
            self.res.skip("coalesced event in an unknown state")
            self.view = want_state
        else:
            keys = sorted(set(self.view) | set(want_state), key=lambda k: k.encode())
            want = tuple((k, self.view.get(k), want_state.get(k)) for k in keys if self.view.get(k) != want_state.get(k))
            if got != want:
                self.res.add("watch", f"a coalesced event does not bring the subscriber to the state at its revision: {h.repo} sub {self.sid} rev {rev}",
                             self.refs(ln),
                             f"event {self.cc.V.describe_changes(got)}; from the values it last received to the state at {rev}: "
                             f"{self.cc.V.describe_changes(want)}")
            self.view = dict(want_state)
        if not self.echo:
            self.pass_own(rev + 1)
        for k, o, n in got:
            self.seen_new[k] = n
        self.told = rev
        self.last_rev = max(self.last_rev, rev)

    def progress_event(self, m, t, ln):
        h = self.h
        rev = m.get("rev")
        self.res.checked["watch"] += 1
        if not self.progress:
            self.res.add("watch", f"a progress event not asked for: sub {self.sid}", self.refs(ln))
            return
        if self.phase in ("snapshot", "replay"):
            self.res.add("watch", f"progress before the subscription's snapshot or synced: sub {self.sid}", self.refs(ln))
        if rev is None or rev < self.last_rev:
            self.res.add("watch", f"progress below an earlier message: {h.repo} sub {self.sid} progress {rev} < {self.last_rev}",
                         self.refs(ln))
            return
        hi = h.r_hi(t)
        if rev > hi and rev > h.final_rev:
            self.res.add("watch", f"progress above the repository's revision: {h.repo} sub {self.sid} progress {rev}",
                         self.refs(ln), f"no revision above {max(hi, h.final_rev)} existed when it came")
            return  # (no state to compare with there)
        if self.coalesce:
            self.apply_own(rev)
            want_state = self.state_view(rev)
            if self.view is not UNKNOWN and self.view is not None and want_state is not UNKNOWN and self.view != want_state:
                self.res.add("watch", f"progress while the coalescing subscription lags: {h.repo} sub {self.sid} progress {rev}",
                             self.refs(ln), "its state is not the repository's at that revision")
        else:
            nxt, unc = self.next_selected(self.told)
            if nxt is not None and nxt <= rev and not unc:
                self.res.add("watch", f"progress past an undelivered revision: {h.repo} sub {self.sid} progress {rev}, revision {nxt} not delivered",
                             self.refs(ln) + ([h.revs[nxt].src] if nxt in h.revs else []),
                             f"revision {nxt} holds {self.V_desc(nxt)}; resuming from {rev} would miss it")
        if not self.echo:
            self.pass_own(rev + 1)
        self.told = max(self.told, rev)
        self.last_rev = rev

    def overflow_check(self, v, ln):
        h = self.h
        self.res.checked["watch"] += 1
        base = self.since if self.since is not None else self.R0
        if v < self.told or v < min(base, self.R0):
            self.res.add("watch", f"overflow revs below what was delivered: {h.repo} sub {self.sid} revs {v} < {self.told}",
                         self.refs(ln))
            return
        if self.coalesce:
            self.apply_own(v)
            want_state = self.state_view(v)
            if self.view is not UNKNOWN and self.view is not None and want_state is not UNKNOWN and self.view != want_state:
                self.res.add("watch", f"overflow revs of a coalescing subscription not caught up: {h.repo} sub {self.sid} revs {v}",
                             self.refs(ln))
            return
        nxt, unc = self.next_selected(self.told)
        if nxt is not None and nxt <= v and not unc:
            self.res.add("watch", f"overflow revs not honest: {h.repo} sub {self.sid} revs {v}, revision {nxt} not delivered",
                         self.refs(ln) + ([h.revs[nxt].src] if nxt in h.revs else []),
                         f"resuming with since {v} would miss revision {nxt} ({self.V_desc(nxt)})")

    def at_end(self):
        """The connection closed at the end of the run, after the drain: everything written
        before the traffic stopped was delivered."""
        h = self.h
        end = self.cc.ctx.tl.traffic.get("end")
        if end is None or self.phase != "live":
            return
        top = h.r_lo(end)
        if top <= self.told:
            return
        self.res.checked["watch"] += 1
        if self.coalesce:
            self.apply_own(self.told)
            return
        nxt, unc = self.next_selected(self.told)
        if nxt is not None and nxt <= top and not unc:
            self.res.add("watch", f"not delivered by the end of the run: {h.repo} sub {self.sid} revision {nxt}",
                         self.refs() + ([h.revs[nxt].src] if nxt in h.revs else []),
                         f"the subscription got revision {self.told} last; revision {nxt} ({self.V_desc(nxt)}) had been told to "
                         f"a client before the traffic stopped, and the subscriber read for 6 s more")
