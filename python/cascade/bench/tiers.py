"""Per-tier throughput: `cascade bench` (host tier; file and gpu tiers where
present). Each size gets its own store; bytes are random; the ceiling is
measured in the same run."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import cascade
from cascade import _core
from cascade.bench.common import fmt_size, timed


def _blocks_for(size: int, total: int, blocks: int | None) -> int:
    if blocks:
        return blocks
    return max(4, total // size)


def _make_data(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def _unique_shm_path(tag: str) -> str:
    return f"/dev/shm/cascade-bench-{tag}-{os.getpid()}"


def bench_store_tier(
    tier: str,
    size: int,
    *,
    total: int,
    blocks: int | None,
    threads: int,
    repeats: int,
    progress,
    file_dir: str | None = None,
    ceiling: dict | None = None,
    shm_populate: str | None = None,
) -> dict:
    """Write (first fill of a fresh store, then steady state) and hot-read
    throughput of one tier for one block size. The first fill starts right
    after open, so for the host tier it shows what `shm_populate` (None: the
    config's default) gives a freshly started store."""
    n = _blocks_for(size, total, blocks)
    nbytes = n * size
    progress(f"{tier} {fmt_size(size)}: {n} blocks, {nbytes / 2**30:.2f} GiB, {threads} threads")
    # One 2-D array per batch (a row per block): the binding then takes one
    # buffer for the whole batch. A list of n buffers costs an argument
    # conversion per block on top (docs/benchmarks.md has the figure).
    data = _make_data(nbytes, seed=size).reshape(n, size)
    views = data
    out = np.ones(nbytes, dtype=np.uint8).reshape(
        n, size
    )  # touched: no first-touch faults in the timing
    outs = out
    ids = [cascade.block_id(f"bench/{tier}/{size}/{i}") for i in range(n)]

    cfg = cascade.CascadeConfig()
    cfg.num_io_threads = threads
    cfg.use_gpu = False
    if tier == "host":
        cfg.pipeline = "host"
        cfg.shm_capacity_bytes = nbytes + max(64 << 20, nbytes // 16)
        cfg.shm_path = _unique_shm_path(f"{size}")
        if shm_populate is not None:
            cfg.shm_populate = getattr(cascade.ShmPopulate, shm_populate.upper())
    elif tier == "file":
        # O_DIRECT: every read is a cold read (no page cache), as on a
        # cluster file system where the data is not in this node's memory.
        if file_dir is None:
            raise ValueError("the file tier's benchmark needs file_dir")
        cfg.pipeline = "file"
        cfg.file_path = os.path.join(file_dir, f"tier-{size}")
        cfg.io_direct = True
    elif tier == "gpu":
        # Host numpy in and out (pageable memory: the tier stages it).
        cfg.pipeline = "gpu"
        cfg.use_gpu = True
        cfg.gpu_capacity_bytes = nbytes + max(64 << 20, nbytes // 16)
    else:
        raise ValueError(f"no store benchmark for tier {tier!r}")
    result = {
        "tier": tier,
        "shm_populate": cfg.shm_populate.name.lower() if tier == "host" else None,
        "block_bytes": size,
        "blocks": n,
        "total_bytes": nbytes,
        "threads": threads,
    }
    if tier == "file":
        return _bench_file_tier(
            cfg, result, ids, views, outs, data, out, nbytes, repeats, progress, ceiling
        )
    if tier == "host" and cfg.shm_populate != cascade.ShmPopulate.LAZY:
        # A store opened ahead of its traffic: the first fill once warming is done.
        with cascade.CascadeStore(cfg) as store:
            while store.get_stats()["tiers"]["host"]["warming"]:
                time.sleep(0.005)
            t, stored = timed(store.put_batch, ids, views)
            if stored != n:
                raise RuntimeError(f"{tier}: stored {stored} of {n} blocks")
            result["write_warmed_gbps"] = nbytes / t / 1e9
            progress(
                f"{tier} {fmt_size(size)}: first fill after warming "
                f"{result['write_warmed_gbps']:.2f} GB/s"
            )
    with cascade.CascadeStore(cfg) as store:
        t, stored = timed(store.put_batch, ids, views)
        if stored != n:
            raise RuntimeError(f"{tier}: stored {stored} of {n} blocks")
        result["write_cold_gbps"] = nbytes / t / 1e9
        progress(f"{tier} {fmt_size(size)}: first fill {result['write_cold_gbps']:.2f} GB/s")
        writes, reads = [], []
        for r in range(repeats):
            store.clear()
            t, stored = timed(store.put_batch, ids, views)
            writes.append(nbytes / t / 1e9)
            progress(
                f"{tier} {fmt_size(size)}: write {writes[-1]:.2f} GB/s (pass {r + 1}/{repeats})"
            )
        for r in range(repeats):
            t, (found, _sizes) = timed(store.get_batch, ids, outs)
            if found != n:
                raise RuntimeError(f"{tier}: found {found} of {n} blocks")
            reads.append(nbytes / t / 1e9)
            progress(
                f"{tier} {fmt_size(size)}: hot read {reads[-1]:.2f} GB/s (pass {r + 1}/{repeats})"
            )
        if not np.array_equal(out, data):
            raise RuntimeError(
                f"{tier} {fmt_size(size)}: bytes read back differ from bytes written"
            )
        result["verified"] = True
    result["write_gbps"] = max(writes)
    result["write_gbps_median"] = statistics.median(writes)
    result["read_gbps"] = max(reads)
    result["read_gbps_median"] = statistics.median(reads)
    if ceiling:
        result["ceiling_gbps"] = ceiling["gbps"]
        result["read_ceiling_gbps"] = ceiling["read_ceiling_gbps"]
        result["write_ratio"] = result["write_gbps"] / ceiling["gbps"]
        result["read_ratio"] = result["read_gbps"] / ceiling["read_ceiling_gbps"]
    return result


def _bench_file_tier(cfg, result, ids, views, outs, data, out, nbytes, repeats, progress, ceiling):
    size = result["block_bytes"]
    writes, reads = [], []
    for r in range(repeats):
        shutil.rmtree(cfg.file_path, ignore_errors=True)
        with cascade.CascadeStore(cfg) as store:
            t0 = time.perf_counter()
            stored = store.put_batch(ids, views)
            store.flush()  # durable, as the probe's writes are (fsync)
            t = time.perf_counter() - t0
            if stored != len(ids):
                raise RuntimeError(f"file: stored {stored} of {len(ids)} blocks")
            writes.append(nbytes / t / 1e9)
            progress(f"file {fmt_size(size)}: write {writes[-1]:.2f} GB/s (pass {r + 1}/{repeats})")
            out.fill(0)
            t, (found, _sizes) = timed(store.get_batch, ids, outs)
            if found != len(ids):
                raise RuntimeError(f"file: found {found} of {len(ids)} blocks")
            reads.append(nbytes / t / 1e9)
            progress(
                f"file {fmt_size(size)}: cold read {reads[-1]:.2f} GB/s (pass {r + 1}/{repeats})"
            )
            if not np.array_equal(out, data):
                raise RuntimeError(
                    f"file {fmt_size(size)}: bytes read back differ from bytes written"
                )
    shutil.rmtree(cfg.file_path, ignore_errors=True)
    result.update(
        verified=True,
        write_cold_gbps=None,
        write_gbps=max(writes),
        write_gbps_median=statistics.median(writes),
        read_gbps=max(reads),
        read_gbps_median=statistics.median(reads),
        read_kind="cold (O_DIRECT)",
    )
    if ceiling:
        result["ceiling_gbps"] = ceiling["write_gbps"]
        result["read_ceiling_gbps"] = ceiling["read_gbps"]
        result["write_ratio"] = result["write_gbps"] / ceiling["write_gbps"]
        result["read_ratio"] = result["read_gbps"] / ceiling["read_gbps"]
    return result


def direct_io_ceiling(directory: str, nbytes: int, threads: int) -> dict:
    """Raw sequential O_DIRECT bandwidth of `directory`: 16 MiB requests, one
    file per stream. Writes on as many streams as the file tier has writer
    lanes (at most 8); reads on as many as it reads with (every I/O thread),
    so neither side of a ratio has more requests in flight than the other."""
    os.makedirs(directory, exist_ok=True)
    nbytes = max(256 << 20, min(nbytes, 2 << 30))
    writers, readers = max(1, min(threads, 8)), max(1, threads)
    best: dict | None = None
    for _ in range(2):
        p = _core.probe_direct_io(directory, nbytes, 16 << 20, writers)
        if readers != writers:
            p["read_gbps"] = _core.probe_direct_io(directory, nbytes, 16 << 20, readers)[
                "read_gbps"
            ]
        if best is None:
            best = p
        else:
            best["write_gbps"] = max(best["write_gbps"], p["write_gbps"])
            best["read_gbps"] = max(best["read_gbps"], p["read_gbps"])
    assert best is not None
    return {"kind": "o_direct", "write_streams": writers, "read_streams": readers, **best}


def memcpy_ceiling(nbytes: int, threads: int, repeats: int = 5) -> dict:
    """The host copy ceiling: a hot read is a copy too, so it is the ceiling
    of both directions (not `read_gbps`, a pass that only reads memory)."""
    nbytes = max(256 << 20, min(nbytes, 2 << 30))
    c = _core.memcpy_bandwidth(nbytes, threads, repeats)
    return {
        "kind": "memcpy",
        "bytes": nbytes,
        "threads": threads,
        **c,
        "read_ceiling_gbps": c["gbps"],
    }


def python_call_overhead(calls: int = 20000, size: int = 4096) -> dict:
    """Wall time of store.get for a hot 4 KiB block from Python: the best
    of five means over `calls` calls each."""
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "host"
    cfg.shm_capacity_bytes = 64 << 20
    cfg.shm_path = _unique_shm_path("overhead")
    cfg.num_io_threads = 1
    data = _make_data(size, 1)
    out = np.empty(size, dtype=np.uint8)
    bid = cascade.compute_block_id(data)
    with cascade.CascadeStore(cfg) as store:
        store.put(bid, data)
        get = store.get
        for _ in range(1000):
            get(bid, out)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                get(bid, out)
            best = min(best, (time.perf_counter() - t0) / calls)
        if not np.array_equal(out, data):
            raise RuntimeError("4 KiB get returned wrong bytes")
    return {"block_bytes": size, "calls": calls, "us_per_get": best * 1e6}


def index_rates(threads_list, blocks: int = 1 << 20, lookups: int = 2_000_000) -> list[dict]:
    return [_core.index_lookup_rate(blocks, t, lookups) for t in threads_list]


def run_tier_bench(args, progress) -> dict:
    """The whole `cascade bench` run: ceilings, then each tier and size."""
    from cascade.machine import machine_info

    threads = args.threads or os.cpu_count() or 1
    report: dict = {
        "command": "cascade " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(),
        "threads": threads,
        "results": [],
    }
    file_dir: str | None = None
    if "file" in args.tiers:
        file_dir = tempfile.mkdtemp(prefix="cascade-bench-", dir=args.file_dir)
        report["file_dir"] = {"path": file_dir, "fs": _fs_of(file_dir)}
    try:
        for tier in args.tiers:
            for size in args.sizes:
                # The ceiling is measured beside each measurement: on a shared
                # machine it moves by a third from one minute to the next.
                nbytes = size * _blocks_for(size, args.total, args.blocks)
                if tier == "file":
                    assert file_dir is not None  # made above when the file tier is measured
                    ceiling = direct_io_ceiling(os.path.join(file_dir, "probe"), nbytes, threads)
                    progress(
                        f"O_DIRECT ceiling for {fmt_size(size)}: write {ceiling['write_gbps']:.2f} "
                        f"read {ceiling['read_gbps']:.2f} GB/s"
                    )
                elif tier == "gpu":
                    from cascade.bench.gpu import gpu_ceiling

                    ceiling = gpu_ceiling(nbytes)
                    ceiling.update(gbps=ceiling["h2d_gbps"], read_ceiling_gbps=ceiling["d2h_gbps"])
                    progress(
                        f"PCIe ceiling for {fmt_size(size)}: h2d {ceiling['h2d_gbps']:.2f} "
                        f"d2h {ceiling['d2h_gbps']:.2f} GB/s"
                    )
                else:
                    ceiling = memcpy_ceiling(nbytes, threads)
                    progress(f"host copy ceiling for {fmt_size(size)}: {ceiling['gbps']:.2f} GB/s")
                modes = getattr(args, "shm_populate", None) if tier == "host" else None
                for mode in modes or [None]:
                    r = bench_store_tier(
                        tier,
                        size,
                        total=args.total,
                        blocks=args.blocks,
                        threads=threads,
                        repeats=args.repeats,
                        progress=progress,
                        ceiling=ceiling,
                        file_dir=file_dir,
                        shm_populate=mode,
                    )
                    r["ceiling"] = ceiling
                    report["results"].append(r)
        if args.overflow:
            from cascade.bench.overflow import run_overflow

            report["overflow"] = run_overflow(
                args,
                threads,
                file_dir or tempfile.mkdtemp(prefix="cascade-bench-", dir=args.file_dir),
                progress,
            )
    finally:
        if file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)
    if not args.skip_micro:
        progress("python per-call overhead (4 KiB get)")
        report["python_overhead"] = python_call_overhead()
        progress("index lookups")
        tl = sorted({1, threads})
        report["index"] = index_rates(tl)
    return report


def _fs_of(path: str) -> str:
    from cascade.machine import _fs_type

    return _fs_type(path)
