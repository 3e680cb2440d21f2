"""The run's plan, all of it from one seed: the clients (role, seed, settings) and the fault
schedule (when, what, how long). The same seed gives the same plan; the orchestrator injects
each fault at its planned time, or as soon as the one before it is over."""

import random

REPOS = ["r0", "r1", "r2", "r3"]
KEYS = [f"k{i:02d}" for i in range(16)] + [f"p/{c}" for c in "abcdefgh"] + ["q", "q/1"]

# Defects known open today, each with the traffic or fault that triggers it (README, "Known
# open"). `--known-open` picks which run: `all` (the default of `make robustness`), `none` (the
# default of the short run in `make test`), or a comma-separated list of these names.
KNOWN_OPEN = {}  # none today (README: "Found by this suite, and fixed")


def known_set(spec):
    """The set of known-open names `spec` (all, none, or a list) stands for."""
    if spec in (None, "", "none", "exclude"):
        return frozenset()
    if spec in ("all", "include"):
        return frozenset(KNOWN_OPEN)
    names = frozenset(x.strip() for x in spec.split(",") if x.strip())
    bad = names - set(KNOWN_OPEN)
    if bad:
        raise ValueError(f"unknown known-open names: {sorted(bad)} (known: {sorted(KNOWN_OPEN)})")
    return names


# Faults of a local daemon, with weights.
LOCAL_FAULTS = {
    "kill9": 4.0,             # SIGKILL at a random moment, restart at once
    "kill9_checkpoint": 1.5,  # SIGKILL inside a checkpoint (failpoint checkpoint.commit=crash)
    "kill9_rollover": 1.5,    # SIGKILL as a log segment is created (failpoint wal.open=crash)
    "torn": 1.5,              # a log write stores half its bytes, then SIGKILL (wal.write=torn)
    "sigstop": 3.0,           # SIGSTOP for a while (TTLs cross the stall), SIGCONT
    "diskfull": 1.5,          # the file system full for a while (ENOSPC)
    "restart": 1.5,           # SIGTERM, start again
    "relaxed": 1.0,           # SIGKILL, start again under sync = relaxed (or back to always)
    "wipe": 0.3,              # SIGKILL, a new data directory: every repository a new epoch
    "truncate": 0.5,          # SIGKILL, the last log segment cut short: refused, obsd --repair-log, new epochs
    "eio": 2.0,               # fdatasync and write fail with EIO for a while
}
LOCAL_KNOWN_OPEN = {}
ETCD_FAULTS = {
    "sigstop": 2.0,           # SIGSTOP one daemon for a while
    "etcd_kill": 1.5,         # SIGKILL one etcd member, restart it a moment later
    "etcd_kill_leader": 1.5,  # the same, the leader
    "etcd_stop": 1.5,         # SIGSTOP one member (a partitioned member), SIGCONT
    "etcd_compact": 1.5,      # etcdctl compact at the current revision
    "kill9": 3.0,             # SIGKILL one daemon, restart it
    "restart": 1.0,           # SIGTERM one daemon, start it again
}
ETCD_KNOWN_OPEN = {}


def derive(seed, *names):
    """A seed for one part of the run, from the run's seed and the part's name."""
    r = random.Random(f"{seed}/" + "/".join(str(n) for n in names))
    return r.getrandbits(63)


def clients(seed, mode, short, known_open):
    """The client processes of one mode."""
    daemons = 2 if mode == "etcd" else 1
    out = []
    for i in range(3 if mode == "local" else 2):
        out.append({"name": f"w{i}", "role": "writer", "depth": 48 if mode == "local" else 24,
                    "rate": 900 if mode == "local" else 300})
    for i in range(daemons):
        out.append({"name": f"a{i}", "role": "auditor", "daemon": i})
    for i in range(2):
        out.append({"name": f"s{i}", "role": "watcher", "max_subs": 6, "rate": 120 if mode == "local" else 50})
    out.append({"name": "slow0", "role": "slow"})
    out.append({"name": "l0", "role": "leaser", "min_ttl": 2 if mode == "etcd" else 1, "cross_connection": True})
    for c in out:
        c["seed"] = derive(seed, mode, c["name"])
    return out


def faults(seed, mode, seconds, known_open):
    """The fault schedule: [(t seconds after the start, kind, params)]."""
    rng = random.Random(derive(seed, mode, "faults"))
    table = dict(LOCAL_FAULTS if mode == "local" else ETCD_FAULTS)
    for k, (w, name) in (LOCAL_KNOWN_OPEN if mode == "local" else ETCD_KNOWN_OPEN).items():
        if name in known_open:
            table[k] = w
    if seconds < 200:
        # The short run keeps one history per repository.
        table.pop("wipe", None)
        table.pop("truncate", None)
    kinds = sorted(table)
    weights = [table[k] for k in kinds]
    out = []
    t = 2.0
    while t < seconds - 4.0:
        kind = rng.choices(kinds, weights)[0]
        p = {"daemon": rng.randrange(2) if mode == "etcd" else 0}
        if kind == "sigstop":
            p["seconds"] = round(rng.uniform(0.3, 2.5), 3)
        elif kind in ("eio", "diskfull"):
            p["seconds"] = round(rng.uniform(0.3, 1.5), 3)
        elif kind in ("kill9", "relaxed", "truncate", "wipe", "torn", "kill9_checkpoint", "kill9_rollover"):
            p["down"] = round(rng.uniform(0.0, 0.4), 3)
        elif kind in ("etcd_kill", "etcd_kill_leader"):
            p["member"] = rng.randrange(3)
            p["down"] = round(rng.uniform(0.5, 3.0), 3)
        elif kind == "etcd_stop":
            p["member"] = rng.randrange(3)
            p["seconds"] = round(rng.uniform(0.5, 3.0), 3)
        out.append((round(t, 3), kind, p))
        t += p.get("seconds", 0.5) + p.get("down", 0) + rng.uniform(1.0, 4.0)
    return out
