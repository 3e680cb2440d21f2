"""The validators, run on a recorded run (after it, never during it).

Pass 1 reads every history once and builds, per repository history (a repository under one
epoch), the model (model.py): every revision's content as the subscribers of every key saw it,
every write with its outcome, every revision anybody was told of and when; every lease's
grant, renewals, revokes and ends. It then replays each history revision by revision — the
KV validator checks each acknowledged write against it, the durability and epoch validators
check what crashes and restarts did, the lease validator checks every lease's end.

Pass 2 reads every history again, one connection at a time, and checks what depends on one
connection: replies in order, every read against the model's state inside its real-time
window, every subscription's events (watch validator), lease requests.

Validators: kv, watch, durability (with epochs), lease. Each violation names its validator, says
what is wrong, and quotes the smallest piece of the history that shows it (the request, the
reply, the events involved, with their files and line numbers).
"""

import json
import os

from . import history as H
from .jsonv import canon
from .model import UNKNOWN, History, Revision, is_full, selected, write_changes

NS = 1_000_000_000
WRITES = ("set", "delete", "batch")


class Violation:
    def __init__(self, validator, title, refs, detail=""):
        self.validator = validator
        self.title = title
        self.refs = refs
        self.detail = detail


class Result:
    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.violations = []
        self.ops = 0
        self.faults = 0
        self.checked = {"kv": 0, "watch": 0, "durability": 0, "lease": 0}
        self.unchecked = {}
        # What the catch-up and sync checks saw: replies by mode, catchup events, sync replies.
        self.seen = {"replay": 0, "diff": 0, "snapshot": 0, "catchup event": 0, "sync": 0}
        self.seen_titles = {}

    def add(self, validator, title, refs=(), detail=""):
        # The same defect tends to repeat: keep every count, and every violation's references
        # (whose history shows it: the self-test looks for it in one client's), the details of
        # the first few of a kind.
        kind = (validator, title.split(":")[0])
        n = self.seen_titles.get(kind, 0)
        self.seen_titles[kind] = n + 1
        self.violations.append(Violation(validator, title, list(refs)[:12], detail if n < 5 else ""))

    def skip(self, what):
        self.unchecked[what] = self.unchecked.get(what, 0) + 1


class Totals:
    def __init__(self, seed):
        self.seed = seed
        self.ops = 0
        self.faults = 0
        self.violations = 0

    def add(self, result):
        self.ops += result.ops
        self.faults += result.faults
        self.violations += len(result.violations)

    def summary_line(self):
        return f"robustness: {self.ops} operations, {self.faults} faults, {self.violations} violations (seed {self.seed})"


def totals_of(result, seed):
    t = Totals(seed)
    t.add(result)
    return t


class Write:
    """A write request (set, delete, batch) with what became of it."""

    __slots__ = ("conn", "client", "file", "ln", "rln", "t", "rt", "req", "repo", "daemon", "inc", "outcome", "rev", "old",
                 "hid", "matched")

    def __init__(self, conn, r, outcome, rev, old):
        self.conn = conn.name
        self.client = conn.client
        self.file = conn.file
        self.ln = r.ln
        self.rln = r.rln
        self.t = r.t
        self.rt = r.rt
        self.req = r.obj
        self.repo = r.obj.get("repo")
        self.daemon = conn.daemon
        self.inc = conn.inc["inc"] if conn.inc else 0
        self.outcome = outcome
        self.rev = rev
        self.old = old
        self.hid = None
        self.matched = False

    def refs(self):
        out = [(self.file, self.ln)]
        if self.rln:
            out.append((self.file, self.rln))
        return out


class Lease:
    __slots__ = ("id", "gen", "ttl", "grant", "renewals", "revokes", "conn", "conn_end", "conn_end_kind", "ends", "grantor_pid",
                 "refs", "daemon", "inc", "names")

    def __init__(self, lid, gen):
        self.id = lid
        self.gen = gen
        self.ttl = None
        self.grant = None  # (t, rt)
        self.renewals = []  # (t, rt or None, ok?)
        self.revokes = []  # (t, rt, reply, refs)
        self.conn = None
        self.conn_end = None
        self.conn_end_kind = None
        self.ends = {}  # hid key (repo, hid) -> (rev, end, t_seen)
        self.grantor_pid = None
        self.refs = []
        self.daemon = 0
        self.inc = 0
        self.names = []  # (t, rt, outcome, refs) requests naming it after a known end


class Ctx:
    """Everything pass 1 gathers."""

    def __init__(self, run_dir, result):
        self.dir = run_dir
        self.result = result
        self.tl = H.Timeline(os.path.join(run_dir, "faults.log"))
        with open(os.path.join(run_dir, "plan.json")) as f:
            self.plan = json.load(f)
        self.mode = self.plan["mode"]
        self.history_limit = self.plan.get("history_limit", 50000)
        # Whether the daemon remembers every deletion of the run (tombstones: 100,000 per
        # repository, docs/PROTOCOL.md): then a catch-up within one epoch is never a snapshot.
        self.tombstones_kept = self.plan.get("tombstones_kept", False)
        self.histories = {}
        self.epoch_of = {}  # (repo, daemon, inc) -> epoch
        self.epoch_refs = {}
        self.writes = []
        self.obs = []  # (repo, daemon, inc, t, rev, kind)
        self.leases = {}  # (gen, id) -> Lease
        self.pids = {}  # client -> pid
        self.lease_names = []  # (conn, Req, lease id, kind)
        self.conn_ends = {}  # conn name -> (t_end, kind, daemon, inc)
        self.slow_reads = {}  # daemon -> reply times of reads answered 0.9 s or more after they were sent (etcd mode)
        self.staged = {}  # (repo, epoch, daemon, inc) -> History of what that incarnation showed
        self.rev_range = {}  # (repo, daemon, inc) -> [lowest reply rev, ref, highest rev told, ref]
        self.forks = {}  # (repo, epoch, daemon) -> [inc where the history went back under the same epoch]
        self.max_line = 65536

    def stage(self, repo, epoch, daemon, inc):
        """What the subscribers of every key of one incarnation saw, before it is merged into
        its history (once forks are known)."""
        k = (repo, epoch, daemon, inc)
        h = self.staged.get(k)
        if h is None:
            h = self.staged[k] = History(repo, epoch)
        return h

    def hist(self, repo, hid):
        h = self.histories.get((repo, hid))
        if h is None:
            h = self.histories[(repo, hid)] = History(repo, hid)
        return h

    def hid(self, repo, daemon, inc):
        e = self.base_hid(repo, daemon, inc)
        forks = self.forks.get((repo, e, daemon))
        if forks:
            n = sum(1 for f, rev in forks if f <= inc)
            if n:
                return f"{e}#fork{n}"
        return e

    def owner(self, repo, daemon, inc, rev):
        """The history a revision `rev` seen by incarnation `inc` belongs to: after forks, a
        revision up to where a fork parted from the history before it is that history's."""
        e = self.base_hid(repo, daemon, inc)
        forks = [f for f in self.forks.get((repo, e, daemon), []) if f[0] <= inc]
        n = len(forks)
        while n > 0 and rev <= forks[n - 1][1]:
            n -= 1
        return f"{e}#fork{n}" if n else e

    def base_hid(self, repo, daemon, inc):
        e = self.epoch_of.get((repo, daemon, inc))
        if e is not None:
            return e
        incs = self.tl.incs.get(daemon, [])
        gen = None
        for i in incs:
            if i["inc"] == inc:
                gen = i["gen"]
        # An incarnation that never reported this repository's epoch: the one before it
        # (same data directory) — the epoch validator checks that epochs carry over.
        for i in reversed(incs):
            if i["inc"] < inc and i["gen"] == gen:
                e = self.epoch_of.get((repo, daemon, i["inc"]))
                if e is not None:
                    return e
        if self.mode == "etcd":
            for (r, d, n), e in self.epoch_of.items():
                if r == repo:
                    return e
        return f"?gen{gen}"

    def gen_of(self, daemon, inc):
        """Which set of leases incarnation `inc` serves: a new data directory (a wipe) starts
        another, and so does a repair — the grants and ends it cut away with the log are
        forgotten (a lease granted before may be not_found after it, one seen ending may live
        on), while ids are never handed out again. (gen, repairs): leases are told apart by
        this and their id."""
        if self.mode == "etcd":
            return 0
        for i in self.tl.incs.get(daemon, []):
            if i["inc"] == inc:
                return (i["gen"], i.get("repairs", 0))
        return (0, 0)

    def lease(self, gen, lid):
        k = (gen, lid)
        l = self.leases.get(k)
        if l is None:
            l = self.leases[k] = Lease(lid, gen)
        return l


