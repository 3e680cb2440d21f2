"""The orchestrator of one mode (local, or etcd): starts what the mode needs, the client
processes, injects the planned faults while they run, then reads every repository through a
graceful restart, stops everything, and leaves the run's directory for the validators:

    plan.json          the seed, the mode, the clients, the fault schedule
    faults.log         every fault and every daemon start/end (JSON lines, monotonic ns)
    h-<client>.log     each client's history (wire.py)
    obsd<i>.<n>.log    each daemon incarnation's log
"""

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

from . import plan as planmod
from .cluster import Daemon, Disk, Etcd, FaultLog, Failpoints
from .wire import Conn, Recorder, now_ns

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)

# --history-limit of every daemon (see Mode.__init__).
HISTORY_LIMIT = 2000

# Small thresholds so that checkpoints and log roll-overs happen every few seconds under the
# traffic, and a crash lands in one often (test-only failpoint tunables, Failpoints.swift).
TUNABLES = ["store.segment-size=value(524288)", "store.snapshot-log-bytes=value(262144)",
            "store.checkpoint-interval-ms=value(50)"]


def find(paths):
    for p in paths:
        if p and os.path.exists(p):
            return p
    return None


class Mode:
    def __init__(self, mode, seed, seconds, out, known_open, obsd, log=print, overrides=None):
        self.overrides = overrides or {}
        self.end_file = os.path.join(out, "traffic-end")
        # The history each repository keeps (--history-limit): a few seconds of this traffic
        # locally, so that a resume from further back is a catch-up by diff (contract,
        # "Catching up") while an auditor's resume after a fault is still a replay.
        self.history_limit = self.overrides.get("history_limit", HISTORY_LIMIT)
        self.mode = mode
        self.seed = seed
        self.seconds = seconds
        self.out = out
        self.known_open = frozenset(known_open or ())
        self.obsd = obsd
        self.log = log
        os.makedirs(out, exist_ok=True)
        self.flog = FaultLog(os.path.join(out, "faults.log"))
        self.daemons = []
        self.etcd = None
        self.disk = None
        self.fault_count = 0
        self.problems = []  # things the orchestrator saw go wrong (a daemon that would not start)
        self.generation = 0

    # Setting up

    def daemon_args(self, i):
        common = ["--log-target", "stderr", "--queue-events", "2000", "--queue-bytes", "1048576",
                  "--overflow-grace", "2", "--max-line", "65536", "--history-limit", str(self.history_limit), "--threads", "2"]
        if self.mode == "etcd":
            return ["--socket", os.path.join(self.out, f"obsd{i}.sock"), "--etcd-endpoints", ",".join(self.etcd.endpoints),
                    "--etcd-prefix", f"/robust-{self.seed}/"] + common
        return ["--socket", os.path.join(self.out, "obsd0.sock"), "--data-dir", self.data_dir()] + common

    def data_dir(self):
        if getattr(self, "dir_override", None):
            return self.dir_override
        base = self.disk.mount if self.disk else os.path.join(self.out, "data")
        return os.path.join(base, f"data{self.generation}")

    def setup(self):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OBSD_FAILPOINTS": "@" + os.path.join(self.out, "failpoints"),
               "OBSD_FAILPOINTS_SEED": str(planmod.derive(self.seed, self.mode, "failpoints") % (1 << 62))}
        self.fp = Failpoints(os.path.join(self.out, "failpoints"),
                             (TUNABLES if self.mode == "local" else []) + self.overrides.get("failpoints", []))
        if self.mode == "etcd":
            etcd = find([os.path.join(ROOT, ".build/etcd/usr/bin/etcd"), "/usr/bin/etcd"])
            etcdctl = find([os.path.join(ROOT, ".build/etcd/usr/bin/etcdctl"), "/usr/bin/etcdctl"])
            if not etcd or not etcdctl:
                raise RuntimeError("etcd is not there: `make etcd` unpacks it into .build/etcd")
            self.etcd = Etcd(etcd, etcdctl, os.path.join(self.out, "etcd"), self.flog)
            if not self.etcd.start():
                raise RuntimeError("the etcd cluster did not become healthy")
            n = 2
        else:
            self.disk = Disk(self.out)
            self.flog.add(event="disk", real=self.disk.real)
            n = 1
        self.flog.add(event="generation", gen=self.generation)
        for i in range(n):
            d = Daemon(i, self.obsd, None, self.out, self.flog, [], env)
            self.daemons.append(d)
        for i, d in enumerate(self.daemons):
            d.base_args = self.daemon_args(i)
            d.socket = d.base_args[1]
            d.start()
        for d in self.daemons:
            if not d.wait_serving(60.0):
                raise RuntimeError(f"obsd {d.index} did not start:\n{d.log_tail()}")
        self.features = self.probe(self.daemons[0].socket)
        self.flog.add(event="features", **self.features)

    def probe(self, path):
        """Whether the daemon does catch-up and sync (contract, "Catching up", "Sync"): asked
        once; until it does, the traffic sends neither and the validators see none."""
        import socket as so
        feats = {"catchup": False, "sync": False}
        try:
            s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
            s.settimeout(10.0)
            s.connect(path)
            s.sendall(b'{"id":1,"op":"sync","sub":999999}\n'
                      b'{"id":2,"op":"subscribe","repo":"probe.features","since":0,"catchup":true}\n')
            buf = b""
            while buf.count(b"\n") < 2:
                data = s.recv(65536)
                if not data:
                    break
                buf += data
            s.close()
            replies = [json.loads(l) for l in buf.split(b"\n")[:2] if l.strip()]
            for rep in replies:
                if rep.get("id") == 1:
                    feats["sync"] = (rep.get("error") or {}).get("code") != "unknown_op"
                elif rep.get("id") == 2:
                    feats["catchup"] = bool(rep.get("ok")) and "catchup" in rep
        except (OSError, ValueError):
            pass
        return feats

    # Clients

    def start_clients(self, start_ns, end_ns, stop_ns):
        clients = planmod.clients(self.seed, self.mode, self.seconds < 200, self.known_open)
        for c in clients:
            c.update(self.overrides.get("clients", {}).get(c["name"], {}))
        clients += self.overrides.get("extra_clients", [])
        for c in clients:
            c.setdefault("seed", planmod.derive(self.seed, self.mode, c["name"]))
        sockets = [d.socket for d in self.daemons]
        if "proxy" in self.overrides:
            sockets = [self.start_proxy(sockets[0])]
        self.procs = []
        for c in clients:
            cfg = dict(c)
            cfg.update({
                "out": os.path.join(self.out, f"h-{c['name']}.log"),
                "start_ns": start_ns, "end_ns": end_ns, "stop_ns": stop_ns,
                "sockets": sockets,
                "repos": planmod.REPOS, "keys": planmod.KEYS, "max_line": 65536,
                "catchup": self.features["catchup"], "sync": self.features["sync"],
                "history_limit": self.history_limit,
                "end_file": self.end_file if "proxy" in self.overrides else None,
            })
            path = os.path.join(self.out, f"client-{c['name']}.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            p = subprocess.Popen([sys.executable, "-m", "obsrobust.client", path], cwd=HERE,
                                 stdout=open(os.path.join(self.out, f"client-{c['name']}.out"), "w"), stderr=subprocess.STDOUT)
            self.procs.append((c["name"], p))
        return clients

    def start_proxy(self, upstream):
        listen = os.path.join(self.out, "proxy.sock")
        cfg = {"listen": listen, "upstream": upstream, "log": os.path.join(self.out, "proxy.log"),
               "mutations": self.overrides["proxy"]}
        path = os.path.join(self.out, "proxy.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.proxy = subprocess.Popen([sys.executable, "-m", "obsrobust.proxy", path], cwd=HERE,
                                      stdout=open(os.path.join(self.out, "proxy.out"), "w"), stderr=subprocess.STDOUT)
        # The daemon sees the proxy's credentials on every connection (`by`).
        self.flog.add(event="proxy", pid=self.proxy.pid)
        for _ in range(200):
            if os.path.exists(listen):
                break
            time.sleep(0.01)
        return listen

    # Faults

    def restart(self, d, extra=None):
        d.start(extra)
        if not d.wait_serving(60.0):
            tail = d.log_tail()
            self.problems.append({"kind": "restart", "daemon": d.index, "inc": d.incarnation, "log": tail})
            self.flog.add(event="start-failed", daemon=d.index, inc=d.incarnation)
            self.log(f"robustness: obsd {d.index} did not start again (incarnation {d.incarnation}):\n{tail}")
            # Keep the evidence, then go on with a new data directory (a new history).
            if self.mode == "local":
                d.kill9()
                self.new_generation()
                d.base_args = self.daemon_args(d.index)
                d.start(extra)
                d.wait_serving(60.0)

    def new_generation(self):
        self.dir_override = None
        self.generation += 1
        self.flog.add(event="generation", gen=self.generation)

    def sync_args(self, relaxed):
        return ["--sync", "relaxed", "--sync-interval", "200"] if relaxed else []

    def wait_fired(self, point, seconds):
        """Waits (at most `seconds`) until the failpoint `point` has triggered in the daemon —
        it notes each trigger in the failpoints file's `.fired` (Failpoints.swift) — and notes
        in the fault log whether it did."""
        path, deadline = self.fp.path + ".fired", time.monotonic() + seconds
        fired = False
        while not fired and time.monotonic() < deadline:
            try:
                with open(path) as f:
                    fired = any(line.startswith(point + " ") for line in f)
            except OSError:
                pass
            if not fired:
                time.sleep(0.02)
        self.flog.add(event="fault-note", kind="fired", point=point, fired=fired)

    def inject(self, kind, p):
        d = self.daemons[p.get("daemon", 0)] if self.daemons else None
        t0 = self.flog.add(event="fault", kind=kind, params=p, phase="start")
        if kind == "kill9":
            if p.get("after_fired"):
                self.wait_fired(p["after_fired"], p.get("wait", 10.0))
                time.sleep(p.get("then", 0.0))
            d.kill9()
            time.sleep(p["down"])
            self.restart(d, d.extra)
        elif kind in ("kill9_checkpoint", "kill9_rollover", "torn"):
            spec = {"kill9_checkpoint": "checkpoint.commit=crash@times(1)", "kill9_rollover": "wal.open=crash@times(1)",
                    "torn": "wal.write=torn@times(1)"}[kind]
            self.fp.arm(spec)
            died = d.reap(timeout=6.0) is not None
            self.fp.disarm()
            if not died:
                d.kill9()
            self.flog.add(event="fault-note", kind=kind, died_by_failpoint=died)
            time.sleep(p["down"])
            self.restart(d, d.extra)
        elif kind == "sigstop":
            d.stop()
            time.sleep(p["seconds"])
            d.cont()
        elif kind in ("eio", "diskfull"):
            if kind == "eio":
                self.fp.arm("wal.fdatasync=error(EIO)@p0.3;wal.write=error(EIO)@p0.2")
            elif self.disk and self.disk.real:
                self.disk.fill()
            else:
                self.fp.arm("wal.write=error(ENOSPC);wal.open=error(ENOSPC)")
            time.sleep(p["seconds"])
            self.fp.disarm()
            if self.disk:
                self.disk.free()
            time.sleep(0.2)
            # A write the log could neither cut off nor void leaves the daemon refusing writes
            # until it restarts (docs/PROTOCOL.md): an operator restarts it; so does the suite.
            if d.log_contains("takes no more writes until it restarts"):
                self.flog.add(event="fault-note", kind=kind, restart="outcome unknown")
                d.kill9()
                self.restart(d, d.extra)
        elif kind == "restart":
            d.term()
            self.restart(d, d.extra)
        elif kind == "relaxed":
            d.kill9()
            time.sleep(p["down"])
            relaxed = "relaxed" not in d.extra
            self.restart(d, self.sync_args(relaxed))
        elif kind == "wipe":
            d.kill9()
            self.new_generation()
            d.base_args = self.daemon_args(d.index)
            time.sleep(p["down"])
            self.restart(d, d.extra)
        elif kind == "copydir":
            # The data directory copied to a new place (a restored backup): the snapshot file is
            # not the one the store last wrote, so every repository must start a new epoch.
            d.term()
            src = self.data_dir()
            self.generation_copy = getattr(self, "generation_copy", 0) + 1
            dst = src + f".copy{self.generation_copy}"
            subprocess.run(["cp", "-a", src, dst], check=True)
            d.base_args = [a if a != src else dst for a in d.base_args]
            self.dir_override = dst
            self.flog.add(event="fault-note", kind=kind, copied_to=dst)
            self.restart(d, d.extra)
        elif kind == "truncate":
            d.kill9()
            wal = os.path.join(self.data_dir(), "wal")
            segs = sorted(os.listdir(wal)) if os.path.isdir(wal) else []
            if segs:
                # Cut the last segment to half of what it holds (it is preallocated: its
                # written part ends at its last non-zero byte).
                path = os.path.join(wal, segs[-1])
                with open(path, "rb") as f:
                    data = f.read()
                used = len(data.rstrip(b"\0"))
                with open(path, "r+b") as f:
                    f.truncate(max(16, used // 2))
                self.flog.add(event="fault-note", kind=kind, file=segs[-1], used=used, cut_to=max(16, used // 2))
            time.sleep(p["down"])
            # A log that lost acknowledged writes outside obsd is refused, naming the file
            # (README, durability); `obsd --repair-log` goes on without them, every repository
            # in a new epoch, as an operator would. A daemon that starts on it anyway is seen
            # by the validators (revision numbers handed out again under the same epoch).
            d.start(d.extra)
            if d.wait_serving(60.0):
                self.flog.add(event="fault-note", kind=kind, refused=False)
            else:
                d.reap(timeout=5.0) if d.proc is not None and d.proc.poll() is not None else d.kill9()
                tail = d.log_tail()
                self.flog.add(event="fault-note", kind=kind, refused=True, log=tail[-400:])
                rp = subprocess.run([self.obsd, "--repair-log", "--data-dir", self.data_dir()], capture_output=True, text=True,
                                    timeout=120, env=d.env)
                self.flog.add(event="repair", daemon=d.index, rc=rp.returncode, out=(rp.stdout + rp.stderr)[-600:])
                self.restart(d, d.extra)
        elif kind in ("etcd_kill", "etcd_kill_leader"):
            m = p["member"]
            if kind == "etcd_kill_leader":
                leader = self.etcd.leader()
                m = leader if leader is not None else m
                self.flog.add(event="fault-note", kind=kind, member=m)
            self.etcd.kill(m)
            time.sleep(p["down"])
            self.etcd.restart(m)
            self.etcd.wait_healthy(20.0)
        elif kind == "etcd_stop":
            self.etcd.stop(p["member"])
            time.sleep(p["seconds"])
            self.etcd.cont(p["member"])
            self.etcd.wait_healthy(20.0)
        elif kind == "etcd_compact":
            rev = self.etcd.revision()
            if rev:
                rc, out = self.etcd.ctl("compact", str(rev))
                self.flog.add(event="fault-note", kind=kind, revision=rev, rc=rc, out=out.strip()[:200])
        self.flog.add(event="fault", kind=kind, params=p, phase="end", started=t0)
        self.fault_count += 1

    # The run

    def run(self):
        self.setup()
        schedule = self.overrides.get("faults")
        if schedule is None:
            schedule = planmod.faults(self.seed, self.mode, self.seconds, self.known_open)
        clients = None
        start = now_ns() + 1_000_000_000
        # A self-test scenario that waits for its proxy's mutations runs at least `seconds`,
        # at most `max_seconds`, and ends as soon as every mutation was made (a loaded machine
        # makes the traffic that triggers them slowly).
        until_done = "proxy" in self.overrides and self.overrides.get("max_seconds")
        end = start + int((until_done or self.seconds) * 1e9)
        drain = int(self.overrides.get("drain", 6.0) * 1e9)
        with open(os.path.join(self.out, "plan.json"), "w") as f:
            json.dump({"seed": self.seed, "mode": self.mode, "seconds": self.seconds, "known_open": sorted(self.known_open), "features": self.features, "history_limit": self.history_limit,
                       # The daemon remembers 100,000 deletions per repository; the suite has 38 keys.
                       "tombstones_kept": True, "selftest": bool(self.overrides),
                       "faults": schedule, "start_ns": start, "end_ns": end}, f, indent=1)
        clients = self.start_clients(start, end, end + drain)
        self.flog.add(event="traffic", phase="start", t=start)
        try:
            for (t, kind, p) in schedule:
                when = start + int(t * 1e9)
                while now_ns() < when:
                    time.sleep(min(0.05, max(0.0, (when - now_ns()) / 1e9)))
                if now_ns() > end - 3_000_000_000:
                    break
                self.inject(kind, p)
            if until_done:
                end = self.until_proxy_done(start + int(self.seconds * 1e9), end)
        finally:
            self.fp.disarm()
            for d in self.daemons:
                if d.stopped:
                    d.cont()
            if self.etcd:
                for i in range(3):
                    self.etcd.cont(i)
                    self.etcd.restart(i)
        self.flog.add(event="traffic", phase="end", t=end)
        if until_done:
            with open(os.path.join(self.out, "plan.json")) as f:
                plan = json.load(f)
            plan["end_ns"] = end
            plan["seconds"] = (end - start) / 1e9
            with open(os.path.join(self.out, "plan.json"), "w") as f:
                json.dump(plan, f, indent=1)
        for name, p in self.procs:
            try:
                p.wait(timeout=max(10.0, (end + drain - now_ns()) / 1e9 + 30.0))
            except subprocess.TimeoutExpired:
                p.kill()
                self.problems.append({"kind": "client", "client": name, "why": "did not end"})
        for name, p in self.procs:
            if p.returncode not in (0, None):
                with open(os.path.join(self.out, f"client-{name}.out"), errors="replace") as f:
                    self.problems.append({"kind": "client", "client": name, "why": f"exit {p.returncode}", "out": f.read()[-3000:]})
        self.final()
        return clients

    def until_proxy_done(self, earliest, latest):
        """Waits until the proxy has made every mutation (its log has a line for each), no
        earlier than `earliest`, no later than `latest`; ends the clients' traffic then."""
        want = sum(m.get("times", 1) for m in self.overrides["proxy"])
        path = os.path.join(self.out, "proxy.log")
        while now_ns() < latest:
            try:
                with open(path) as f:
                    done = sum(1 for _ in f)
            except OSError:
                done = 0
            if done >= want and now_ns() >= earliest:
                break
            time.sleep(0.1)
        end = min(max(now_ns() + 200_000_000, earliest), latest)
        with open(self.end_file + ".tmp", "w") as f:
            f.write(str(end))
        os.replace(self.end_file + ".tmp", self.end_file)
        while now_ns() < end:
            time.sleep(0.02)
        return end

    def final(self):
        """Reads every repository, restarts every daemon gracefully, reads them again (durable
        across the restart, the same epochs), and stops."""
        rec = Recorder(os.path.join(self.out, "h-final.log"))
        if self.etcd:
            self.etcd.wait_healthy(30.0)
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is not None:
                # Exited though nothing stopped it (the faults restart what they stop).
                rc = d.reap()
                self.problems.append({"kind": "exit", "daemon": d.index, "inc": d.incarnation, "rc": rc, "log": d.log_tail()})
            if not d.running:
                self.restart(d, d.extra)
            d.wait_serving(30.0)
        time.sleep(1.5)  # leases' ends in flight are made (TTL ≤ 4 s are not all over: fine)
        self.read_all(rec, "final.1")
        for d in self.daemons:
            d.term()
        for d in self.daemons:
            self.restart(d, [])
        self.read_all(rec, "final.2")
        for d in self.daemons:
            d.term()
        rec.close()

    def read_all(self, rec, name):
        for d in self.daemons:
            c = Conn(f"{name}.{d.index}", rec, d.index, lambda c, m, t: None, None)
            for _ in range(200):
                if c.connect(d.socket, d.index):
                    break
                time.sleep(0.05)
            if not c.alive:
                continue
            c.sock.setblocking(True)
            c.request({"op": "repos"})
            for repo in planmod.REPOS:
                c.request({"op": "list", "repo": repo, "values": True})
            c.flush_blocking(10.0)
            c.sock.settimeout(20.0)
            c.sock.setblocking(False)
            sel = selectors.DefaultSelector()
            sel.register(c.sock, selectors.EVENT_READ)
            deadline = time.monotonic() + 30.0
            while c.alive and c.pending and time.monotonic() < deadline:
                if sel.select(1.0):
                    c.on_readable()
            sel.close()
            c.close("final reads done")

    def teardown(self):
        if getattr(self, "proxy", None) is not None:
            self.proxy.kill()
            self.proxy.wait()
        for d in self.daemons:
            if d.running:
                d.kill9()
        if self.etcd:
            self.etcd.close()
        if self.disk:
            self.disk.close()
        self.flog.close()
