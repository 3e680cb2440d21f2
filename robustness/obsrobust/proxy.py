"""A mutating proxy for the self-tests (selftest.py): it sits between the clients and the
daemon, forwards every byte, and — once, on the connection of a chosen client, after a chosen
number of matching lines — breaks what the daemon sent the way a buggy daemon would: drops an
event, duplicates one, swaps two, rewrites an `old`, a coalesced `new`, a snapshot's value, an
`overflow`'s `revs`, a `progress` revision (below the subscription's last event), a lease end's `lease`, a `get` or `list` reply, a
write's `changed`, a catch-up's `values` or `deleted` (one left out, one never there put in); holds a change event back behind the
`sync` reply of its subscription; or removes `echo: false` from a subscribe request on its way
to the daemon.
The histories the clients record then hold a defect the validators must find.

Run as `python3 -m obsrobust.proxy CONFIG.json`: {"listen", "upstream", "log", "mutations":
[{"client", "kind", "after"}]}. A connection is named by the `client` of its first request
(`hello`, which every suite connection sends first). Each mutation applies once — or
`times` times, where one may land on an event the validators cannot decide — and proxy.log
records each.
"""

import json
import os
import socket
import sys
import threading
import time

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class Mutations:
    def __init__(self, cfg):
        self.lock = threading.Lock()
        self.todo = [dict(m, seen=0, done=False) for m in cfg["mutations"]]
        self.log = open(cfg["log"], "a", buffering=1)

    def pick(self, client, kind_pred):
        """The first pending mutation for `client` whose kind satisfies `kind_pred`."""
        for m in self.todo:
            if not m["done"] and client.startswith(m["client"]) and kind_pred(m["kind"]):
                return m
        return None

    def record(self, m, conn, before, after):
        m["made"] = m.get("made", 0) + 1
        m["done"] = m["made"] >= m.get("times", 1)
        self.log.write(_encode({"t": time.monotonic_ns(), "client": m["client"], "conn": conn, "kind": m["kind"],
                                "before": before, "after": after}) + "\n")


class EchoFlip:
    """An echo_flip in flight on one connection: a subscribe sent without its `echo: false`. It
    counts — is recorded — once that subscription delivers one of the connection's own writes,
    which is what the validator must flag; refused, unsubscribed, ended by an overflow or cut
    before that, it is made again on a later subscribe of the client."""

    def __init__(self, m, req_id, repo, before, after):
        self.m, self.req_id, self.repo, self.before, self.after = m, req_id, repo, before, after
        self.sub = None  # its id, once accepted
        self.revs = set()  # the revisions of its events so far

    def shown(self, pair):
        pair.p.m.record(self.m, pair.name, self.before, self.after)
        pair.flip = None