def outcome_of(r):
    """What a write's reply says happened: changed / noop / conflict / refused / undone / unknown."""
    if r.rep is None:
        return "unknown"
    if r.rep.get("ok"):
        return "changed" if r.rep.get("changed") else "noop"
    code = r.code
    if code == "conflict":
        return "conflict"
    if code == "internal":
        msg = r.message
        if "unknown" in msg or "may or may not" in msg:
            return "unknown"
        return "undone"
    return "refused"


# Pass 1

# What reads repository state: in etcd mode each first asks the cluster (docs/PROTOCOL.md).
READ_OPS = ("get", "list", "repos", "subscribe", "sync")


def may_serve_own_state(ctx, daemon, t0, t1):
    """etcd mode: whether a read sent at t0 and answered at t1 may have been served from the
    daemon's own state without the cluster confirming it (docs/PROTOCOL.md: when the cluster
    cannot confirm within a second, or failed to answer this daemon in the second before):
    an etcd member down or stopped, this daemon stopped, or another read of this daemon given
    up on, around then."""
    slack = 2 * NS
    if ctx.tl.etcd_fault_between(t0, t1, slack):
        return True
    if any(a <= t1 + slack and b + slack >= t0 for a, b in ctx.tl.stalls.get(daemon, [])):
        return True
    import bisect
    rts = ctx.slow_reads.get(daemon, [])
    i = bisect.bisect_left(rts, t0 - int(1.2 * NS))
    return i < len(rts) and rts[i] <= t1 + 50_000_000


def scan(conn, ctx):
    res = ctx.result
    inc = conn.inc
    incn = inc["inc"] if inc else 0
    gen = ctx.gen_of(conn.daemon, incn)
    ctx.conn_ends[conn.name] = (conn.t_end, conn.end, conn.daemon, incn, conn.why)
    if ctx.mode == "etcd":
        for r in conn.reqs:
            if r.rt is not None and isinstance(r.obj, dict) and r.obj.get("op") in READ_OPS and r.rt - r.t >= 0.9 * NS:
                ctx.slow_reads.setdefault(conn.daemon, []).append(r.rt)
    for t, data, ln in conn.notes:
        try:
            note = json.loads(data)
        except ValueError:
            continue
        if "pid" in note:
            ctx.pids[conn.client] = note["pid"]
    subs = {}
    last_obs = {}

    def told(repo, rev, ln, reply):
        """What this incarnation told of a repository: the lowest revision a reply reported
        (its state when it first served), the highest anything reported."""
        k = (repo, conn.daemon, incn)
        rr = ctx.rev_range.get(k)
        if rr is None:
            rr = ctx.rev_range[k] = [None, None, -1, None]
        if reply and (rr[0] is None or rev < rr[0]):
            rr[0], rr[1] = rev, (conn.file, ln)
        if rev > rr[2]:
            rr[2], rr[3] = rev, (conn.file, ln)

    for r in conn.reqs:
        if r.rep is not None:
            res.ops += 1
        obj = r.obj
        if not isinstance(obj, dict):
            continue
        op = obj.get("op")
        if op in WRITES:
            if not isinstance(obj.get("repo"), str):
                continue
            oc = outcome_of(r)
            rev = r.rep.get("rev") if r.rep is not None and r.rep.get("ok") else None
            old = canon(r.rep["old"]) if r.rep is not None and "old" in r.rep else None
            w = Write(conn, r, oc, rev, old)
            ctx.writes.append(w)
            if rev is not None:
                told(w.repo, rev, r.rln, True)
                ctx.obs.append((w.repo, conn.daemon, incn, r.rt, rev, "write", r.t))
            for lid in lease_ids(obj):
                ctx.lease_names.append((conn, r, lid, gen))
        elif op in ("get", "list") and r.rep is not None and r.rep.get("ok"):
            repo = obj.get("repo")
            if op == "list":
                told(repo, r.rep["rev"], r.rln, True)
                ctx.obs.append((repo, conn.daemon, incn, r.rt, r.rep["rev"], "list", r.t))
                if "epoch" in r.rep:
                    note_epoch(ctx, repo, conn.daemon, incn, r.rep["epoch"], r.rep["rev"], (conn.file, r.rln))
            else:
                ctx.obs.append((repo, conn.daemon, incn, r.rt, r.rep.get("rev", 0), "get", None))
        elif op == "repos" and r.rep is not None and r.rep.get("ok"):
            for e in r.rep.get("repos", []):
                told(e["name"], e["rev"], r.rln, True)
                ctx.obs.append((e["name"], conn.daemon, incn, r.rt, e["rev"], "repos", r.t))
                note_epoch(ctx, e["name"], conn.daemon, incn, e["epoch"], e["rev"], (conn.file, r.rln))
        elif op == "grant":
            if r.ok:
                l = ctx.lease(gen, r.rep["lease"])
                if l.grant is not None:
                    res.add("lease", f"lease id reused: {l.id} granted twice", l.refs + [(conn.file, r.rln)],
                            "Lease ids are never reused by a daemon for as long as its data persists.")
                l.grant = (r.t, r.rt)
                l.ttl = r.rep.get("ttl") if "ttl" in obj else None
                l.conn = conn.name
                l.refs = [(conn.file, r.ln), (conn.file, r.rln)]
                l.daemon = conn.daemon
                l.inc = incn
                l.grantor_pid = conn.client
                if "ttl" in obj and r.rep.get("ttl") is None:
                    res.add("lease", "grant with ttl answered without ttl", l.refs)
        elif op == "keepalive" and isinstance(obj.get("lease"), int):
            ctx.lease_names.append((conn, r, obj["lease"], gen))
        elif op == "revoke" and isinstance(obj.get("lease"), int):
            ctx.lease_names.append((conn, r, obj["lease"], gen))
            if r.ok:
                for repo, rev in r.rep.get("revs", {}).items():
                    ctx.obs.append((repo, conn.daemon, incn, r.rt, rev, "revoke", None))
    for t, kind, obj, ln in conn.items:
        if kind == "rep":
            r = obj
            if r.obj and isinstance(r.obj, dict) and r.obj.get("op") == "subscribe" and r.ok:
                spec = r.obj
                repo = spec.get("repo")
                ep = r.rep.get("epoch")
                if ep is not None:
                    note_epoch(ctx, repo, conn.daemon, incn, ep, r.rep.get("rev", 0), (conn.file, r.rln))
                told(repo, r.rep["rev"], r.rln, True)
                ctx.obs.append((repo, conn.daemon, incn, r.rt, r.rep["rev"], "subscribe", r.t))
                subs[r.rep["sub"]] = (spec, ep)
            continue
        ev = obj.get("event")
        s = subs.get(obj.get("sub"))
        if s is None:
            continue
        spec, ep = s
        repo = spec.get("repo")
        rev = obj.get("rev")
        if rev is not None and ev in ("change", "snapshot", "catchup", "synced", "progress"):
            # Thinned to one a 5 ms per repository and connection (a lower bound stays sound).
            lt = last_obs.get(repo)
            if lt is None or t - lt >= 5_000_000:
                last_obs[repo] = t
                ctx.obs.append((repo, conn.daemon, incn, t, rev, ev, None))
                told(repo, rev, ln, False)
        if ep is None:
            continue
        if ev == "change" and "from" not in obj and is_full(spec) and not spec.get("coalesce"):
            add_revision(ctx, ctx.stage(repo, ep, conn.daemon, incn), obj, (conn.file, ln), t, (conn.daemon, incn))
        elif ev == "change" and "from" not in obj and isinstance(obj.get("by"), dict) and "rev" in obj:
            # Who wrote a revision, from any subscription with writers (to tell writes apart).
            st = ctx.stage(repo, ep, conn.daemon, incn)
            st.by_only[obj["rev"]] = (obj["by"].get("pid"), (conn.file, ln))
        elif ev == "snapshot" and is_full(spec):
            h = ctx.stage(repo, ep, conn.daemon, incn)
            h.snapshots.append((obj["rev"], {k: canon(v) for k, v in obj.get("values", {}).items()}, (conn.file, ln)))
    # Final reads (h-final) are full states too.
    if conn.client.startswith("final"):
        for r in conn.reqs:
            if r.ok and isinstance(r.obj, dict) and r.obj.get("op") == "list" and "prefix" not in r.obj and "epoch" in r.rep:
                h = ctx.stage(r.obj["repo"], r.rep["epoch"], conn.daemon, incn)
                h.snapshots.append((r.rep["rev"], {k: canon(v) for k, v in r.rep.get("values", {}).items()}, (conn.file, r.rln)))


