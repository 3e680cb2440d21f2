"""The processes the suite runs and breaks: obsd daemons (local data directory, or sharing an
etcd prefix), a 3-member etcd cluster on free loopback ports, the data directory's file system
(a small ext4 image mounted on a loop device when the suite runs as root, so that a full disk
is a real one), the failpoint file, and the fault log every injection and every daemon start
and end is written to (CLOCK_MONOTONIC nanoseconds, like the client histories)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

now_ns = time.monotonic_ns


class FaultLog:
    def __init__(self, path):
        self.file = open(path, "w", buffering=1)

    def add(self, **fields):
        fields.setdefault("t", now_ns())
        self.file.write(json.dumps(fields, sort_keys=True) + "\n")
        return fields["t"]

    def close(self):
        self.file.close()


class Failpoints:
    """The file OBSD_FAILPOINTS names (`@path`): tunables always, faults while armed."""

    def __init__(self, path, tunables):
        self.path = path
        self.tunables = tunables
        self.armed = ""
        self.write()

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(";".join(self.tunables + ([self.armed] if self.armed else [])) + "\n")
        os.replace(tmp, self.path)

    def arm(self, spec):
        self.armed = spec
        self.write()

    def disarm(self):
        self.armed = ""
        self.write()


class Daemon:
    """One obsd: started, killed, stopped, continued, restarted; each start an incarnation
    whose spawn and end are in the fault log."""

    def __init__(self, index, obsd, socket_path, log_dir, flog, base_args, env):
        self.index = index
        self.obsd = obsd
        self.socket = socket_path
        self.log_dir = log_dir
        self.flog = flog
        self.base_args = base_args
        self.env = env
        self.proc = None
        self.incarnation = 0
        self.extra = []
        self.stopped = False
        self.log_path = None

    def start(self, extra=None, env=None):
        self.incarnation += 1
        self.extra = list(extra or [])
        self.log_path = os.path.join(self.log_dir, f"obsd{self.index}.{self.incarnation}.log")
        log = open(self.log_path, "w")
        e = dict(self.env)
        if env:
            e.update(env)
        t = now_ns()
        self.proc = subprocess.Popen([self.obsd] + self.base_args + self.extra, stdout=log, stderr=log, env=e,
                                     stdin=subprocess.DEVNULL)
        log.close()
        self.stopped = False
        self.flog.add(t=t, event="spawn", daemon=self.index, inc=self.incarnation, pid=self.proc.pid, args=self.extra)

    def wait_serving(self, timeout=30.0):
        """Waits until the daemon answers `ping` (or exits); whether it serves."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(2.0)
                s.connect(self.socket)
                s.sendall(b'{"op":"ping"}\n')
                data = s.recv(4096)
                s.close()
                if b'"ok":true' in data:
                    self.flog.add(event="serving", daemon=self.index, inc=self.incarnation)
                    return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig):
        if self.running:
            os.kill(self.proc.pid, sig)

    def kill9(self):
        if self.proc is None:
            return
        if self.stopped:
            self.cont()
        t = now_ns()
        self.signal(signal.SIGKILL)
        self.flog.add(t=t, event="kill", daemon=self.index, inc=self.incarnation)
        self.reap()

    def reap(self, timeout=None):
        """Waits for the process to end; logs its end (after which no connection reaches it)."""
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.flog.add(event="exit", daemon=self.index, inc=self.incarnation, rc=rc)
        self.proc = None
        return rc

    def term(self, timeout=15.0):
        if self.proc is None:
            return None
        if self.stopped:
            self.cont()
        self.flog.add(event="term", daemon=self.index, inc=self.incarnation)
        self.signal(signal.SIGTERM)
        rc = self.reap(timeout)
        if rc is None:
            self.kill9()
        return rc

    def stop(self):
        t = now_ns()
        self.signal(signal.SIGSTOP)
        self.stopped = True
        self.flog.add(t=t, event="sigstop", daemon=self.index, inc=self.incarnation)

    def cont(self):
        self.signal(signal.SIGCONT)
        self.stopped = False
        self.flog.add(event="sigcont", daemon=self.index, inc=self.incarnation)

    def log_tail(self, n=30):
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def log_contains(self, text):
        if not self.log_path or not os.path.exists(self.log_path):
            return False
        with open(self.log_path, errors="replace") as f:
            return text in f.read()


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Etcd:
    """A 3-member etcd cluster on loopback (the way Tests/TestSupport/EtcdCluster.swift starts
    one): heartbeat 100 ms, election timeout 1000 ms."""

    def __init__(self, etcd, etcdctl, directory, flog, count=3):
        self.etcd = etcd
        self.etcdctl = etcdctl
        self.dir = directory
        self.flog = flog
        ports = free_ports(2 * count)
        self.members = [{"name": f"m{i}", "client": ports[2 * i], "peer": ports[2 * i + 1]} for i in range(count)]
        self.procs = [None] * count
        self.stopped = [False] * count
        self.token = f"obsd-robust-{os.getpid()}-{ports[0]}"

    @property
    def endpoints(self):
        return [f"http://127.0.0.1:{m['client']}" for m in self.members]

    def spawn(self, i, state="new"):
        m = self.members[i]
        cluster = ",".join(f"{x['name']}=http://127.0.0.1:{x['peer']}" for x in self.members)
        url = f"http://127.0.0.1:{m['client']}"
        peer = f"http://127.0.0.1:{m['peer']}"
        args = [self.etcd, "--name", m["name"], "--data-dir", os.path.join(self.dir, m["name"]),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-token", self.token,
                "--initial-cluster-state", state, "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--logger", "zap", "--log-outputs", "stderr"]
        log = open(os.path.join(self.dir, m["name"] + ".log"), "a")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=log, env={"PATH": "/usr/bin:/bin"},
                                         stdin=subprocess.DEVNULL)
        log.close()
        self.stopped[i] = False
        self.flog.add(event="etcd-spawn", member=i, pid=self.procs[i].pid)

    def start(self, timeout=60.0):
        os.makedirs(self.dir, exist_ok=True)
        for i in range(len(self.members)):
            self.spawn(i)
        return self.wait_healthy(timeout)

    def healthy(self, i):
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.members[i]['client']}/health", timeout=1.0) as r:
                return b'"health":"true"' in r.read()
        except Exception:
            return False

    def wait_healthy(self, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self.procs[i] is not None and self.procs[i].poll() is None and not self.stopped[i] and self.healthy(i)
                   for i in range(len(self.members))):
                return True
            time.sleep(0.1)
        return False

    def ctl(self, *args, timeout=10.0):
        eps = ",".join(f"127.0.0.1:{m['client']}" for i, m in enumerate(self.members)
                       if self.procs[i] is not None and not self.stopped[i])
        try:
            out = subprocess.run([self.etcdctl, "--endpoints", eps, "--command-timeout=5s"] + list(args),
                                 capture_output=True, text=True, timeout=timeout, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
            return out.returncode, out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            return -1, "timeout"

    def leader(self):
        rc, out = self.ctl("endpoint", "status", "-w", "json")
        if rc != 0:
            return None
        try:
            rows = json.loads(out[out.index("["):])
        except ValueError:
            return None
        for row in rows:
            st = row.get("Status", {})
            if st.get("header", {}).get("member_id") == st.get("leader"):
                ep = row.get("Endpoint", "")
                for i, m in enumerate(self.members):
                    if ep.endswith(f":{m['client']}"):
                        return i
        return None

    def revision(self):
        rc, out = self.ctl("endpoint", "status", "-w", "json")
        if rc != 0:
            return None
        try:
            rows = json.loads(out[out.index("["):])
            return max(r["Status"]["header"]["revision"] for r in rows)
        except (ValueError, KeyError):
            return None

    def kill(self, i):
        p = self.procs[i]
        if p is None:
            return
        if self.stopped[i]:
            os.kill(p.pid, signal.SIGCONT)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        self.procs[i] = None
        self.stopped[i] = False
        self.flog.add(event="etcd-kill", member=i)

    def stop(self, i):
        if self.procs[i] is not None:
            os.kill(self.procs[i].pid, signal.SIGSTOP)
            self.stopped[i] = True
            self.flog.add(event="etcd-sigstop", member=i)

    def cont(self, i):
        if self.procs[i] is not None and self.stopped[i]:
            os.kill(self.procs[i].pid, signal.SIGCONT)
            self.stopped[i] = False
            self.flog.add(event="etcd-sigcont", member=i)

    def restart(self, i):
        if self.procs[i] is None:
            self.spawn(i, state="existing")

    def close(self):
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    if self.stopped[i]:
                        os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
                except OSError:
                    pass
        self.procs = [None] * len(self.members)


class Disk:
    """The data directory's file system: an ext4 image on a loop device when running as root
    (a full disk is then the file system's own ENOSPC, reached by a ballast file), else a plain
    directory (a full disk is then the `wal.*=error(ENOSPC)` failpoints)."""

    def __init__(self, base, size_mb=256):
        self.base = base
        self.mount = os.path.join(base, "fs")
        self.image = os.path.join(base, "fs.img")
        self.size_mb = size_mb
        self.real = False
        os.makedirs(self.mount, exist_ok=True)
        if os.geteuid() == 0 and shutil.which("mkfs.ext4"):
            try:
                with open(self.image, "wb") as f:
                    f.truncate(size_mb << 20)
                subprocess.run(["mkfs.ext4", "-q", "-F", self.image], check=True, capture_output=True)
                subprocess.run(["mount", "-o", "loop", self.image, self.mount], check=True, capture_output=True)
                self.real = True
            except (subprocess.CalledProcessError, OSError):
                self.real = False
        self.ballast = os.path.join(self.mount, "ballast")

    def fill(self):
        """Fills the file system (leaving nothing free)."""
        with open(self.ballast, "wb") as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
            try:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
            except OSError:
                pass

    def free(self):
        try:
            os.unlink(self.ballast)
        except OSError:
            pass

    def close(self):
        if self.real:
            subprocess.run(["umount", "-l", self.mount], capture_output=True)
            try:
                os.unlink(self.image)
            except OSError:
                pass
