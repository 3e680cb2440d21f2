#!/usr/bin/env python3
"""obsd's robustness suite: `make robustness` (and its short run inside `make test`).

    python3 robustness/run.py [--seconds N] [--seed S] [--modes local,etcd] [--short]
                              [--known-open include|exclude] [--out DIR] [--obsd PATH]
    python3 robustness/run.py --validate DIR     # the validators alone, on a kept run

Seeded random traffic from several client processes against the real obsd, faults injected
while it runs, every recorded history checked against the contract afterwards. Ends with one
line: `robustness: N operations, F faults, V violations (seed S)`. Exit status 0 when V is 0.
See robustness/README.md.
"""

import argparse
import json
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from obsrobust import orchestrate, validate  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("ROBUSTNESS_SECONDS") or 600))
    ap.add_argument("--seed", type=int, default=int(os.environ["SEED"]) if os.environ.get("SEED") else None)
    ap.add_argument("--modes", default=os.environ.get("ROBUSTNESS_MODES", "local,etcd"))
    ap.add_argument("--short", action="store_true", help="the short run of `make test`")
    ap.add_argument("--known-open", default=os.environ.get("KNOWN_OPEN") or None,
                    help="which defects known open to trigger (README, \"Known open\"; obsrobust/plan.py "
                         "KNOWN_OPEN names them): all, none, or names; default all, none with --short")
    ap.add_argument("--out", default=None)
    ap.add_argument("--obsd", default=os.path.join(orchestrate.ROOT, ".build/release/obsd"))
    ap.add_argument("--keep", action="store_true", help="keep the run's directory even when it passed")
    ap.add_argument("--validate", metavar="DIR", help="only validate a kept run")
    args = ap.parse_args()

    if args.validate:
        result = validate.validate_run(args.validate, print)
        with open(os.path.join(args.validate, "plan.json")) as f:
            seed = json.load(f)["seed"]
        total = validate.totals_of(result, seed)
        print(total.summary_line())
        return 0 if total.violations == 0 else 1

    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(40)
    from obsrobust import plan as planmod
    known_open = planmod.known_set(args.known_open or ("none" if args.short else "all"))
    modes = [m for m in args.modes.split(",") if m]
    out = args.out or f"/tmp/obsd-robustness-{seed}"
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    print(f"robustness: seed {seed}, {args.seconds:g} s, modes {','.join(modes)}, known-open defects triggered: "
          f"{','.join(sorted(known_open)) or 'none'}, run directory {out}", flush=True)
    if not os.path.exists(args.obsd):
        print(f"robustness: no obsd at {args.obsd} (swift build -c release --product obsd)")
        return 2
    share = {"local": 2.0, "etcd": 1.0}
    weights = sum(share.get(m, 1.0) for m in modes)
    total = validate.Totals(seed)
    for mode in modes:
        seconds = args.seconds * share.get(mode, 1.0) / weights
        mdir = os.path.join(out, mode)
        m = orchestrate.Mode(mode, seed, seconds, mdir, known_open, args.obsd, log=lambda s: print(s, flush=True))
        t0 = time.monotonic()
        try:
            m.run()
        finally:
            m.teardown()
        print(f"robustness: {mode}: {seconds:.0f} s of traffic, {m.fault_count} faults, "
              f"{time.monotonic() - t0:.0f} s with set-up and the final reads; validating", flush=True)
        with open(os.path.join(mdir, "problems.json"), "w") as f:
            json.dump(m.problems, f)
        result = validate.validate_run(mdir, lambda s: print(s, flush=True))
        total.add(result)
    if total.violations == 0 and not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    elif total.violations:
        print(f"robustness: the run is kept in {out}; replay it with `make robustness SEED={seed}` "
              f"(or python3 robustness/run.py --seed {seed} ...)", flush=True)
    # The last line, always this one.
    print(total.summary_line(), flush=True)
    return 0 if total.violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