def lease_ids(obj):
    out = []
    if "lease" in obj and isinstance(obj["lease"], int):
        out.append(obj["lease"])
    for o in obj.get("ops") or []:
        if isinstance(o, dict) and isinstance(o.get("lease"), int):
            out.append(o["lease"])
    return out


def note_epoch(ctx, repo, daemon, inc, epoch, rev, ref):
    k = (repo, daemon, inc)
    old = ctx.epoch_of.get(k)
    if old is None:
        ctx.epoch_of[k] = epoch
        ctx.epoch_refs[k] = (ref, rev)
    elif old == epoch:
        if rev > ctx.epoch_refs[k][1]:
            ctx.epoch_refs[k] = (ref, rev)
    else:
        # One incarnation, two epochs of one repository: allowed only while the repository
        # does not exist (each start picks a fresh epoch for those).
        if rev > 0 and ctx.epoch_refs[k][1] > 0:
            ctx.result.add("durability", f"epoch changed while the daemon ran: repository {repo}",
                           [ctx.epoch_refs[k][0], ref], f"{old} then {epoch} from one daemon incarnation")
        if rev > 0:
            ctx.epoch_of[k] = epoch
            ctx.epoch_refs[k] = (ref, rev)


def changes_of(obj):
    out = []
    for c in obj.get("changes", []):
        out.append((c["key"], canon(c["old"]) if "old" in c else None, canon(c["new"]) if "new" in c else None))
    return tuple(out)


def lease_of(obj):
    l = obj.get("lease")
    return (l.get("id"), l.get("end")) if isinstance(l, dict) else None


def add_revision(ctx, h, obj, ref, t, where):
    rev = obj["rev"]
    ch = changes_of(obj)
    le = lease_of(obj)
    by = obj.get("by")
    by = by.get("pid") if isinstance(by, dict) else None
    old = h.revs.get(rev)
    if old is None:
        h.revs[rev] = Revision(ch, le, by, ref, t)
        h.revs[rev].inc = where
        if rev > h.max_rev:
            h.max_rev = rev
        return
    if old.t_seen > t:
        old.t_seen = t
    if old.changes == ch and (old.lease is None) != (le is None):
        # The same changes, one with the lease's end and one without: keep the one with it
        # (the contract: every event of the revision carries it, replayed ones too).
        ctx.result.add("watch", f"an event of a lease's end without its lease: {h.repo} revision {rev}",
                       [old.src, ref], f"{describe_changes(ch, le or old.lease)} seen with and without lease")
        if old.lease is None:
            old.lease = le
            old.src = ref
        return
    if old.changes != ch or old.lease != le or (old.by is not None and by is not None and old.by != by):
        crossed = old.inc is not None and old.inc != where and ctx.mode == "local"
        ctx.result.add("durability" if crossed else "watch",
                       f"a revision reused after a restart with other changes: {h.repo} revision {rev}" if crossed else
                       f"two subscribers of every key saw a revision differently: {h.repo} revision {rev}",
                       [old.src, ref], f"{describe_changes(old.changes, old.lease)} vs {describe_changes(ch, le)}"
                       + (f"; by pid {old.by} vs {by}" if old.by != by else ""))
    if old.by is None:
        old.by = by


def describe_changes(ch, lease=None):
    parts = []
    for k, o, n in ch:
        parts.append(f"{k}: {o if o is not None else '∅'} → {n if n is not None else '∅'}")
    s = "[" + ", ".join(parts) + "]"
    if lease:
        s += f" lease {lease[0]} {lease[1]}"
    return s


# After pass 1: forks, merge, distribute, replay


def find_forks(ctx):
    """A history that went back under the same epoch: an incarnation whose first replies report
    a revision below one an earlier incarnation (same data directory, same epoch) had told. The
    acknowledged revisions above it are lost, and the revision numbers will be handed out again:
    one durability violation, and from there on the repository's revisions are checked as a
    history of their own (so one loss is reported once, not as every later revision)."""
    if ctx.mode != "local":
        return
    res = ctx.result
    for daemon, incs in ctx.tl.incs.items():
        repos = sorted({k[0] for k in ctx.rev_range if k[1] == daemon})
        for repo in repos:
            top = None  # (rev, ref, inc, epoch, gen)
            for inc in incs:
                rr = ctx.rev_range.get((repo, daemon, inc["inc"]))
                e = ctx.base_hid(repo, daemon, inc["inc"])
                if rr is None:
                    continue
                res.checked["durability"] += 1
                if top is not None and top[3] == e and top[4] == inc["gen"] and rr[0] is not None and rr[0] < top[0]:
                    res.add("durability", f"acknowledged revisions lost, the epoch kept: {repo} back from revision {top[0]} to {rr[0]}",
                            [top[1], rr[1]],
                            f"incarnation {top[2]} told revision {top[0]}; after {incarnation_end(ctx, daemon, inc['inc'])}, "
                            f"incarnation {inc['inc']} answered at revision {rr[0]} under the same epoch {e} — revisions "
                            f"{rr[0] + 1}–{top[0]} are gone and their numbers will be handed out again")
                    ctx.forks.setdefault((repo, e, daemon), []).append((inc["inc"], rr[0]))
                    top = None
                if rr[2] >= 0 and (top is None or rr[2] > top[0] or top[3] != e or top[4] != inc["gen"]):
                    top = (rr[2], rr[3], inc["inc"], e, inc["gen"])


def incarnation_end(ctx, daemon, inc):
    """How the incarnation before `inc` ended, and the faults in between (for a report)."""
    incs = ctx.tl.incs.get(daemon, [])
    prev = [i for i in incs if i["inc"] < inc]
    cur = [i for i in incs if i["inc"] == inc]
    if not prev or not cur:
        return "a restart"
    p = prev[-1]
    kinds = [f["kind"] for f in ctx.tl.faults if (p.get("stop_t") or p["spawn"]) - NS <= f["t0"] <= cur[0]["spawn"]]
    return f"{p.get('how') or 'an end'} ({', '.join(kinds) or 'no fault'})"


def merge_staged(ctx):
    for (repo, epoch, daemon, inc), st in sorted(ctx.staged.items(), key=lambda x: (x[0][0], x[0][2], x[0][3])):
        own = ctx.epoch_of.get((repo, daemon, inc)) == epoch
        h = ctx.hist(repo, ctx.hid(repo, daemon, inc) if own else epoch)
        for rev in sorted(st.revs):
            c = st.revs[rev]
            # After a fork, revisions up to where the histories part are the earlier history's
            # (a replay of them there must match what was seen before the fork).
            target = ctx.hist(repo, ctx.owner(repo, daemon, inc, rev)) if own else h
            old = target.revs.get(rev)
            if target is not h:
                if old is None:
                    target.revs[rev] = c
                else:
                    merge_revision(ctx, target, rev, old, c)
                continue
            if old is None:
                h.revs[rev] = c
                if rev > h.max_rev:
                    h.max_rev = rev
            else:
                merge_revision(ctx, h, rev, old, c)
        h.snapshots.extend(st.snapshots)
        for rev, (pid, ref) in st.by_only.items():
            target = ctx.hist(repo, ctx.owner(repo, daemon, inc, rev)) if own else h
            c = target.revs.get(rev)
            if c is None:
                target.by_pending[rev] = pid
            elif c.by is None:
                c.by = pid
            elif c.by != pid:
                ctx.result.add("watch", f"two subscribers saw different writers of a revision: {repo} revision {rev}",
                               [c.src, ref], f"by pid {c.by} and {pid}")
    for h in ctx.histories.values():
        for rev, pid in h.by_pending.items():
            c = h.revs.get(rev)
            if c is not None and c.by is None:
                c.by = pid
    ctx.staged = None


