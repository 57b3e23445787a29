"""`cascade stress`: arguments, the --quick profile, running the modes, the summary."""

from __future__ import annotations

import argparse
import os
import sys

MODES = ("ops", "kill", "corrupt", "faults")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cascade.stress.stores import SETUPS_KILL, SETUPS_OPS

    p.add_argument(
        "modes", nargs="*", metavar="MODE", help=f"modes to run: {', '.join(MODES)} (default: all)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="every mode, short (about a minute on 2 cores): what CI runs",
    )
    p.add_argument(
        "--seed", type=int, default=1, help="seed of every random choice (runs are repeatable)"
    )
    p.add_argument("--json", metavar="FILE", help="also write every count and failure as JSON")
    p.add_argument(
        "--dir",
        default=None,
        help="directory for the stores' files (default: /dev/shm when writable, else the system "
        "temp dir; name a disk's directory to exercise a real file system)",
    )
    p.add_argument(
        "--op-deadline",
        type=float,
        default=30.0,
        help="seconds one operation may take before it is a hang",
    )
    p.add_argument(
        "--iteration-deadline",
        type=float,
        default=30.0,
        help="seconds one reopen+verify (kill, corrupt) or one fault point may take",
    )
    p.add_argument("--max-block", type=int, default=24 << 10, help="largest block, bytes")
    g = p.add_argument_group("ops")
    g.add_argument(
        "--setups",
        default=",".join(SETUPS_OPS),
        help="store setups: pipeline host, host|file or file, +dedup, +wt (write-through)",
    )
    g.add_argument("--threads", type=int, default=8)
    g.add_argument(
        "--processes", type=int, default=2, help="processes per setup, each with its own store"
    )
    g.add_argument("--duration", type=float, default=20.0, help="seconds per setup")
    g.add_argument("--keys", type=int, default=256, help="key space (small: operations collide)")
    g.add_argument(
        "--reopen-every", type=float, default=2.0, help="mean seconds between close+reopen"
    )
    g.add_argument(
        "--shm-bytes", type=int, default=1 << 20, help="host arena bytes (small: eviction)"
    )
    g.add_argument(
        "--file-bytes",
        type=int,
        default=4 << 20,
        help="file tier bytes (small: eviction from the file tier, compaction)",
    )
    g.add_argument(
        "--segment-bytes",
        type=int,
        default=1 << 20,
        help="file tier segment bytes (1 MiB at least)",
    )
    g = p.add_argument_group("kill")
    g.add_argument("--kill-setups", default=",".join(SETUPS_KILL))
    g.add_argument("--iterations", type=int, default=1000, help="kills")
    g.add_argument("--kill-threads", type=int, default=3)
    g.add_argument("--kill-keys", type=int, default=192)
    g.add_argument(
        "--kill-min", type=float, default=0.03, help="earliest kill, seconds after the fork"
    )
    g.add_argument("--kill-max", type=float, default=0.4, help="latest kill")
    g.add_argument("--reuse-dir", type=int, default=8, help="iterations sharing one directory")
    g = p.add_argument_group("corrupt")
    g.add_argument("--trials", type=int, default=2000)
    g.add_argument(
        "--corrupt-seconds",
        type=float,
        default=0,
        help="run trials for this long instead of --trials",
    )
    g.add_argument("--corruptions", type=int, default=50, help="mean corruptions per trial")
    g.add_argument("--corrupt-keys", type=int, default=160)
    g = p.add_argument_group("faults")
    g.add_argument(
        "--max-points", type=int, default=0, help="fault points to run (a sample); 0 = every one"
    )
    g.add_argument("--fault-kinds", default="eio,torn,enospc")
    g.add_argument("--fault-puts", type=int, default=40, help="puts in the fault workload")


QUICK = dict(
    duration=2.5,
    processes=1,
    threads=4,
    setups="host|file,host|file+dedup,host|file+wt,file",
    iterations=30,
    trials=60,
    corruptions=12,
    max_points=500,
    reopen_every=0.8,
)


def run(args) -> int:
    from cascade.stress import corrupt, faults, kill, ops
    from cascade.stress.report import ModeResult, format_summary, write_json
    from cascade.stress.stores import Scratch, parse_setup

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    modes = list(dict.fromkeys(args.modes)) or list(MODES)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    args.ops_setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    args.kill_setups = [s.strip() for s in args.kill_setups.split(",") if s.strip()]
    for s in args.ops_setups + args.kill_setups:
        parse_setup(s)
    if any("file" not in parse_setup(s)[0] for s in args.kill_setups):
        raise ValueError("kill setups need a file tier (host|file or file)")
    args.fault_kinds = [k.strip() for k in args.fault_kinds.split(",") if k.strip()]
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    scratch = Scratch(args.dir)
    results = []
    runners = {"ops": ops.run, "kill": kill.run, "corrupt": corrupt.run, "faults": faults.run}
    try:
        for m in modes:
            print(f"cascade stress: {m} ...", file=sys.stderr, flush=True)
            r = runners[m](args, scratch, ModeResult(m))
            results.append(r)
            print(
                f"cascade stress: {m}: {'ok' if r.ok else 'FAIL'} in {r.seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        scratch.cleanup()
    print(format_summary(results))
    if args.json:
        write_json(args.json, results, getattr(args, "argv", []))
    return 0 if all(r.ok for r in results) else 1
