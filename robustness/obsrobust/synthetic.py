"""Hand-written histories for the catch-up (`catchup: true`) and `sync` validators (contract,
"Catching up" and "Sync"): the defects a right daemon never shows and the mutating proxy cannot
make (a diff from another epoch, a snapshot where a replay or a diff is due, a sync before
synced or above the repository, a bad request accepted), so that those checks are seen to pass
a correct history and to fail a wrong one (selftest.py runs these first, in a second). Each
case is a small run directory written from lines of wire.py's history format."""

import json
import os
import shutil

E = "e" * 32  # the repository's epoch
F = "f" * 32  # another history's


def write_run(d, lines):
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    with open(os.path.join(d, "faults.log"), "w") as f:
        f.write(json.dumps({"event": "generation", "gen": 0, "t": 1}) + "\n")
        f.write(json.dumps({"event": "spawn", "daemon": 0, "inc": 1, "pid": 1, "t": 10, "args": []}) + "\n")
        f.write(json.dumps({"event": "serving", "daemon": 0, "inc": 1, "t": 20}) + "\n")
        f.write(json.dumps({"event": "traffic", "phase": "start", "t": 30}) + "\n")
    with open(os.path.join(d, "plan.json"), "w") as f:
        # A history of two revisions: a catch-up from revision 1 of 4 may be a diff.
        json.dump({"seed": 0, "mode": "local", "faults": [], "features": {"catchup": True, "sync": True},
                   "history_limit": 2, "tombstones_kept": True, "synthetic": True}, f)
    with open(os.path.join(d, "h-x.log"), "w") as f:
        for t, conn, kind, data in lines:
            f.write(f"{t} {conn} {kind} {json.dumps(data, separators=(',', ':')) if not isinstance(data, str) else data}\n")


def base():
    """Four writes on r0 (k1, k2, k1 deleted, k3), seen by a subscriber of every key."""
    L = []
    t = 1000
    L.append((t, "a.1", "O", {"daemon": 0, "socket": "s"}))
    L.append((t + 1, "a.1", ">", {"op": "subscribe", "repo": "r0", "initial": True, "id": 1}))
    L.append((t + 2, "a.1", "<", {"id": 1, "ok": True, "sub": 1, "rev": 0, "epoch": E}))
    L.append((t + 3, "a.1", "<", {"event": "snapshot", "sub": 1, "repo": "r0", "rev": 0, "values": {}}))
    L.append((t + 4, "w.1", "O", {"daemon": 0, "socket": "s"}))
    writes = [({"op": "set", "repo": "r0", "key": "k1", "value": "v1"}, {"rev": 1, "changed": True}, [{"key": "k1", "new": "v1"}]),
              ({"op": "set", "repo": "r0", "key": "k2", "value": "v2"}, {"rev": 2, "changed": True}, [{"key": "k2", "new": "v2"}]),
              ({"op": "delete", "repo": "r0", "key": "k1"}, {"rev": 3, "changed": True, "old": "v1"}, [{"key": "k1", "old": "v1"}]),
              ({"op": "set", "repo": "r0", "key": "k3", "value": "v3"}, {"rev": 4, "changed": True}, [{"key": "k3", "new": "v3"}])]
    t = 2000
    for i, (req, rep, changes) in enumerate(writes, 1):
        L.append((t, "w.1", ">", dict(req, id=i)))
        L.append((t + 5, "w.1", "<", dict({"id": i, "ok": True}, **rep)))
        L.append((t + 6, "a.1", "<", {"event": "change", "sub": 1, "repo": "r0", "rev": rep["rev"], "changes": changes}))
        t += 100
    return L