def merge_revision(ctx, h, rev, old, c):
    if old.t_seen > c.t_seen:
        old.t_seen = c.t_seen
    if old.changes == c.changes and (old.lease is None) != (c.lease is None):
        ctx.result.add("watch", f"an event of a lease's end without its lease: {h.repo} revision {rev}",
                       [old.src, c.src], f"{describe_changes(c.changes, c.lease or old.lease)} seen with and without lease")
        if old.lease is None:
            old.lease, old.src = c.lease, c.src
        return
    if old.changes != c.changes or old.lease != c.lease or (old.by is not None and c.by is not None and old.by != c.by):
        crossed = old.inc is not None and old.inc != c.inc and ctx.mode == "local"
        ctx.result.add("durability" if crossed else "watch",
                       f"a revision reused after a restart with other changes: {h.repo} revision {rev}" if crossed else
                       f"two subscribers of every key saw a revision differently: {h.repo} revision {rev}",
                       [old.src, c.src], f"{describe_changes(old.changes, old.lease)} vs {describe_changes(c.changes, c.lease)}"
                       + (f"; by pid {old.by} vs {c.by}" if old.by != c.by else ""))
    if old.by is None:
        old.by = c.by


def distribute(ctx):
    for w in ctx.writes:
        w.hid = ctx.hid(w.repo, w.daemon, w.inc)
        h = ctx.hist(w.repo, w.hid)
        if w.outcome == "changed":
            h.acked.setdefault(w.rev, []).append(w)
            if w.rev > h.max_rev:
                h.max_rev = w.rev
        elif w.outcome == "noop":
            h.noops.append(w)
        elif w.outcome == "unknown":
            h.unknown.append(w)
        elif w.outcome == "undone":
            h.undone.append(w)
    for (repo, daemon, inc, t, rev, kind, tsend) in ctx.obs:
        if not isinstance(repo, str) or rev is None:
            continue
        h = ctx.hist(repo, ctx.hid(repo, daemon, inc))
        h.obs.append((t, rev, daemon, inc, kind))
        h.served_by.add((daemon, inc))
        if tsend is not None:
            h.sent_obs.append((tsend, rev))
        if rev > h.max_rev:
            h.max_rev = rev
    ctx.obs = None
    for (conn, r, lid, gen) in ctx.lease_names:
        if isinstance(r.obj, dict) and r.obj.get("op") == "revoke" and r.ok:
            incn = conn.inc["inc"] if conn.inc else 0
            for repo, rev in r.rep.get("revs", {}).items():
                h = ctx.hist(repo, ctx.hid(repo, conn.daemon, incn))
                h.revoke_claims[rev] = (lid, (conn.file, r.rln))


