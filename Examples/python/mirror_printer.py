#!/usr/bin/env python3
"""Prints a live mirror of a repository: its keys and values, again each time they change.

    python3 Examples/python/mirror_printer.py ui
    python3 Examples/python/mirror_printer.py svc --prefix presence/ --changes 3

The mirror is a read-only ``Mapping`` kept current by a background thread; it resumes by
itself after a lost connection or a daemon restart (a catch-up, or a reset when the history
is gone). ``sync()`` waits until it shows every write acknowledged before the call.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import List

import obsd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repo", help="the repository to mirror")
    parser.add_argument("--prefix", help="only the keys starting with this")
    parser.add_argument("--socket", help="obsd's socket (default: $OBSD_SOCKET, $XDG_RUNTIME_DIR/obsd.sock, /run/obsd/obsd.sock)")
    parser.add_argument("--changes", type=int, help="exit after printing this many changes")
    args = parser.parse_args()

    with obsd.connect(args.socket) as client:
        mirror = client.mirror(args.repo, prefix=args.prefix)
        printed = threading.Semaphore(0)

        def print_state(what: str) -> None:
            state = mirror.snapshot()
            print(f"-- {args.repo} at revision {mirror.rev}{what}")
            for key, value in state.items():
                print(f"{key} = {json.dumps(value)}")
            sys.stdout.flush()

        def show(keys: List[str]) -> None:
            print_state(f", changed: {', '.join(keys)}")
            printed.release()

        print_state("")
        mirror.on_change(show)
        count = 0
        try:
            while args.changes is None or count < args.changes:
                printed.acquire()
                count += 1
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
