"""The contract's model of one repository history (one repository under one epoch): its
revisions in order, each with its changes, and the state at every revision — rebuilt from what
the clients saw, then used to decide every reply and event.

Revisions make this cheap: they put every write of a repository in one total order, so the
model replays them one after another (no search over interleavings, as porcupine needs for
etcd's KV model), and a read is linearizable exactly when the state it returns is the model's
state at some revision inside the read's real-time window.

Values are compared as the contract compares JSON (jsonv.canon).
"""

import bisect

from .jsonv import canon

UNKNOWN = object()  # a state the history does not show (a revision nobody saw the content of)


def set_change(key, state_val, new, force):
    """The change a `set` makes on a key holding `state_val` (canon, None if absent):
    (key, old, new) or None when it changes nothing."""
    if state_val is not None and state_val == new and not force:
        return None
    return (key, state_val, new)


def write_changes(req, state_get):
    """What a write request does, decided as the contract says, given `state_get(key)` →
    (canon value or None, key revision): ("conflict", key) if an ifRev fails, else the list
    of changes (key, old, new) in application order (empty: a no-op), plus the attachments
    it sets [(key, lease or None)]."""
    op = req.get("op")
    if op == "set" or op == "delete":
        ops = [req]
    elif op == "batch":
        ops = req.get("ops") or []
    else:
        return None
    for o in ops:
        if "ifRev" in o and o["ifRev"] is not None:
            val, krev = state_get(o["key"])
            if val is UNKNOWN or (val is not None and krev is UNKNOWN):
                return UNKNOWN
            want = o["ifRev"]
            have = krev if val is not None else 0
            if have != want:
                return ("conflict", o["key"])
    changes = []
    attach = []
    for o in ops:
        key = o["key"]
        val, _ = state_get(key)
        if val is UNKNOWN:
            return UNKNOWN
        if o.get("op", op) == "delete" or (op == "delete"):
            if val is not None:
                changes.append((key, val, None))
            attach.append((key, None))
        else:
            ch = set_change(key, val, canon(o.get("value")), bool(o.get("force")))
            if ch is not None:
                changes.append(ch)
            attach.append((key, o.get("lease")))
    return changes, attach


class KeyHistory:
    """One key's values over revisions: `revs[i]` is a revision that changed it (or where the
    history became unknown / known again), `vals[i]` its value from there on."""

    __slots__ = ("revs", "vals", "krevs")

    def __init__(self, unknown=False):
        # A history that begins from nothing (revision 0) knows every key absent there; one that
        # begins elsewhere (after a fork, a new epoch over kept state) does not.
        self.revs = [0]
        self.vals = [UNKNOWN if unknown else None]
        self.krevs = [UNKNOWN if unknown else 0]

    def add(self, rev, val, krev):
        if self.revs[-1] == rev:
            self.vals[-1] = val
            self.krevs[-1] = krev
        else:
            self.revs.append(rev)
            self.vals.append(val)
            self.krevs.append(krev)

    def at(self, rev):
        """(value canon | None | UNKNOWN, key revision) at repository revision `rev`."""
        i = bisect.bisect_right(self.revs, rev) - 1
        if i < 0:
            return None, 0
        return self.vals[i], self.krevs[i]

    def intervals(self, pred):
        """The revision intervals [a, b) where pred(value, keyrev) holds (b None: open)."""
        out = []
        for i, v in enumerate(self.vals):
            if v is not UNKNOWN and pred(v, self.krevs[i]):
                a = self.revs[i]
                b = self.revs[i + 1] if i + 1 < len(self.revs) else None
                out.append((a, b))
        return out

    def holds_within(self, pred, lo, hi):
        """Whether pred(value, keyrev) holds (a known value) somewhere in revisions [lo, hi]:
        `intervals` looked at only where they can meet the window."""
        i = max(bisect.bisect_right(self.revs, lo) - 1, 0)
        j = bisect.bisect_right(self.revs, hi)
        return any(self.vals[k] is not UNKNOWN and pred(self.vals[k], self.krevs[k]) for k in range(i, j))

    def unknown_between(self, lo, hi):
        i = bisect.bisect_right(self.revs, lo) - 1
        j = bisect.bisect_right(self.revs, hi)
        return any(self.vals[k] is UNKNOWN for k in range(max(i, 0), j))


class Revision:
    __slots__ = ("changes", "lease", "by", "src", "writer", "t_seen", "inc")

    def __init__(self, changes, lease, by, src, t_seen):
        self.changes = changes
        self.lease = lease
        self.by = by
        self.src = src  # (file, line) of where it was seen first
        self.writer = None  # the Write that made it (once matched), or ("lease", id)
        self.t_seen = t_seen
        self.inc = None