def replay(ctx, h):
    """Goes through the history's revisions in order, deciding each as the contract says:
    the KV validator's checks of acknowledged writes, the chain of old and new values, the
    revisions nobody wrote, and each lease end's keys (against the attachments the writes made)."""
    res = ctx.result
    state = {}  # key -> (canon, keyrev)
    snaps = sorted(h.snapshots, key=lambda s: s[0])
    known = 1 in h.revs or 1 in h.acked or any(s[0] == 0 for s in snaps) or (h.max_rev == 0)
    if known:
        h.known_from = 0
    unknown = {}
    # Writes whose outcome is unknown first, then those answered "undone" (if one of those
    # made a revision, that is a violation — but only when nothing else can explain it).
    for w in sorted(h.unknown, key=lambda w: w.t) + sorted(h.undone, key=lambda w: w.t):
        for k in touched_keys(w.req):
            unknown.setdefault(k, []).append(w)
    # Unknown-outcome writes that would change nothing may still have moved an attachment:
    # from when they were sent, those keys' attachments are not known.
    amb_writes = sorted(h.unknown, key=lambda w: w.t)
    amb_i = 0
    noops = {}
    noop_keys = {}
    for w in sorted(h.noops, key=lambda w: w.t):
        noops.setdefault(w.rev, []).append(w)
        for k in touched_keys(w.req)[:1]:
            noop_keys.setdefault(k, []).append(w)
    attach = {}  # key -> lease id | None | UNKNOWN
    unknown_attach = [False]  # after a gap or a re-base: keys not written since have unknown attachments
    amb_until = {}  # key -> the time until which an unknown write may still move its attachment
    snap_i = 0
    prev_created = 0

    def sget(k):
        v = state.get(k)
        return v if v is not None else (None, 0)

    def set_attach(k, lid, r, t, noop=False):
        # A write sent while an unknown write on the key may still run leaves it unknown.
        if lid is not UNKNOWN and t and amb_until.get(k, 0) > t:
            lid = UNKNOWN
        attach[k] = lid
        # A no-op write moves it at no revision of its own: logged at the revision it was
        # answered at, with its send time (a read answered before it was sent did not see it).
        h.attach_log.setdefault(k, []).append((r, lid, t if noop else None))

    r = 0
    top = max(h.max_rev, max((s[0] for s in snaps), default=0))
    while r < top:
        r += 1
        if not known:
            while snap_i < len(snaps) and snaps[snap_i][0] < r - 1:
                snap_i += 1
            if snap_i < len(snaps):
                srev, values, _ = snaps[snap_i]
                if srev == r - 1 or (srev >= r and r not in h.revs and r not in h.acked):
                    state = {k: (v, UNKNOWN) for k, v in values.items()}
                    for k in set(h.keys) | set(values):
                        h.key(k).add(srev, values.get(k), UNKNOWN)
                    if h.known_from is None:
                        h.known_from = srev
                    known = True
                    for k in set(attach) | set(values):
                        set_attach(k, UNKNOWN, srev, 0)
                    unknown_attach[0] = True
                    for rr in range(r, srev + 1):
                        h.created[rr] = max(prev_created, h.created.get(rr, 0))
                        prev_created = h.created[rr]
                    r = srev
                    continue
        content = h.revs.get(r)
        acks = h.acked.get(r, [])
        if len(acks) > 1:
            res.add("kv", f"one revision acknowledged to two writes: {h.repo} revision {r}",
                    [ref for w in acks for ref in w.refs()], "Every write that changes state raises the revision by exactly 1.")
        w = acks[0] if acks else None
        if content is None and w is not None and known:
            ch = write_changes(w.req, sget)
            if ch is not UNKNOWN and ch is not None and ch[0] != "conflict" and ch[0]:
                content = Revision(tuple(ch[0]), None, None, (w.file, w.rln), w.rt)
                h.revs[r] = content
        if content is None and r in h.revoke_claims and known:
            lid, ref = h.revoke_claims[r]
            keys = sorted((k for k, l in attach.items() if l == lid and sget(k)[0] is not None), key=lambda k: k.encode())
            if not any(attach.get(k) is UNKNOWN for k in attach):
                content = Revision(tuple((k, state[k][0], None) for k in keys), (lid, "revoked"), None, ref, 0)
                h.revs[r] = content
        # Unknown-outcome writes sent before this revision was made: one that would change
        # nothing may have run and moved attachments (its keys' attachments become unknown
        # until its connection is over); one that would change something shows as a revision.
        # "Before it was made" is bounded by when it was first seen, not by when its own
        # request was sent: a write sent later on another connection can overtake it (a set
        # of an equal value naming another lease, sent just after a `revoke`, may move the key
        # before the revoke's deletion — and its client may never hear).
        t_now = max(prev_created, w.t if w else 0)
        if content is not None and content.t_seen:
            t_now = max(t_now, content.t_seen)
        while amb_i < len(amb_writes) and amb_writes[amb_i].t <= t_now:
            u = amb_writes[amb_i]
            amb_i += 1
            if u.matched:
                continue
            ch = write_changes(u.req, sget) if known else UNKNOWN
            if ch is UNKNOWN or (ch is not None and ch[0] != "conflict" and not ch[0]):
                end = ctx.conn_ends.get(u.conn, (None,))[0] or u.t
                for k in touched_keys(u.req):
                    set_attach(k, UNKNOWN, r - 1, u.t)
                    amb_until[k] = max(amb_until.get(k, 0), end)
        if content is None:
            if known:
                h.gaps.append(r)
                res.skip("revision content unknown")
            known = False
            for k in h.keys:
                h.key(k).add(r, UNKNOWN, UNKNOWN)
            for k in list(attach):
                set_attach(k, UNKNOWN, r, 0)
            unknown_attach[0] = True
            h.created[r] = max(prev_created, w.t if w else 0)
            prev_created = h.created[r]
            continue
        if not known:
            h.created[r] = max(prev_created, w.t if w else 0)
            prev_created = h.created[r]
            continue
        for k, o, n in content.changes:
            cur = sget(k)[0]
            if o != cur:
                res.add("watch", f"old is not the previous new: {h.repo} revision {r} key {k}", [content.src],
                        f"the revision says old {o if o is not None else '(absent)'}, but after revision {r - 1} the key "
                        f"held {cur if cur is not None else '(absent)'}")
                break
        if not content.changes:
            res.add("watch", f"a revision that changes nothing: {h.repo} revision {r}", [content.src])
        made_by = None
        if w is not None:
            res.checked["kv"] += 1
            w.matched = True
            content.writer = w
            made_by = w
            ch = write_changes(w.req, sget)
            if ch is UNKNOWN:
                res.skip("write against unknown state")
            elif ch is not None and ch[0] == "conflict":
                res.add("kv", f"ifRev decided wrongly: {h.repo} revision {r}", w.refs() + [content.src],
                        f"the write was applied, but after revision {r - 1} key {ch[1]} had revision {sget(ch[1])[1]}")
            elif ch is not None:
                changes, att = ch
                if tuple(changes) != content.changes:
                    res.add("kv", f"a write's revision holds other changes than the write makes: {h.repo} revision {r}",
                            w.refs() + [content.src],
                            f"on the state after revision {r - 1} the write makes {describe_changes(changes)}; revision {r} holds "
                            f"{describe_changes(content.changes, content.lease)}")
                elif w.req.get("op") in ("set", "delete"):
                    k = w.req["key"]
                    if w.old != sget(k)[0]:
                        res.add("kv", f"a write's reply has the wrong old: {h.repo} revision {r} key {k}", w.refs(),
                                f"reply old {w.old if w.old is not None else '(none)'}, the key held {sget(k)[0]}")
                for k, lid in att:
                    set_attach(k, lid, r, w.t)
                if content.lease is not None:
                    res.add("kv", f"a client's write carries a lease's end: {h.repo} revision {r}", w.refs() + [content.src])
            h.created[r] = max(prev_created, w.t)
        elif content.lease is not None:
            lid, end = content.lease
            content.writer = ("lease", lid)
            h.lease_revs.setdefault(lid, []).append(r)
            res.checked["lease"] += 1
            expect = sorted((k for k, l in attach.items() if l == lid and sget(k)[0] is not None), key=lambda k: k.encode())
            got = [k for k, o, n in content.changes]
            amb = {k for k, l in attach.items() if l is UNKNOWN}
            if unknown_attach[0]:
                amb |= {k for k, o, n in content.changes if k not in attach}
            if any(n is not None for k, o, n in content.changes):
                res.add("lease", f"a lease's end sets a value: {h.repo} revision {r}", [content.src])
            if got != sorted(got, key=lambda k: k.encode()):
                res.add("lease", f"a lease's end deletes its keys out of byte order: {h.repo} revision {r}", [content.src])
            extra = [k for k in got if k not in expect and k not in amb]
            left = [k for k in expect if k not in got]
            if extra or left:
                # Decided once the revisions are indexed: a lease's end made late (at start-up,
                # after a crash or a failing disk) deletes what was attached when it ended.
                h.lease_end_checks.append((r, lid, got, expect, extra, left, content.src))
            for k in got:
                attach[k] = None
                h.attach_log.setdefault(k, []).append((r, None, None))
            h.created[r] = prev_created
        else:
            cand = None
            for k, o, n in content.changes[:1]:
                for u in unknown.get(k, []):
                    # Sent before the revision was seen, by the process `by` names (if known),
                    # and not answered (undone) before a write made earlier than this revision was sent.
                    if u.matched or (content.t_seen and u.t > content.t_seen):
                        continue
                    if u.outcome == "undone" and u.rt is not None and u.rt < prev_created:
                        continue
                    if latest_processing(ctx, u) < prev_created:
                        continue  # it could not have run this late
                    if content.by is not None and ctx.pids.get(u.client, content.by) != content.by:
                        continue
                    ch = write_changes(u.req, sget)
                    if ch is not UNKNOWN and ch is not None and ch[0] != "conflict" and tuple(ch[0]) == content.changes:
                        cand = (u, ch)
                        break
            if cand is None:
                # A write answered changed: false that made this very revision?
                liar = None
                for nw in noop_keys.get(content.changes[0][0] if content.changes else None, []):
                    if nw.rev != r or nw.t > (content.t_seen or nw.t) or (content.by is not None and ctx.pids.get(nw.client, content.by) != content.by):
                        continue
                    ch = write_changes(nw.req, sget)
                    if ch is not UNKNOWN and ch is not None and ch[0] != "conflict" and tuple(ch[0]) == content.changes:
                        liar = nw
                        break
                if liar is not None:
                    res.add("kv", f"a write answered changed: false made a revision: {h.repo} revision {r}",
                            liar.refs() + [content.src], f"the write made {describe_changes(content.changes)}")
                else:
                    res.add("kv", f"a revision no client wrote: {h.repo} revision {r}", [content.src],
                            f"{describe_changes(content.changes)} matches no acknowledged write and no write whose outcome is unknown")
                h.created[r] = prev_created
            else:
                u, ch = cand
                u.matched = True
                content.writer = u
                made_by = u
                if u.outcome == "undone":
                    res.add("durability", f"a write answered 'undone' was applied: {h.repo} revision {r}",
                            u.refs() + [content.src], "the reply said the change was undone; a revision holds it")
                for k, lid in ch[1]:
                    set_attach(k, lid, r, u.t)
                h.created[r] = max(prev_created, u.t)
        prev_created = h.created[r]
        for k, o, n in content.changes:
            state[k] = (n, r) if n is not None else (None, 0)
            h.key(k).add(r, n, r if n is not None else 0)
        # Writes answered `changed: false` at this revision move attachments (a set naming a lease).
        for nw in noops.get(r, []):
            ch = write_changes(nw.req, sget)
            if ch is UNKNOWN:
                for k in touched_keys(nw.req):
                    set_attach(k, UNKNOWN, r, nw.t, noop=True)
                continue
            if ch is None or ch[0] == "conflict":
                continue
            for k, lid in ch[1]:
                if concurrent_noops(noops.get(r, []), nw, k):
                    set_attach(k, UNKNOWN, r, nw.t, noop=True)
                else:
                    set_attach(k, lid, r, nw.t, noop=True)
        # A later write by another connection settles an attachment an unknown write clouded
        # only once that write's connection is over.
        for k in [k for k, until in amb_until.items() if until <= h.created[r]]:
            del amb_until[k]
    h.final_rev = r
    h.attach = attach
    h.amb_until = amb_until


def check_lease_end_keys(ctx, h):
    res = ctx.result
    for r, lid, got, expect, extra, left, src in h.lease_end_checks:
        late = False
        spawn = made_by(ctx, h, r)
        decided = decided_by(ctx, h, r)
        if spawn is not None and decided is not None and decided != spawn:
            late = True
        if late:
            # Keys attached to the lease at some point before its end revision may go with it.
            extra = [k for k in extra if not any(l == lid and rr < r for rr, l, _ in h.attach_log.get(k, []))]
        if extra or left:
            res.add("lease", f"a lease's end deletes other keys than those attached to it: {h.repo} revision {r} lease {lid}",
                    [src] + lease_refs(ctx, h, lid) + attach_refs(h, extra + left, r),
                    f"deleted {got}; attached to lease {lid} before: {expect}"
                    + (f"; deleted though not attached to it: {extra}" if extra else "")
                    + (f"; attached to it but left: {left}" if left else ""))


def latest_processing(ctx, u):
    """The latest moment a write whose outcome is unknown can have taken effect: before its
    daemon incarnation exited (a local daemon), or within 10 s of its connection's end (etcd: a
    transaction already sent commits or fails within that, docs/PROTOCOL.md)."""
    t_end = ctx.conn_ends.get(u.conn, (None,))[0]
    if ctx.mode == "etcd":
        return t_end + 10 * NS if t_end is not None else float("inf")
    for i in ctx.tl.incs.get(u.daemon, []):
        if i["inc"] == u.inc:
            # Its exit as the orchestrator saw it, not the signal: after SIGTERM the daemon
            # still answers what it has read.
            end = i.get("end")
            return end if end is not None else float("inf")
    return float("inf")


def concurrent_noops(ws, w, key):
    for o in ws:
        if o is w or key not in touched_keys(o.req):
            continue
        if o.conn != w.conn and o.t < w.rt and w.t < o.rt:
            return True
    return False


