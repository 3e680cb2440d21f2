#!/usr/bin/env python3
"""Presence with a hold: this process is listed under presence/NAME for exactly as long as it runs.

    python3 Examples/python/presence.py web-1            # Ctrl-C to leave
    python3 Examples/python/presence.py web-2 --for 30   # leave after 30 s

The key is written on a lease bound to the connection (``client.hold``): if the process is
killed, however it dies, the daemon deletes the key and everyone watching sees it go. After
a daemon restart the hold writes it again. Meanwhile a mirror of ``presence/`` prints who is
present whenever that changes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import List

import obsd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", help="this member's name (the key is presence/NAME)")
    parser.add_argument("--repo", default="presence", help="the repository (default: presence)")
    parser.add_argument("--socket", help="obsd's socket (default: $OBSD_SOCKET, $XDG_RUNTIME_DIR/obsd.sock, /run/obsd/obsd.sock)")
    parser.add_argument("--for", dest="seconds", type=float, help="leave after this many seconds (default: until Ctrl-C or SIGTERM)")
    args = parser.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    printing = threading.Lock()

    def say(line: str) -> None:
        # Whole lines: the mirror's thread prints too (print writes the text and its newline
        # apart, so two threads' lines could run together).
        with printing:
            print(line, flush=True)

    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": int(time.time())}
    with obsd.connect(args.socket) as client:
        members = client.mirror(args.repo, prefix="presence/")

        def show(_: List[str]) -> None:
            names = sorted(key[len("presence/"):] for key in members)
            say(f"present ({members.rev}): {', '.join(names) or 'nobody'}")

        members.on_change(show)
        with client.hold(args.repo, f"presence/{args.name}", me) as lease:
            say(f"{args.name} is present (lease {lease.id})")
            stop.wait(args.seconds)
        say(f"{args.name} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