class Pair:
    def __init__(self, proxy, client_sock):
        self.p = proxy
        self.c = client_sock
        self.u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.name = "?"
        self.ops = []  # ops of requests not yet answered (for reply mutations)
        self.held = None  # a change event held back (reorder)
        self.ops_lock = threading.Lock()
        self.syncs = {}  # sub -> sync requests of it not yet answered
        self.sync_subs = []  # the subs of the sync requests not yet answered, in order
        self.sync_held = None  # (sub, rev, [lines]): a change event and what followed it, held for sync_early
        self.flip = None  # the EchoFlip in flight on this connection
        self.sub_last = {}  # sub -> the highest revision of its change events so far (progress_behind)
        self.own = set()  # (repo, rev) of this connection's writes that made a revision
        self.write_repos = {}  # request id -> repo, of writes not yet answered

    def start(self):
        try:
            self.u.connect(self.p.upstream)
        except OSError:
            self.c.close()
            return
        threading.Thread(target=self.up, daemon=True).start()
        threading.Thread(target=self.down, daemon=True).start()

    def lines(self, sock):
        buf = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                if buf:
                    yield buf, False
                return
            buf += data
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    break
                yield buf[:i], True
                buf = buf[i + 1:]

    def up(self):
        """Client to daemon: names the connection, and may remove `echo: false`."""
        try:
            for line, whole in self.lines(self.c):
                out = line
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    if obj.get("op") == "hello" and isinstance(obj.get("client"), str) and self.name == "?":
                        self.name = obj["client"]
                    with self.ops_lock:
                        self.ops.append(obj.get("op"))
                        if obj.get("op") == "sync" and isinstance(obj.get("sub"), int):
                            self.syncs[obj["sub"]] = self.syncs.get(obj["sub"], 0) + 1
                            self.sync_subs.append(obj["sub"])
                    # (Not a `once` subscription, nor one of a few keys: its own writes must show;
                    # nor a request refused anyway: `catchup` without `since`.)
                    with self.p.m.lock:
                        if obj.get("op") in ("set", "delete", "batch") and "id" in obj:
                            self.write_repos[json.dumps(obj["id"])] = obj.get("repo")
                        elif obj.get("op") == "unsubscribe" and self.flip is not None and obj.get("sub") == self.flip.sub:
                            self.rearm_flip()
                    if obj.get("op") == "subscribe" and obj.get("echo") is False and not obj.get("once") and "keys" not in obj \
                            and not (obj.get("catchup") is True and "since" not in obj):
                        with self.p.m.lock:
                            m = self.p.m.pick(self.name, lambda k: k == "echo_flip") if self.flip is None else None
                            if m is not None and "id" in obj:
                                del obj["echo"]
                                out = _encode(obj).encode()
                                m["done"] = True  # (while in flight: see EchoFlip)
                                self.flip = EchoFlip(m, json.dumps(obj["id"]), obj.get("repo"), line.decode(), out.decode())
                else:
                    with self.ops_lock:
                        self.ops.append(None)
                self.u.sendall(out + (b"\n" if whole else b""))
            self.u.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def send(self, data):
        self.c.sendall(data + b"\n")

    def down(self):
        """Daemon to client: the mutations of what the daemon says."""
        try:
            for line, whole in self.lines(self.u):
                if not whole:
                    self.c.sendall(line)
                    break
                self.forward(line)
            if self.sync_held is not None:
                for held in self.sync_held[2]:
                    self.send(held)
                self.sync_held = None
        except OSError:
            pass
        with self.p.m.lock:
            self.rearm_flip()  # the connection ended before the flip showed
        try:
            self.c.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def forward(self, line):
        for out in self.mutate_event(line):
            self.send(out)

    def rearm_flip(self):
        """The flip in flight can no longer show: it is made again on a later subscribe (called
        under the mutations' lock)."""
        if self.flip is not None:
            self.flip.m["done"] = False
            self.flip = None

    def echo_flip_saw(self, obj):
        """Follows the flip in flight through what the daemon sends: the flipped subscription's
        reply (refused: made again), write replies (the connection's own revisions), its events
        (one at an own revision: recorded, the flip showed) and an overflow ending it."""
        with self.p.m.lock:
            f = self.flip
            if "event" not in obj:
                key = json.dumps(obj.get("id"))
                repo = self.write_repos.pop(key, None)
                if repo is not None and obj.get("ok") and obj.get("changed") and isinstance(obj.get("rev"), int):
                    self.own.add((repo, obj["rev"]))
                    if f is not None and repo == f.repo and obj["rev"] in f.revs:
                        f.shown(self)
                elif f is not None and f.sub is None and key == f.req_id:
                    if obj.get("ok") and isinstance(obj.get("sub"), int):
                        f.sub = obj["sub"]
                    else:
                        self.rearm_flip()  # refused (a deliberately bad resume): it could never show
            elif f is not None and f.sub is not None:
                if obj.get("event") == "overflow" and str(f.sub) in obj.get("revs", {}):
                    self.rearm_flip()
                elif obj.get("sub") == f.sub and isinstance(obj.get("rev"), int):
                    if (f.repo, obj["rev"]) in self.own:
                        f.shown(self)
                    else:
                        f.revs.add(obj["rev"])

    def sync_early(self, obj, line, is_reply, op, sync_sub):
        """sync_early: a change event of a subscription with a `sync` outstanding is held, with
        every event after it, until that sync's reply, which then goes first — if the change
        is at or below the reply's revision and no other reply was held (replies stay in
        order). The lines to send now, or None to go on as usual."""
        if self.sync_held is None:
            return None
        sub, rev, lines = self.sync_held
        if not is_reply and len(lines) < 1000:
            lines.append(line)
            return []
        mm = self.p.m
        self.sync_held = None
        if op == "sync" and sync_sub == sub and obj.get("ok") and isinstance(obj.get("rev"), int) and rev <= obj["rev"]:
            with mm.lock:
                m = mm.pick(self.name, lambda k: k == "sync_early")
                if m is not None:
                    mm.record(m, self.name, lines[0].decode(), "held back behind the sync reply " + line.decode())
                    return [line] + lines
        return lines + [line]

    def mutate_event(self, line):
        """The lines to send for `line` (decided under the mutations' lock, sent outside it:
        a client that does not read must not hold up the other connections)."""
        try:
            obj = json.loads(line)
        except ValueError:
            return [line]
        if not isinstance(obj, dict):
            return [line]
        self.echo_flip_saw(obj)
        if "event" not in obj:
            sync_sub = None
            with self.ops_lock:
                op = self.ops.pop(0) if self.ops else None
                if op == "sync" and self.sync_subs:
                    sync_sub = self.sync_subs.pop(0)
                    self.syncs[sync_sub] -= 1
            held = self.sync_early(obj, line, True, op, sync_sub)
            if held is not None:
                return held
            return self.mutate_reply(obj, op, line)
        mm = self.p.m
        ev = obj.get("event")
        if ev == "change" and isinstance(obj.get("sub"), int) and isinstance(obj.get("rev"), int):
            self.sub_last[obj["sub"]] = max(self.sub_last.get(obj["sub"], 0), obj["rev"])
        held = self.sync_early(obj, line, False, None, None)
        if held is not None:
            return held
        if ev == "change" and "from" not in obj and self.syncs.get(obj.get("sub"), 0) > 0:
            with mm.lock:
                m = mm.pick(self.name, lambda k: k == "sync_early")
                if m is not None:
                    m["seen"] += 1
                    if m["seen"] > m.get("after", 0):
                        self.sync_held = (obj.get("sub"), obj.get("rev", 0), [line])
                        return []
        with mm.lock:
            if self.held is not None and ev == "change" and obj.get("sub") == self.held[0]:
                held, self.held = self.held[1], None
                return [line, held]
            kinds = {"change": ("drop_event", "dup_event", "reorder", "rewrite_old", "coalesce_new", "strip_lease"),
                     "overflow": ("overflow_revs",), "progress": ("progress_behind",), "snapshot": ("snapshot_alter",),
                     "catchup": ("catchup_values", "catchup_deleted")}.get(ev, ())
            m = mm.pick(self.name, lambda k: k in kinds)
            if m is None:
                return [line]
            k = m["kind"]
            ok = True
            if k in ("drop_event", "dup_event", "reorder", "rewrite_old"):
                ok = "from" not in obj
                if k == "rewrite_old":
                    ok = ok and any("old" in c for c in obj.get("changes", []))
            elif k == "coalesce_new":
                ok = "from" in obj and any("new" in c for c in obj.get("changes", []))
            elif k == "strip_lease":
                ok = "lease" in obj
            elif k == "snapshot_alter":
                ok = bool(obj.get("values"))
            elif k == "progress_behind":
                ok = self.sub_last.get(obj.get("sub"), 0) >= 2
            elif k == "catchup_values":
                ok = bool(obj.get("values"))
            elif k == "catchup_deleted":
                ok = bool(obj.get("deleted"))
            if ok:
                m["seen"] += 1
            if not ok or m["seen"] <= m.get("after", 0):
                return [line]
            if k == "drop_event":
                mm.record(m, self.name, line.decode(), None)
                return []
            if k == "dup_event":
                mm.record(m, self.name, line.decode(), "twice")
                return [line, line]
            if k == "reorder":
                self.held = (obj.get("sub"), line)
                mm.record(m, self.name, line.decode(), "held back behind the next event of its subscription")
                return []
            if k == "rewrite_old":
                for c in obj["changes"]:
                    if "old" in c:
                        c["old"] = "bogus-old"
                        break
            elif k == "coalesce_new":
                for c in obj["changes"]:
                    if "new" in c:
                        c["new"] = "bogus-new"
                        break
            elif k == "strip_lease":
                del obj["lease"]
            elif k == "overflow_revs":
                obj["revs"] = {s: v + 50 for s, v in obj.get("revs", {}).items()}
            elif k == "progress_behind":
                # Below the subscription's last event: wrong whatever the validator knows of
                # the revisions' content. (Ahead of the repository went unseen: 40 ahead when
                # the subscription coalesced keys that did not change in them; 2,000 ahead when
                # a loaded machine's run went on past it and the revisions between were of
                # unknown content; and a progress ahead of the whole run makes the validator
                # walk every revision up to it.)
                obj["rev"] = self.sub_last[obj["sub"]] - 1
            elif k == "snapshot_alter":
                key = sorted(obj["values"])[0]
                obj["values"][key] = "bogus-snapshot"
            elif k == "catchup_values":
                key = sorted(obj["values"])[0]
                obj["values"][key] = "bogus-catchup"
            elif k == "catchup_deleted":
                # One deletion left out (a key created and deleted again may rightly be left
                # out, so also one that never existed put in: wrong either way).
                obj["deleted"] = sorted(obj["deleted"][1:] + ["zz/never"], key=lambda k: k.encode())
            out = _encode(obj).encode()
            mm.record(m, self.name, line.decode(), out.decode())
            return [out]

    def mutate_reply(self, obj, op, line):
        mm = self.p.m
        with mm.lock:
            kinds = {"get": ("get_value",), "list": ("list_stale",), "set": ("write_unchanged",)}.get(op, ())
            m = mm.pick(self.name, lambda k: k in kinds) if obj.get("ok") else None
            if m is None:
                return [line]
            k = m["kind"]
            ok = (k == "get_value" and "value" in obj) or (k == "list_stale" and obj.get("rev", 0) > 20 and obj.get("keys")) or (
                k == "write_unchanged" and obj.get("changed") is True)
            if ok:
                m["seen"] += 1
            if not ok or m["seen"] <= m.get("after", 0):
                return [line]
            if k == "get_value":
                obj["value"] = "bogus-get"
            elif k == "list_stale":
                # Half its revision: well before the request was sent (3 back was still
                # inside the window of a slow reply on a loaded machine).
                obj["rev"] = obj["rev"] // 2
            elif k == "write_unchanged":
                # Answered at the revision before its own: the model knows the state there from
                # the writes acknowledged before (the state at the write's own revision is
                # unknown to it when no watcher saw that revision — a loaded machine's run).
                obj["changed"] = False
                obj["rev"] = obj["rev"] - 1
            out = _encode(obj).encode()
            mm.record(m, self.name, line.decode(), out.decode())
            return [out]


class Proxy:
    def __init__(self, cfg):
        self.listen = cfg["listen"]
        self.upstream = cfg["upstream"]
        self.m = Mutations(cfg)

    def serve(self):
        try:
            os.unlink(self.listen)
        except OSError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.listen)
        s.listen(256)
        while True:
            c, _ = s.accept()
            Pair(self, c).start()


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    Proxy(cfg).serve()


if __name__ == "__main__":
    main()