def touched_keys(req):
    if req.get("op") == "batch":
        return [o.get("key") for o in req.get("ops") or [] if isinstance(o, dict)]
    return [req.get("key")]


def lease_refs(ctx, h, lid):
    for (g, i), l in ctx.leases.items():
        if i == lid and l.refs:
            return l.refs[:2]
    return []


def attach_refs(h, keys, before=None):
    """The writes that last attached `keys` (before revision `before`), for a report."""
    out = []
    for k in keys[:2]:
        for rr, lid, _ in reversed(h.attach_log.get(k, [])):
            if before is not None and rr >= before:
                continue
            rv = h.revs.get(rr)
            w = rv.writer if rv is not None and isinstance(rv.writer, Write) else None
            if w is None:
                w = next((n for n in h.noops if n.rev == rr and k in touched_keys(n.req)), None)
            if w is not None:
                out.extend(w.refs())
                break
    return out


def index_content(h):
    kc = {}
    gaps = []
    for r in range(1, h.final_rev + 1):
        c = h.revs.get(r)
        if c is None:
            gaps.append(r)
            continue
        for k, o, n in c.changes:
            kc.setdefault(k, []).append(r)
    h.key_changes = kc
    h.gaps_all = gaps
    own = {}
    writers = {}
    for r, c in h.revs.items():
        if isinstance(c.writer, Write):
            writers[r] = c.writer
    for r, ws in h.acked.items():
        writers.setdefault(r, ws[0])
    for r in sorted(writers):
        own.setdefault(writers[r].conn, []).append(r)
    h.own_revs = own
    h.writer_of = writers
    first = {}
    for rev, ws in h.acked.items():
        for w in ws:
            k = (w.daemon, w.inc)
            if rev < first.get(k, rev + 1):
                first[k] = rev
    h.first_write_rev = first
    # Late-lease evidence: the latest send time of a request answered with a revision below R.
    so = sorted(h.sent_obs, key=lambda x: x[1])
    h.sent_revs = [x[1] for x in so]
    m = 0
    h.sent_maxt = []
    for t, rev in so:
        m = max(m, t)
        h.sent_maxt.append(m)
    h.sent_obs = None


def latest_sent_below(h, rev):
    import bisect
    i = bisect.bisect_left(h.sent_revs, rev) - 1
    return h.sent_maxt[i] if i >= 0 else 0


# Epochs


def check_epochs(ctx):
    res = ctx.result
    tl = ctx.tl
    repos = sorted({k[0] for k in ctx.epoch_of})
    truncations = [f for f in tl.faults if f["kind"] == "truncate"]
    if ctx.mode == "etcd":
        for repo in repos:
            eps = {e for (r, d, i), e in ctx.epoch_of.items() if r == repo}
            if len(eps) > 1:
                res.add("durability", f"several epochs of one repository on one etcd prefix: {repo}",
                        [ctx.epoch_refs[k][0] for k in ctx.epoch_of if k[0] == repo][:4], f"{sorted(eps)}")
        return
    for daemon, incs in tl.incs.items():
        for repo in repos:
            prev = None
            seen = {}
            for inc in incs:
                k = (repo, daemon, inc["inc"])
                e = ctx.epoch_of.get(k)
                if e is None:
                    continue
                existed = ctx.epoch_refs[k][1] > 0
                res.checked["durability"] += 1
                if prev is not None and existed:
                    pinc, pe, pexisted = prev
                    lost = any(pinc["spawn"] < f["t0"] < inc["spawn"] for f in truncations)
                    if pinc["gen"] == inc["gen"] and pe == e and pexisted and lost:
                        # Acknowledged writes lost outside obsd (the last log segment cut short):
                        # refused, then `--repair-log` gives every repository a new epoch (issue 32 item 5).
                        res.add("durability", f"epoch kept across a log segment cut short: {repo}",
                                [ctx.epoch_refs[(repo, daemon, pinc['inc'])][0], ctx.epoch_refs[k][0]],
                                f"{e} before and after; the revisions after the cut may be numbered again")
                    if pinc["gen"] == inc["gen"] and pe != e and pexisted:
                        if not lost:
                            res.add("durability", f"epoch changed across a restart that kept the history: {repo}",
                                    [ctx.epoch_refs[(repo, daemon, pinc['inc'])][0], ctx.epoch_refs[k][0]],
                                    f"{pe} (incarnation {pinc['inc']}) then {e} (incarnation {inc['inc']}, after "
                                    f"{pinc.get('how') or 'a stop'}); only a lost history may change it")
                    if pinc["gen"] != inc["gen"] and e in seen.get("old", set()) and existed:
                        res.add("durability", f"a new data directory kept an old epoch: {repo}", [ctx.epoch_refs[k][0]],
                                f"epoch {e} named the history before the data directory was replaced")
                if inc["gen"] != (prev[0]["gen"] if prev else inc["gen"]):
                    seen.setdefault("old", set()).update(x for x in seen.get("cur", set()))
                    seen["cur"] = set()
                seen.setdefault("cur", set()).add(e)
                prev = (inc, e, existed)


# Leases