class History:
    """One repository under one epoch (or one synthetic history id)."""

    def __init__(self, repo, hid):
        self.repo = repo
        self.hid = hid
        self.revs = {}  # rev -> Revision (content seen by some subscriber of every key)
        self.acked = {}  # rev -> [Write] (changed: true)
        self.noops = []  # Write (changed: false) — attachments move
        self.unknown = []  # Write with unknown outcome
        self.undone = []  # Write refused with internal "undone"
        self.snapshots = []  # (rev, {key: canon}, src) full states seen
        self.max_rev = 0
        self.keys = {}  # key -> KeyHistory
        self.obs = []  # (t_recv, rev, daemon, inc, kind) observations of the repository's revision
        self.sent_obs = []  # (t_send, rev): replies of requests sent at t_send showing revision rev
        self.served_by = set()  # (daemon, inc): the incarnations seen serving this history
        self.lease_revs = {}  # lease id -> [rev]
        self.revoke_claims = {}  # rev -> (lease, Write)
        self.created = {}  # rev -> lower bound of when it was made (ns)
        self.known_from = None
        self.gaps = []  # revisions whose content is unknown
        self.attach = {}  # key -> lease id or None, after replay (final)
        self.attach_log = {}  # key -> [(rev, lease|None|UNKNOWN, send time of the no-op write that moved it, or None)]
        self.epochs = set()
        self.by_only = {}  # rev -> (pid, ref): writers seen by a subscription of some keys
        self.by_pending = {}
        self.lease_end_checks = []
        self.final_rev = 0
        # For R_lo / R_hi
        self._lo_t = []
        self._lo_r = []
        self._hi_t = []
        self._hi_r = []

    def key(self, k):
        h = self.keys.get(k)
        if h is None:
            h = self.keys[k] = KeyHistory(unknown=self.known_from != 0)
        return h

    def state_at(self, key, rev):
        h = self.keys.get(key)
        if h is None:
            if self.known_from is not None and rev >= self.known_from:
                return None, 0
            return (UNKNOWN, 0) if self.known_from is None or rev < self.known_from else (None, 0)
        return h.at(rev)

    def attach_revs(self, key):
        """The revisions of `key`'s attachment log (asked once the log is complete)."""
        cache = self.__dict__.setdefault("_attach_revs", {})
        revs = cache.get(key)
        if revs is None:
            revs = cache[key] = [x[0] for x in self.attach_log.get(key, [])]
        return revs

    def full_state_at(self, rev, prefix=None):
        """{key: canon} of every key at `rev` (UNKNOWN when some key's state is unknown): a
        new dict the caller may change. Asked by every list, snapshot and subscription check,
        often at the same revision: the states are kept (the histories are complete by then)."""
        cache = self.__dict__.setdefault("_states", {})
        st = cache.get((rev, prefix))
        if st is None:
            st = cache[(rev, prefix)] = self._full_state_at(rev, prefix)
            if len(cache) > 4096:
                cache.pop(next(iter(cache)))
        return st if st is UNKNOWN else dict(st)

    def _full_state_at(self, rev, prefix):
        if self.known_from is None or rev < self.known_from:
            return UNKNOWN
        out = {}
        for k, h in self.keys.items():
            if prefix is not None and not k.startswith(prefix):
                continue
            v, _ = h.at(rev)
            if v is UNKNOWN:
                return UNKNOWN
            if v is not None:
                out[k] = v
        return out

    # Real-time windows

    def index_observations(self):
        self.obs.sort(key=lambda o: o[0])
        m = 0
        per = {}
        for t, rev, daemon, inc, kind in self.obs:
            if rev > m:
                m = rev
            self._lo_t.append(t)
            self._lo_r.append(m)
            ts, rs = per.setdefault(daemon, ([], []))
            ts.append(t)
            rs.append(max(rev, rs[-1] if rs else 0))
        self._lo_daemon = per
        # The highest revision each daemon incarnation was seen to hold: a revision seen in an
        # incarnation was made in it or before it.
        self.inc_max = {}
        for t, rev, daemon, inc, kind in self.obs:
            k = (daemon, inc)
            if rev > self.inc_max.get(k, -1):
                self.inc_max[k] = rev
        self.obs = None
        items = sorted(self.created.items())
        m = 0
        pts = []
        for rev, t in items:
            m = max(m, t)
            pts.append((m, rev))
        # R_hi(t) = the highest revision whose (monotone) creation bound is before t.
        self._hi_t = [p[0] for p in pts]
        self._hi_r = [p[1] for p in pts]

    def r_lo(self, t):
        """The highest revision of this history anybody had been told of before `t`."""
        i = bisect.bisect_left(self._lo_t, t) - 1
        return self._lo_r[i] if i >= 0 else 0

    def r_lo_daemon(self, t, daemon):
        """The same, counting only what `daemon` told."""
        ts, rs = self._lo_daemon.get(daemon, ((), ()))
        i = bisect.bisect_left(ts, t) - 1
        return rs[i] if i >= 0 else 0

    def r_hi(self, t):
        """The highest revision that can exist at `t` (its write had been sent before)."""
        i = bisect.bisect_left(self._hi_t, t) - 1
        if i < 0:
            return 0
        return self._hi_r[i]


def selected(spec, key):
    keys = spec.get("keys")
    if keys is not None:
        return key in keys
    prefix = spec.get("prefix")
    if prefix:
        return key.startswith(prefix)
    return True


def is_full(spec):
    return spec.get("keys") is None and not spec.get("prefix")
