"""`cascade bench restart`: warm restart of the host tier (shm_persist).

For each arena size: fill a persistent host arena with blocks, flush (seal),
close, then open a store on the same file and time it: the reattach
(scan of the block table, checksum verification of every adopted byte on
all I/O threads, index rebuild) and the whole open. The host read and copy
ceilings are measured in the same run: verification reads the arena once,
so its rate is compared with a read-only pass over shared memory.

    cascade bench restart --arena 4GiB --arena 8GiB --block 1MiB
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from cascade.bench.common import Progress, fmt_size, format_table, parse_size_arg


def add_restart_arguments(p) -> None:
    p.add_argument(
        "--arena",
        action="append",
        help="arena size; repeatable (default: 1GiB). A plain number is KiB",
    )
    p.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    p.add_argument("--threads", type=int, default=0, help="I/O threads (default: one per core)")
    p.add_argument(
        "--shm-dir", default="/dev/shm", help="directory of the arena files (default /dev/shm)"
    )
    p.add_argument("--repeats", type=int, default=2, help="reopens per size; the best is reported")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _config(path: str, capacity: int, threads: int):
    import cascade

    cfg = cascade.CascadeConfig()
    cfg.pipeline = "host"
    cfg.shm_path = path
    cfg.shm_capacity_bytes = capacity
    cfg.shm_persist = True
    cfg.num_io_threads = threads
    return cfg


def _fill(path: str, capacity: int, block: int, threads: int, progress) -> int:
    import cascade

    n = capacity // block
    rng = np.random.default_rng(1)
    buf = np.frombuffer(rng.bytes(block), dtype=np.uint8).copy()
    t0 = time.perf_counter()
    with cascade.CascadeStore(_config(path, capacity, threads)) as s:
        for i in range(n):
            buf[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            s.put(f"restart-bench-{i}", buf)
        s.flush()
        stored = s.get_stats()["tiers"]["host"]["blocks"]
    progress(f"filled {fmt_size(capacity)}: {stored} blocks in {time.perf_counter() - t0:.1f} s")
    return stored


def _reopen(path: str, capacity: int, threads: int) -> dict:
    import cascade

    t0 = time.perf_counter()
    s = cascade.CascadeStore(_config(path, capacity, threads))
    open_s = time.perf_counter() - t0
    host = s.get_stats()["tiers"]["host"]
    first = s.get("restart-bench-0")
    s.close()
    return {
        "open_seconds": open_s,
        "reattach_seconds": host["reattach_seconds"],
        "reattached_blocks": host["reattached_blocks"],
        "reattach_dropped": host["reattach_dropped"],
        "reattach_bytes": host["reattach_bytes"],
        "first_block_served": first is not None,
    }


def run_restart(args, progress: Progress) -> dict:
    from cascade import _core

    threads = args.threads or os.cpu_count() or 1
    block = parse_size_arg(args.block)
    arenas = [parse_size_arg(a) for a in (args.arena or ["1GiB"])]
    ceiling = _core.memcpy_bandwidth(1 << 30, threads, 3)
    progress(
        f"ceilings ({threads} threads): read {ceiling['read_gbps']:.1f} GB/s, "
        f"copy {ceiling['gbps']:.1f} GB/s"
    )
    rows = []
    for capacity in arenas:
        path = os.path.join(args.shm_dir, f"cascade-bench-restart-{os.getpid()}")
        try:
            stored = _fill(path, capacity, block, threads, progress)
            best = None
            for _ in range(max(args.repeats, 1)):
                r = _reopen(path, capacity, threads)
                if r["reattached_blocks"] != stored or not r["first_block_served"]:
                    raise RuntimeError(
                        f"reattach adopted {r['reattached_blocks']} of {stored} blocks "
                        f"({r['reattach_dropped']} dropped)"
                    )
                if best is None or r["reattach_seconds"] < best["reattach_seconds"]:
                    best = r
            assert best is not None
            best["arena_bytes"] = capacity
            best["block_bytes"] = block
            best["verify_gbps"] = best["reattach_bytes"] / best["reattach_seconds"] / 1e9
            rows.append(best)
            progress(
                f"{fmt_size(capacity)}: reattach {best['reattach_seconds']:.3f} s, "
                f"open {best['open_seconds']:.3f} s"
            )
        finally:
            if os.path.exists(path):
                os.unlink(path)
    return {"threads": threads, "ceiling": dict(ceiling), "rows": rows}


def format_restart(report: dict) -> str:
    c = report["ceiling"]
    rows = [
        [
            fmt_size(r["arena_bytes"]),
            fmt_size(r["block_bytes"]),
            r["reattached_blocks"],
            r["reattach_seconds"],
            r["open_seconds"],
            r["verify_gbps"],
            c["read_gbps"],
            c["gbps"],
        ]
        for r in report["rows"]
    ]
    return format_table(
        [
            "arena",
            "block",
            "blocks",
            "reattach s",
            "open s",
            "verified GB/s",
            "read ceiling GB/s",
            "copy ceiling GB/s",
        ],
        rows,
        title=f"warm restart of the host tier ({report['threads']} threads)",
    )


def main(args, progress: Progress) -> int:
    report = run_restart(args, progress)
    print(format_restart(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
