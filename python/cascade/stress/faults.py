"""Mode `faults`: fault injection at every I/O point of the file tier.

The campaign itself is C++ (src/stress/fault_campaign.h, exposed as
_core.stress_fault_points / stress_fault_run): a fixed single-threaded
workload on a FileTier whose Env numbers its calls; a clean run counts them,
then the workload is rerun with call k failing (eio: any call fails; torn: a
write keeps a random prefix and fails; enospc: from a write on, the disk is
full), and the directory is reopened with a clean Env and read back. It
checks no wrong byte, a reopen that succeeds, and every block whose put and
a later flush both returned OK present after reopen.

Here the points are split into batches run in child processes; a child
rewrites a progress file before each point, so a crash or a hang is
reported with the point that caused it and the campaign goes on after it.
Two workloads run: an unbounded tier, and one bounded by
file_capacity_bytes (puts meet NoSpace, compaction runs inline).
"""

from __future__ import annotations

import functools
import os
import random

from cascade import _core
from cascade.stress import proc
from cascade.stress.report import ModeResult

KINDS = ["eio", "torn", "enospc"]
WORKLOADS = [  # (name, capacity_bytes)
    ("unbounded", 0),
    ("bounded", 384 << 10),
]
BATCH = 150


def run(args, scratch, result: ModeResult) -> ModeResult:
    rng = random.Random(args.seed)
    progress = scratch.path("faults-progress")
    for wi, (name, capacity) in enumerate(WORKLOADS):
        d = scratch.path(f"faults-{name}")
        params = dict(
            dir=d,
            seed=args.seed + wi,
            puts=args.fault_puts,
            key_space=max(4, args.fault_puts * 3 // 5),
            max_block_bytes=20 << 10,
            segment_bytes=64 << 10,
            capacity_bytes=capacity,
        )
        t = proc.run_child(
            functools.partial(_core.stress_fault_points, **params, kinds=args.fault_kinds),
            args.iteration_deadline * 4,
        )
        if t.status != "ok":
            key = {"crash": "crashes", "hang": "hangs"}.get(t.status, "exceptions")
            result.add(key)
            result.fail(f"{name}: the clean run failed: {t.status} {t.detail.strip()[-300:]}")
            continue
        calls, points = t.value
        result.add("env_calls", calls)
        result.add("fault_points_total", len(points))
        if args.max_points and len(points) > args.max_points // len(WORKLOADS):
            points = sorted(
                rng.sample(points, args.max_points // len(WORKLOADS)),
                key=lambda p: (KINDS.index(p[0]), p[1]),
            )
        todo = [(p[0], p[1]) for p in points]
        i = 0
        while i < len(todo):
            batch = todo[i : i + BATCH]
            if os.path.exists(progress):
                os.unlink(progress)
            r = proc.run_child(
                functools.partial(
                    _core.stress_fault_run, **params, points=batch, progress_path=progress
                ),
                args.iteration_deadline * len(batch) + 60,
                progress_path=progress,
                progress_deadline_s=args.iteration_deadline,
            )
            if r.status == "ok":
                v = r.value
                for k in (
                    "points",
                    "fired",
                    "injected",
                    "failed_ops",
                    "open_failures",
                    "reopen_failures",
                    "acked",
                    "hits",
                    "misses",
                    "wrong",
                    "lost",
                ):
                    result.add(k, v[k])
                result.add("ops", v["reads"])
                result.add("runs", v["points"])
                for f in v["failures"]:
                    result.fail(f"{name}: {f}")
                for kind, _ in batch:
                    result.by_kind[kind] = result.by_kind.get(kind, 0) + 1
                i += len(batch)
                continue
            # A crash or hang: blame the point in the progress file; the points
            # before it (whose counts died with the child) run again, then the rest.
            where = proc._read(progress).strip() or r.detail
            done = _points_before(batch, where)
            result.add("runs")
            result.add("points")
            result.add({"crash": "crashes", "hang": "hangs"}.get(r.status, "exceptions"))
            result.fail(f"{name}: {r.status} at {where}: {r.detail.strip()[-200:]}")
            todo[i : i + len(batch)] = batch[:done] + batch[done + 1 :]
    return result.finish()


def _points_before(batch, where: str) -> int:
    """Index in batch of the point named in a progress line ("kind@index (call)")."""
    try:
        kind, rest = where.split("@", 1)
        index = int(rest.split()[0])
        return batch.index((kind, index))
    except (ValueError, IndexError):
        return 0