def check_leases(ctx):
    res = ctx.result
    tl = ctx.tl
    by_lease = {}
    for (repo, hid), h in ctx.histories.items():
        gen = ctx.hist_gen.get((repo, hid), ctx.gen_of(0, 0))
        for lid, revs in h.lease_revs.items():
            if len(revs) > 1:
                res.add("lease", f"one lease's end in several revisions of one repository: {repo} lease {lid}",
                        [h.revs[r].src for r in revs[:3]], f"revisions {revs}")
            for r in revs:
                by_lease.setdefault((gen, lid), []).append((h, r, h.revs[r]))
    revokes = {}  # (gen, lid) -> [(conn, Req)]
    names = {}
    for (conn, r, lid, gen) in ctx.lease_names:
        op = r.obj.get("op") if isinstance(r.obj, dict) else None
        if op == "revoke":
            revokes.setdefault((gen, lid), []).append((conn, r))
        names.setdefault((gen, lid), []).append((conn, r, op))
    keepalives = {}
    for k, lst in names.items():
        keepalives[k] = [(c, r) for c, r, op in lst if op == "keepalive"]

    def first_seen(ends):
        ts = [c.t_seen for h, r, c in ends if c.t_seen]
        return min(ts) if ts else None

    for key, ends in by_lease.items():
        gen, lid = key
        l = ctx.leases.get(key)
        reasons = {c.lease[1] for h, r, c in ends}
        if len(reasons) > 1:
            res.add("lease", f"one lease ended for several reasons: lease {lid}", [c.src for h, r, c in ends[:3]], f"{sorted(reasons)}")
        end = ends[0][2].lease[1]
        seen = first_seen(ends)
        refs = [c.src for h, r, c in ends[:2]] + (l.refs[:2] if l else [])
        if l is None or l.grant is None:
            res.skip("lease end of a lease whose grant was not seen")
            continue
        if end == "revoked":
            rv = revokes.get(key, [])
            if not rv:
                res.add("lease", f"a lease ended 'revoked' that nobody revoked: lease {lid}", refs)
            elif seen is not None and min(r.t for c, r in rv) > seen:
                res.add("lease", f"a lease ended 'revoked' before its revoke was sent: lease {lid}",
                        refs + [(rv[0][0].file, rv[0][1].ln)])
        elif end == "closed":
            if l.ttl is not None:
                res.add("lease", f"a lease with a TTL ended 'closed': lease {lid}", refs)
            else:
                t_end, how, daemon, inc, why = ctx.conn_ends.get(l.conn, (None, None, 0, 0, None))
                if how == "X" and seen is not None and t_end is not None and seen < t_end:
                    res.add("lease", f"a connection-bound lease ended before its connection closed: lease {lid}", refs,
                            f"its end was seen {ms(t_end - seen)} before the client closed the connection")
        elif end == "expired":
            if l.ttl is None:
                res.add("lease", f"a connection-bound lease 'expired': lease {lid}", refs)
            else:
                check_ttl(ctx, l, ends, keepalives.get(key, []), seen, refs)
    # Revoke replies against the lease ends.
    for key, rv in revokes.items():
        gen, lid = key
        ended = {h.repo: (r, c) for h, r, c in by_lease.get(key, [])}
        for conn, r in rv:
            if not r.ok:
                continue
            res.checked["lease"] += 1
            revs = r.rep.get("revs", {})
            for repo, rev in revs.items():
                e = ended.get(repo)
                if e is None or e[0] != rev:
                    h = ctx.histories.get((repo, ctx.hid(repo, conn.daemon, conn.inc["inc"] if conn.inc else 0)))
                    c = h.revs.get(rev) if h else None
                    if c is not None and c.lease != (lid, "revoked"):
                        res.add("lease", f"revoke names a revision that is not its lease's end: lease {lid} {repo} {rev}",
                                [(conn.file, r.rln), c.src], f"revision {rev} holds {describe_changes(c.changes, c.lease)}")
            for repo, (rev, c) in ended.items():
                if c.lease[1] == "revoked" and repo not in revs and c.t_seen and c.t_seen < r.rt:
                    res.add("lease", f"revoke's revs leave out a repository its lease's end deleted keys in: lease {lid} {repo}",
                            [(conn.file, r.rln), c.src])
    # Requests naming leases: accepted only while the lease lives; not refused while it surely does.
    for key, lst in names.items():
        gen, lid = key
        l = ctx.leases.get(key)
        ends = by_lease.get(key, [])
        seen = first_seen(ends)
        revoked_at = min((r.rt for c, r in revokes.get(key, []) if r.ok), default=None)
        for conn, r, op in lst:
            if r.rep is None:
                continue
            ended_t = min(x for x in (seen, revoked_at) if x is not None) if (seen or revoked_at) else None
            if r.ok and ended_t is not None and ended_t < r.t and op != "revoke":
                res.add("lease", f"{op} naming an ended lease was accepted: lease {lid}", [(conn.file, r.ln), (conn.file, r.rln)]
                        + ([ends[0][2].src] if ends else []), "its end was seen before the request was sent")
            if r.code == "not_found" and l is not None and l.grant is not None and r.t > l.grant[1]:
                res.checked["lease"] += 1
                revoke_sent = any(q.t < r.rt for c, q in revokes.get(key, []))
                if revoke_sent:
                    continue
                if l.ttl is None:
                    if conn.name == l.conn:
                        res.add("lease", f"a connection-bound lease not_found on its own open connection: lease {lid}",
                                [(conn.file, r.ln), (conn.file, r.rln)] + l.refs[:2])
                else:
                    renew = [l.grant[0]] + [q.t for c, q in keepalives.get(key, []) if q.ok and q.rt is not None and q.rt < r.t]
                    dmin = max(renew) + l.ttl * NS
                    if r.rt < dmin:
                        res.add("lease", f"a lease with a TTL not_found before its TTL passed: lease {lid}",
                                [(conn.file, r.ln), (conn.file, r.rln)] + l.refs[:2],
                                f"kept alive (request sent) {ms(r.rt - max(renew))} before this reply, TTL {l.ttl} s")
    # Keys that outlived their lease (in a history that went on to the end of the run: not one
    # a fork left behind).
    forked_from = {(repo, base) for (repo, e, d), forks in ctx.forks.items()
                   for base in [e] + [f"{e}#fork{n}" for n in range(1, len(forks))]}
    for (repo, hid), h in ctx.histories.items():
        if (repo, hid) in forked_from:
            continue
        gen = ctx.hist_gen.get((repo, hid), ctx.gen_of(0, 0))
        last = served_until(ctx, h)
        for k, lid in h.attach.items():
            if lid is None or lid is UNKNOWN or h.key(k).at(h.final_rev)[0] in (None, UNKNOWN):
                continue
            l = ctx.leases.get((gen, lid))
            if l is None or l.grant is None:
                continue
            done = lease_surely_over(ctx, l, revokes.get((gen, lid), []), keepalives.get((gen, lid), []), last)
            if done:
                res.add("lease", f"a key outlived its lease: {repo}/{k} lease {lid}",
                        l.refs[:2] + attach_refs(h, [k]), f"the lease ended ({done}); the key is still there at revision {h.final_rev}")


def ms(ns):
    return f"{ns / 1e6:.0f} ms"


def renewals(l, kas):
    acked = [l.grant] + [(q.t, q.rt) for c, q in kas if q.ok]
    maybe = [(q.t, c.t_end) for c, q in kas if q.rep is None]
    return acked, maybe


def deadline_bounds(ctx, l, kas, until):
    """[D_min, D_max] of a TTL lease's end (ns), counting restarts of a local daemon."""
    acked, maybe = renewals(l, kas)
    T = l.ttl * NS
    dmin = max(t for t, rt in acked) + T
    dmax = max([rt for t, rt in acked] + [e or t for t, e in maybe]) + T
    if ctx.mode == "local":
        for inc in ctx.tl.incs.get(l.daemon, []):
            if inc["spawn"] > l.grant[0] and inc["spawn"] < (until or inc["spawn"] + 1):
                dmin = max(dmin, inc["spawn"] + T) if inc["spawn"] + T > dmin else dmin
                dmax = max(dmax, (inc["serving"] or inc["spawn"]) + T)
    return dmin, dmax


def made_by(ctx, h, rev):
    """The spawn time of the earliest incarnation seen holding revision `rev` (it was made in
    that incarnation or before), or None."""
    best = None
    for (daemon, inc), top in h.inc_max.items():
        if top >= rev:
            for i in ctx.tl.incs.get(daemon, []):
                if i["inc"] == inc and (best is None or i["spawn"] < best):
                    best = i["spawn"]
    return best


def decided_by(ctx, h, rev):
    """The spawn time of the incarnation that decided a lease's end made at revision `rev`:
    the one that made it — or, for a revision made at start-up, before the daemon served any
    client's write (an end a crash interrupted, made again), the one before."""
    spawn = made_by(ctx, h, rev)
    if spawn is None or ctx.mode != "local":
        return spawn
    for daemon, incs in ctx.tl.incs.items():
        for k, inc in enumerate(incs):
            if inc["spawn"] == spawn:
                first = h.first_write_rev.get((daemon, inc["inc"]))
                if k > 0 and (first is None or rev < first):
                    return incs[k - 1]["spawn"]
    return spawn


def check_ttl(ctx, l, ends, kas, seen, refs):
    res = ctx.result
    res.checked["lease"] += 1
    # Restarts count (a TTL starts again in full when the daemon serves again) only up to the
    # incarnation that made the lease's end.
    made = [m for m in (decided_by(ctx, h, r) for h, r, c in ends) if m is not None]
    until = (min(made) + 1) if made else seen
    dmin, dmax = deadline_bounds(ctx, l, kas, until)
    if seen is not None and seen < dmin:
        res.add("lease", f"a lease with a TTL ended early: lease {lid_of(l)}", refs,
                f"its end was seen {ms(dmin - seen)} before the earliest moment its TTL of {l.ttl} s could pass")
    # Late: a request sent after the deadline (+1 s, + the stalls the suite injected) saw it alive.
    for h, r, c in ends:
        x = latest_sent_below(h, r)
        ka_alive = [q.t for cc, q in kas if q.ok]
        if ka_alive:
            x = max(x, max(ka_alive))
        allowance = 1.0 + ctx.tl.stalled(l.daemon, dmax, x)
        if ctx.mode == "etcd":
            allowance += ctx.tl.stalled(1 - l.daemon, dmax, x) if len(ctx.tl.incs) > 1 else 0
            if ctx.tl.etcd_fault_between(l.grant[0], x, 2 * NS):
                allowance += l.ttl + 2.0  # etcd gives every lease its whole TTL again after a leader change
            allowance += 0.6  # etcd's expiry check (docs/PROTOCOL.md: ttl + 0.6 s)
        if x > dmax + allowance * NS:
            res.add("lease", f"a lease with a TTL ended late: lease {lid_of(l)}", refs,
                    f"a request sent {ms(x - dmax)} after the latest moment its TTL of {l.ttl} s could pass still saw "
                    f"{h.repo} before the lease's end (revision {r}); allowed: {allowance:.2f} s (1 s, plus the stalls the "
                    f"suite injected)")


def lid_of(l):
    return l.id


def served_until(ctx, h):
    """Until when some daemon served history `h`: its last observation, or, if earlier, the
    time the last incarnation seen serving it was stopped. A reader that lags (the slow
    client) reads a history's revisions after its daemon was killed — and after a `wipe` no
    daemon ever serves that history again, so nothing in it can still end a lease."""
    last = h.last_obs_t
    if last is None or ctx.mode != "local":
        return last
    stops = []
    for daemon, inc in h.served_by:
        try:
            i = ctx.tl._inc(daemon, inc)
        except KeyError:
            return last
        stop = i.get("stop_t") or i["end"]
        if stop is None:
            return last  # still serving at the end of the run
        stops.append(stop)
    return min(last, max(stops)) if stops else last


