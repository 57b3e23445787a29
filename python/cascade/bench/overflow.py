"""The overflow table of `cascade bench --overflow`: a working set larger
than the host tier, read back cold from the file tier."""

from __future__ import annotations

import os
import shutil

import numpy as np

import cascade
from cascade.bench.common import timed
from cascade.bench.tiers import (
    _make_data,
    _unique_shm_path,
    direct_io_ceiling,
    memcpy_ceiling,
)


def run_overflow(args, threads: int, directory: str, progress) -> dict:
    """The overflow table: a working set larger than the host tier by
    0/50/75/90%, everything read back cold (file reads with O_DIRECT).
    Promotion is off: a scan larger than the host tier would otherwise evict
    the blocks it is about to read."""
    size = args.overflow_block
    n = max(8, args.total // size)
    nbytes = n * size
    data = _make_data(nbytes, seed=7).reshape(n, size)
    out = np.ones_like(data)
    ids = [cascade.block_id(f"bench/overflow/{size}/{i}") for i in range(n)]
    host = memcpy_ceiling(nbytes, threads)
    disk = direct_io_ceiling(os.path.join(directory, "probe"), nbytes, threads)
    rows = []
    for frac in (0.0, 0.5, 0.75, 0.9):
        cfg = cascade.CascadeConfig()
        cfg.pipeline = "host|file"
        cfg.num_io_threads = threads
        cfg.shm_path = _unique_shm_path("overflow")
        in_host = n - int(round(n * frac))
        cfg.shm_capacity_bytes = max(in_host * size, 4096)
        cfg.file_path = os.path.join(directory, f"overflow-{int(frac * 100)}")
        cfg.io_direct = True
        cfg.promote_on_hit = False
        cfg.use_gpu = False
        with cascade.CascadeStore(cfg) as store:
            if store.put_batch(ids, data) != n:
                raise RuntimeError("overflow: not every block was stored")
            store.flush()
            st = store.get_stats()["tiers"]
            in_file = st["file"]["blocks"]
            out.fill(0)
            best = 0.0
            for _ in range(args.repeats):
                t, (found, _s) = timed(store.get_batch, ids, out)
                if found != n:
                    raise RuntimeError(f"overflow {frac:.0%}: found {found} of {n}")
                best = max(best, nbytes / t / 1e9)
            if not np.array_equal(out, data):
                raise RuntimeError(f"overflow {frac:.0%}: wrong bytes read back")
        shutil.rmtree(cfg.file_path, ignore_errors=True)
        f_file = in_file / n
        ideal = 1.0 / ((1 - f_file) / host["gbps"] + f_file / disk["read_gbps"])
        rows.append(
            {
                "overflow": frac,
                "host_capacity": cfg.shm_capacity_bytes,
                "blocks_in_file": in_file,
                "read_gbps": best,
                "ideal_gbps": ideal,
                "ratio": best / ideal,
            }
        )
        progress(
            f"overflow {frac:.0%}: {in_file} of {n} blocks in the file tier, read {best:.2f} GB/s "
            f"(ideal {ideal:.2f})"
        )
    return {
        "block_bytes": size,
        "total_bytes": nbytes,
        "threads": threads,
        "host_ceiling_gbps": host["gbps"],
        "file_ceiling_gbps": disk["read_gbps"],
        "rows": rows,
    }