def catchup_lines(mode="diff", values=None, deleted=None, epoch=E, since=1, sync_before_synced=False, sync_rev=4):
    L = []
    t = 5000
    L.append((t, "c.1", "O", {"daemon": 0, "socket": "s"}))
    req = {"op": "subscribe", "repo": "r0", "since": since, "epoch": epoch, "catchup": True, "id": 1}
    L.append((t + 1, "c.1", ">", req))
    L.append((t + 2, "c.1", ">", {"op": "sync", "sub": 1, "id": 2}))
    L.append((t + 3, "c.1", "<", {"id": 1, "ok": True, "sub": 1, "rev": 4, "epoch": E, "catchup": mode}))
    if sync_before_synced:
        L.append((t + 4, "c.1", "<", {"id": 2, "ok": True, "rev": sync_rev}))
    if mode == "diff":
        L.append((t + 5, "c.1", "<", {"event": "catchup", "sub": 1, "repo": "r0", "from": since, "rev": 4,
                                      "values": values if values is not None else {"k2": "v2", "k3": "v3"},
                                      "deleted": deleted if deleted is not None else ["k1"]}))
    elif mode == "snapshot":
        L.append((t + 5, "c.1", "<", {"event": "snapshot", "sub": 1, "repo": "r0", "rev": 4, "values": {"k2": "v2", "k3": "v3"}}))
    else:
        for rev, ch in ((2, [{"key": "k2", "new": "v2"}]), (3, [{"key": "k1", "old": "v1"}]), (4, [{"key": "k3", "new": "v3"}])):
            if rev > since:
                L.append((t + 5, "c.1", "<", {"event": "change", "sub": 1, "repo": "r0", "rev": rev, "changes": ch}))
    L.append((t + 6, "c.1", "<", {"event": "synced", "sub": 1, "repo": "r0", "rev": 4}))
    if not sync_before_synced:
        L.append((t + 7, "c.1", "<", {"id": 2, "ok": True, "rev": sync_rev}))
    return L


def bad_requests(once_ok=False, sync_ok=False):
    L = []
    t = 6000
    L.append((t, "b.1", "O", {"daemon": 0, "socket": "s"}))
    L.append((t + 1, "b.1", ">", {"op": "subscribe", "repo": "r0", "since": 1, "once": True, "catchup": True, "id": 1}))
    L.append((t + 2, "b.1", ">", {"op": "sync", "sub": "1", "id": 2}))
    L.append((t + 3, "b.1", "<", {"id": 1, "ok": True, "sub": 1, "rev": 4, "epoch": E, "catchup": "replay"} if once_ok else
              {"id": 1, "ok": False, "error": {"code": "bad_request", "message": "catchup with once"}}))
    L.append((t + 4, "b.1", "<", {"id": 2, "ok": True, "rev": 4} if sync_ok else
              {"id": 2, "ok": False, "error": {"code": "bad_request", "message": "sub"}}))
    return L


# (name, lines, expected violation title prefix or None for a clean history)
CASES = [
    ("catch-up by diff, right", lambda: base() + catchup_lines("diff"), None),
    ("catch-up by replay, right", lambda: base() + catchup_lines("replay"), None),
    ("a catch-up's values wrong", lambda: base() + catchup_lines("diff", values={"k2": "v1", "k3": "v3"}),
     "a catch-up's values are not the keys changed above from"),
    ("a catch-up's values holding an unchanged key", lambda: base() + catchup_lines("diff", since=2, values={"k2": "v2", "k3": "v3"}),
     "a catch-up's values are not the keys changed above from"),
    ("a deletion left out of a catch-up", lambda: base() + catchup_lines("diff", deleted=[]),
     "a catch-up's deleted is not the keys gone since from"),
    ("a catch-up from another history not by snapshot", lambda: base() + catchup_lines("diff", epoch=F),
     "a catch-up from another history or the future not by snapshot"),
    ("a catch-up by snapshot while the history holds every revision", lambda: base() + catchup_lines("snapshot", since=4),
     "a catch-up by snapshot though the history holds every revision above since"),
    ("a catch-up by snapshot though every deletion is known", lambda: base() + catchup_lines("snapshot", since=1),
     "a catch-up by snapshot though the daemon remembers every deletion"),
    ("catchup with once, sync with a string sub: refused", lambda: base() + bad_requests(), None),
    ("catchup with once accepted", lambda: base() + bad_requests(once_ok=True), "catchup with once not refused as bad_request"),
    ("sync with a string sub accepted", lambda: base() + bad_requests(sync_ok=True), "sync with sub '1' not refused as bad_request"),
    ("sync answered before synced", lambda: base() + catchup_lines("diff", sync_before_synced=True),
     "sync answered before the subscription caught up"),
    ("sync above the repository's revision", lambda: base() + catchup_lines("diff", sync_rev=9),
     "sync at a revision outside its window"),
]


def run_cases(base_dir, validate_run):
    """Runs every case; returns [(name, ok, what)]."""
    out = []
    for i, (name, make, expect) in enumerate(CASES):
        d = os.path.join(base_dir, f"case{i}")
        write_run(d, make())
        res = validate_run(d, lambda s: None)
        titles = [v.title for v in res.violations]
        if expect is None:
            out.append((name, not titles, titles[:2] if titles else "clean"))
        else:
            hit = next((t for t in titles if t.startswith(expect)), None)
            out.append((name, hit is not None, hit or f"not caught (got {titles[:2]})"))
    return out