def lease_surely_over(ctx, l, revokes, kas, last):
    if last is None:
        return None
    for c, r in revokes:
        if r.ok and r.rt < last:
            return "revoked"
    if l.ttl is not None:
        dmin, dmax = deadline_bounds(ctx, l, kas, last)
        allowance = 3.0 + ctx.tl.stalled(l.daemon, dmax, last) + (l.ttl + 3.0 if ctx.mode == "etcd" else 0)
        if dmax + allowance * NS < last:
            return "its TTL passed"
        return None
    t_end, how, daemon, inc, why = ctx.conn_ends.get(l.conn, (None, None, 0, 0, None))
    if t_end is not None and t_end + (8 if ctx.mode == "etcd" else 2) * NS < last:
        return "its connection closed"
    return None


# The run


def validate_run(run_dir, log):
    from . import checks
    import sys
    res = Result(run_dir)
    ctx = Ctx(run_dir, res)
    ctx.hist_gen = {}
    res.faults = len(ctx.tl.faults)
    files = H.history_files(run_dir)
    for path in files:
        for conn in H.connections(path):
            if conn.t_open is None:
                continue
            conn.inc = ctx.tl.incarnation(conn.daemon, conn.t_open)
            scan(conn, ctx)
        for t, client, data in H.NOTES.get(path, []):
            note = json.loads(data)
            if "pid" in note:
                ctx.pids[client] = ctx.tl.proxy_pid or note["pid"]
    find_forks(ctx)
    for w in ctx.writes:
        ctx.hist_gen[(w.repo, ctx.hid(w.repo, w.daemon, w.inc))] = ctx.gen_of(w.daemon, w.inc)
    merge_staged(ctx)
    distribute(ctx)
    for key, h in ctx.histories.items():
        # A history no client wrote to (its revisions lease ends' alone): the set of leases
        # of an incarnation seen serving it.
        if key not in ctx.hist_gen and h.served_by:
            ctx.hist_gen[key] = ctx.gen_of(*min(h.served_by))
    for h in ctx.histories.values():
        h.last_obs_t = max((o[0] for o in h.obs), default=None)
        replay(ctx, h)
        index_content(h)
        h.index_observations()
    for h in ctx.histories.values():
        check_lease_end_keys(ctx, h)
    check_epochs(ctx)
    check_leases(ctx)
    # The suite's own health: the auditors must see (nearly) every revision, or the validators
    # decide little. A run where they did not is a failed run, not a passed one.
    # (A history that begins elsewhere than revision 0 — a fork, a new epoch over kept state —
    # is counted from where it became known.)
    total = sum(h.final_rev - (h.known_from or 0) for h in ctx.histories.values() if h.known_from is not None)
    unknown = sum(sum(1 for g in h.gaps_all if g > (h.known_from or 0)) for h in ctx.histories.values()
                  if h.known_from is not None)
    total += sum(h.final_rev for h in ctx.histories.values() if h.known_from is None)
    unknown += sum(len(h.gaps_all) for h in ctx.histories.values() if h.known_from is None)
    if total and unknown > 0.05 * total:
        res.add("suite", f"the auditors missed {unknown} of {total} revisions", [],
                "more than 5 %: the validators could not decide what depends on them")
    for v in ctx.slow_reads.values():
        v.sort()
    mod = sys.modules[__name__]
    for path in files:
        for conn in H.connections(path):
            if conn.t_open is None:
                continue
            conn.inc = ctx.tl.incarnation(conn.daemon, conn.t_open)
            checks.ConnCheck(ctx, conn, mod).run()
    check_catchup_coverage(ctx, res)
    problems = os.path.join(run_dir, "problems.json")
    if os.path.exists(problems):
        with open(problems) as f:
            for p in json.load(f):
                if p["kind"] == "restart":
                    res.add("durability", f"obsd did not start again after a fault (incarnation {p['inc']})", [],
                            p.get("log", "")[-1500:])
                elif p["kind"] == "client":
                    res.add("suite", f"client {p['client']} failed: {p['why']}", [], p.get("out", "")[-1500:])
                elif p["kind"] == "exit":
                    res.add("daemon", f"obsd exited on its own: daemon {p['daemon']} incarnation {p['inc']} (status {p.get('rc')})", [],
                            p.get("log", "")[-1500:])
    check_crashes(run_dir, res)
    report(ctx, res, log)
    return res


def check_crashes(run_dir, res):
    """A daemon that crashed (a trap, a fatal signal: the backtrace it logs) is a violation
    whatever else the histories show — a crash the suite asked for is a SIGKILL, which logs
    nothing."""
    for name in sorted(os.listdir(run_dir)):
        if not (name.startswith("obsd") and name.endswith(".log")):
            continue
        with open(os.path.join(run_dir, name), errors="replace") as f:
            text = f.read()
        for mark in ("*** Program crashed", "Fatal error:"):
            i = text.find(mark)
            if i >= 0:
                res.add("daemon", f"obsd crashed: {name}", [], text[max(0, i - 200):i + 1800])
                break


def check_catchup_coverage(ctx, res):
    """The suite's own health: a daemon that does catch-up and sync (contract, "Catching up",
    "Sync") must be seen doing them. A local run of 40 s or more must have checked catch-ups of
    every kind and sync replies (the traffic makes them: resumes from past the history, from
    another history, sync requests); otherwise the checks were silently idle."""
    feats = ctx.plan.get("features") or {}
    if ctx.plan.get("synthetic") or ctx.plan.get("selftest"):
        return
    if not feats.get("catchup") or not feats.get("sync"):
        res.add("suite", "the daemon does not do catch-up or sync", [],
                f"probed at start: {feats}; the contract has both (\"Catching up\", \"Sync\")")
        return
    if ctx.mode == "local" and ctx.plan.get("seconds", 0) >= 40:
        missing = [k for k in ("replay", "diff", "snapshot", "sync") if res.seen[k] == 0]
        if missing:
            res.add("suite", f"no catch-up or sync of these kinds was checked: {', '.join(missing)}", [],
                    f"seen: {res.seen}")


def kind_of(title):
    """A violation's kind: its title without the particulars after the colon."""
    return title.split(":")[0]


def report(ctx, res, log):
    mode = ctx.mode
    gaps = sum(len(h.gaps) for h in ctx.histories.values())
    log(f"robustness: {mode}: {res.ops} operations, {res.faults} faults; checked kv {res.checked['kv']}, watch "
        f"{res.checked['watch']}, durability {res.checked['durability']}, lease {res.checked['lease']}; catch-ups "
        f"{res.seen['replay']} replay, {res.seen['diff']} diff ({res.seen['catchup event']} events), {res.seen['snapshot']} snapshot, "
        f"{res.seen['sync']} sync; "
        f"{len(res.violations)} violations" + (f"; not decidable: {res.unchecked}" if res.unchecked else ""))
    if not res.violations:
        return
    wanted = {}
    for v in res.violations:
        for f, ln in v.refs:
            wanted.setdefault(f, set()).add(ln)
    lines = {}
    for f, lns in wanted.items():
        if not f or not os.path.exists(f):
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                if i in lns:
                    lines[(f, i)] = line.rstrip("\n")
    counts = {}
    kinds = {}
    for v in res.violations:
        counts[v.validator] = counts.get(v.validator, 0) + 1
        kinds.setdefault((v.validator, kind_of(v.title)), []).append(v)
    log(f"robustness: {mode}: violations by validator: {counts}")
    for (validator, kind), vs in sorted(kinds.items(), key=lambda x: -len(x[1])):
        log(f"robustness: {mode}: {len(vs):6d} × [{validator}] {kind}")
    for (validator, kind), vs in sorted(kinds.items(), key=lambda x: -len(x[1])):
        for v in [v for v in vs if v.refs or v.detail][:2]:
            log(f"VIOLATION [{v.validator}] {v.title}")
            if v.detail:
                log(f"    {v.detail}")
            for f, ln in v.refs:
                text = lines.get((f, ln), "")
                log(f"    {os.path.basename(f)}:{ln}: {text[:400]}")
    log(f"robustness: fault schedule (seed {ctx.plan['seed']}, mode {mode}):")
    for t, kind, p in ctx.plan["faults"]:
        log(f"    +{t:7.2f} s  {kind} {p}")
