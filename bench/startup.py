#!/usr/bin/env python3
"""Start-up time after kill -9 with 200,000 keys on one lease (issue 32, item 3).

Writes 50 batches of 4,000 ``set``s naming one lease — with a TTL (``ttl``) or bound to the
connection (``bound``: start-up must delete them all, ``end: "closed"``, before it serves) —
into a fresh data directory under ``sync = relaxed``, kills obsd with SIGKILL, starts it again
and prints the time until the socket answers, the CPU time obsd spent until then (what the
wall clock measures on a busy machine is mostly the other processes), and how many keys are
left.

    python3 bench/startup.py .build/release/obsd ttl
    python3 bench/startup.py .build/release/obsd bound
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def main() -> None:
    obsd, kind = sys.argv[1], sys.argv[2]
    if kind not in ("ttl", "bound"):
        sys.exit("usage: startup.py OBSD ttl|bound")
    work = tempfile.mkdtemp(prefix="obsd-startup-")
    sock = os.path.join(work, "s.sock")

    def start():
        p = subprocess.Popen([obsd, "--socket", sock, "--data-dir", os.path.join(work, "data"), "--sync", "relaxed",
                              "--max-keys-per-request", "20000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        began = time.monotonic()
        while True:
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(sock)
                return p, s, time.monotonic() - began, cpu_seconds(p.pid)
            except OSError:
                if p.poll() is not None:
                    sys.exit(f"obsd exited with {p.returncode}")
                time.sleep(0.002)

    def cpu_seconds(pid):
        """User and system time of process `pid` so far (/proc/PID/stat fields 14 and 15)."""
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def call(s, f, request):
        s.sendall((json.dumps(request) + "\n").encode())
        return json.loads(f.readline())

    try:
        p, s, _, _ = start()
        f = s.makefile()
        grant = {"id": 1, "op": "grant"} if kind == "bound" else {"id": 1, "op": "grant", "ttl": 600}
        lease = call(s, f, grant)["lease"]
        for chunk in range(50):
            ops = [{"op": "set", "key": f"k{chunk}-{i}", "value": i, "lease": lease} for i in range(4000)]
            reply = call(s, f, {"id": 2, "op": "batch", "repo": "big", "ops": ops})
            assert reply.get("ok"), reply
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p, s, took, cpu = start()
        f = s.makefile()
        keys = len(call(s, f, {"id": 3, "op": "list", "repo": "big"})["keys"])
        print(f"{kind}: start-up after kill -9 {took:.2f} s (obsd's CPU time {cpu:.2f} s), keys left {keys}")
        p.terminate()
        p.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
