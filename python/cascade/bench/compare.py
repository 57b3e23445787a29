"""`cascade bench compare`: Cascade side by side with its peers on the same
work — N blocks of S bytes of seeded random data, T threads — with the
hardware ceiling measured in the same run.

Workloads
- sizes:    block sizes 64 KiB .. 512 MiB; write, hot read, cold read (page
            cache dropped), per-block latency, ratio to the ceiling.
- threads:  the same at 1..cores threads (one block size).
- overflow: Cascade host|file with 0/50/75/90 % of the data beyond the host
            tier's capacity, cold reads, against peers that keep it on disk.
- prefix:   many conversations sharing a few system prompts; bytes stored
            (dedup ratio) with ids named per request and with prefix-chained ids.

Ceilings (measured just before and again just after each workload step, the
better kept): host copy (`memcpy_bandwidth`: the better of memcpy and a
streaming copy, same threads) for memory rows and hot reads from the page
cache; sequential write/read of the same directory (16 MiB requests,
max(4, threads) streams, O_DIRECT and buffered+fdatasync with the page cache
dropped, the better of the two) for file rows; cudaMemcpy from pinned memory
for GPU rows.

Every row's bytes are checked against what was written. A system that cannot
run here is listed with the reason; a row that fails records the error and
the run goes on.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import math
import mmap
import os
import shutil
import tempfile
import time
from typing import Optional

import numpy as np

import cascade
from cascade import _core
from cascade.bench.adapters import Unsupported, Workload, all_adapters
from cascade.bench.adapters.base import aligned_buffer, drop_file_cache, read_all, resident_bytes, write_all
from cascade.bench.common import fmt_size, format_table, parse_size_arg

WORKLOADS = ("sizes", "threads", "overflow", "prefix")
DEFAULT_SIZES = ("64KiB", "1MiB", "16MiB", "512MiB")

# ---------------------------------------------------------------- buffers --

_live_files: set = set()
_seq = itertools.count()


@atexit.register
def _remove_leftovers() -> None:
    for p in list(_live_files):
        try:
            os.unlink(p)
        except OSError:
            pass


class SharedArrays:
    """data and out: (blocks, block_bytes) uint8 arrays in /dev/shm files,
    page aligned, so systems driven from another process map the same bytes."""

    def __init__(self, blocks: int, block_bytes: int, shm_dir: str = "/dev/shm"):
        self.blocks, self.block_bytes = blocks, block_bytes
        tag = f"{os.getpid()}-{next(_seq)}"
        self.data_path = os.path.join(shm_dir, f"cascade-compare-{tag}-data")
        self.out_path = os.path.join(shm_dir, f"cascade-compare-{tag}-out")
        self._maps = []
        self.data = self._map(self.data_path)
        self.out = self._map(self.out_path)

    def _map(self, path: str) -> np.ndarray:
        n = self.blocks * self.block_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        _live_files.add(path)
        try:
            os.ftruncate(fd, n)
            m = mmap.mmap(fd, max(n, 1))
        finally:
            os.close(fd)
        self._maps.append(m)
        return np.frombuffer(m, dtype=np.uint8, count=n).reshape(self.blocks, self.block_bytes)

    def fill_random(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        flat = self.data.reshape(-1)
        step = 64 << 20
        for s in range(0, flat.size, step):
            e = min(flat.size, s + step)
            flat[s:e] = np.frombuffer(rng.bytes(e - s), dtype=np.uint8)
        self.out.reshape(-1)[:] = 1  # touched, so reads do not time first-touch faults

    def close(self) -> None:
        self.data = self.out = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still alive somewhere; the unlink below frees the file
        self._maps = []
        for p in (self.data_path, self.out_path):
            try:
                os.unlink(p)
            except OSError:
                pass
            _live_files.discard(p)


def _verify(wl: Workload) -> None:
    rows = max(1, (64 << 20) // max(wl.block_bytes, 1))
    for s in range(0, wl.blocks, rows):
        a, b = wl.data[s:s + rows], wl.out[s:s + rows]
        if not np.array_equal(a, b):
            bad = s + int(np.nonzero((a != b).any(axis=1))[0][0])
            raise RuntimeError(f"bytes read back differ from bytes written (block {bad})")


# --------------------------------------------------------------- ceilings --

# Ceilings use at least this many bytes (less is dominated by setup, or on a
# disk by its burst behaviour); --quick lowers both.
CEILING_MIN_BYTES = 256 << 20
FILE_CEILING_MIN_BYTES = 1 << 30


def memcpy_ceiling(nbytes: int, threads: int, min_bytes: int = CEILING_MIN_BYTES) -> dict:
    nbytes = max(min_bytes, min(nbytes, 2 << 30))
    c = _core.memcpy_bandwidth(nbytes, threads, 3)
    return {"kind": "host copy", "bytes": nbytes, "threads": threads, "gbps": c["gbps"],
            "memcpy_gbps": c.get("memcpy_gbps"), "stream_gbps": c.get("stream_gbps")}


def _sequential_probe(directory: str, total: int, streams: int, io_bytes: int, direct: bool,
                      repeats: int) -> tuple:
    """(write GB/s, read GB/s, bytes) of `streams` threads each writing then
    reading a file of its own sequentially, `io_bytes` per call, from
    page-aligned mmap buffers, best of `repeats` passes. Writes end with
    fdatasync (timed). direct: O_DIRECT; otherwise buffered I/O with the page
    cache dropped between write and read (a read that would still find pages
    in memory raises: it would not measure the disk)."""
    import concurrent.futures

    per = max(io_bytes, (total // streams) // io_bytes * io_bytes)
    tag = "direct" if direct else "buffered"
    paths = [os.path.join(directory, f".probe-{tag}-{os.getpid()}-{t}") for t in range(streams)]
    bufs = [aligned_buffer(io_bytes) for _ in range(streams)]
    fill = np.frombuffer(np.random.default_rng(7).bytes(io_bytes), np.uint8)
    for b in bufs:
        np.frombuffer(b, dtype=np.uint8)[:] = fill
    odirect = os.O_DIRECT if direct else 0

    def write(t):
        fd = os.open(paths[t], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | odirect, 0o600)
        try:
            for off in range(0, per, io_bytes):
                write_all(fd, bufs[t], off)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(t):
        fd = os.open(paths[t], os.O_RDONLY | odirect)
        try:
            for off in range(0, per, io_bytes):
                if read_all(fd, bufs[t], off) != io_bytes:
                    raise OSError("short read in the sequential probe")
        finally:
            os.close(fd)

    best_w = best_r = 0.0
    try:
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(write, range(streams)))
                t1 = time.perf_counter()
                if not direct:
                    for p in paths:
                        drop_file_cache(p)
                    left = sum(resident_bytes(p) for p in paths)
                    if left > per * streams // 100:
                        raise RuntimeError(f"the page cache kept {left} of {per * streams} probe bytes "
                                           "after posix_fadvise(DONTNEED): no cold read possible here")
                t2 = time.perf_counter()
                list(pool.map(read, range(streams)))
                t3 = time.perf_counter()
                best_w = max(best_w, per * streams / (t1 - t0) / 1e9)
                best_r = max(best_r, per * streams / (t3 - t2) / 1e9)
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass
    return best_w, best_r, per * streams


def file_ceiling(directory: str, nbytes: int, threads: int, io_bytes: int = 16 << 20, repeats: int = 2,
                 min_bytes: int = FILE_CEILING_MIN_BYTES) -> dict:
    """What the device under `directory` can do sequentially, in this run.

    Two probes on the same directory, each writing max(4, threads) files of
    its own in `io_bytes` requests (write timed with its final fsync), then
    reading them back:
    - raw O_DIRECT (the design's ceiling): the file tier's own probe
      (`probe_direct_io`, C++ threads, aligned buffers), or the same pattern
      from Python where that binding is missing;
    - buffered with fdatasync, the page cache dropped (and checked to be
      dropped) before reading: on a virtual disk, kernel readahead keeps
      more requests in flight than one O_DIRECT request per stream and reads
      faster, and buffered rows must not sit above their ceiling.
    The ceiling is the better of the two; both are reported. At least
    `min_bytes` (1 GiB by default: less is dominated by the disk's burst
    behaviour) and at most 2 GiB are moved per pass; the best of `repeats`
    passes is kept."""
    streams = max(4, threads)
    total = max(min_bytes, min(nbytes, 2 << 30))
    io_bytes = max(1 << 20, min(io_bytes, (total // streams) >> 20 << 20))
    out = {"kind": "sequential, best of O_DIRECT and buffered+fdatasync (cold)", "streams": streams,
           "io_bytes": io_bytes, "repeats": repeats}
    direct = None
    core_probe = getattr(_core, "probe_direct_io", None)
    if core_probe is not None:
        try:
            runs = [core_probe(directory, total, io_bytes, streams) for _ in range(repeats)]
        except cascade.CascadeError as e:
            out["direct_error"] = f"probe_direct_io: {type(e).__name__}: {e}"
        else:
            out["direct_probe"] = "probe_direct_io"
            if all(r["direct"] for r in runs):
                direct = (max(r["write_gbps"] for r in runs), max(r["read_gbps"] for r in runs),
                          runs[0]["bytes"])
            else:  # the probe fell back to buffered I/O: not an O_DIRECT figure
                out["direct_error"] = f"the file system of {directory} refuses O_DIRECT"
    if direct is None and "direct_error" not in out:
        try:
            direct = _sequential_probe(directory, total, streams, io_bytes, True, repeats)
            out["direct_probe"] = "python"
        except OSError as e:  # EINVAL: a file system without O_DIRECT
            out["direct_error"] = f"O_DIRECT: {e}"
    buffered = _sequential_probe(directory, total, streams, io_bytes, False, repeats)
    dw, dr = (direct[0], direct[1]) if direct else (0.0, 0.0)
    out.update({"bytes": buffered[2], "direct": direct is not None, "direct_write_gbps": dw,
                "direct_read_gbps": dr, "buffered_write_gbps": buffered[0], "buffered_read_gbps": buffered[1],
                "write_gbps": max(dw, buffered[0]), "read_gbps": max(dr, buffered[1])})
    return out


def _file_detail(f: dict) -> str:
    direct = (f"O_DIRECT {f['direct_write_gbps']:.2f}/{f['direct_read_gbps']:.2f}" if f.get("direct", True)
              else f"no O_DIRECT: {f.get('direct_error', 'refused')}")
    return f"{direct}, buffered {f['buffered_write_gbps']:.2f}/{f['buffered_read_gbps']:.2f}"


def gpu_ceiling(nbytes: int) -> Optional[dict]:
    from cascade.bench.adapters.torch_copy import _torch_problem, pinned_copy_ceiling
    if _torch_problem():
        return None
    return pinned_copy_ceiling(nbytes)


class Ceilings:
    """The ceilings of one workload step, measured on demand, once."""

    def __init__(self, workdir: str, nbytes: int, threads: int, progress, min_bytes: int = CEILING_MIN_BYTES,
                 repeats: int = 2, file_min_bytes: int = FILE_CEILING_MIN_BYTES):
        self.workdir, self.nbytes, self.threads, self.progress = workdir, nbytes, threads, progress
        self.min_bytes, self.repeats, self.file_min_bytes = min_bytes, repeats, file_min_bytes
        self._mem = self._file = self._gpu = None

    def memory(self) -> dict:
        if self._mem is None:
            self._mem = memcpy_ceiling(self.nbytes, self.threads, self.min_bytes)
            self.progress(f"  ceiling: host copy {self._mem['gbps']:.2f} GB/s ({self.threads} threads)")
        return self._mem

    def file(self) -> dict:
        if self._file is None:
            self._file = file_ceiling(self.workdir, self.nbytes, self.threads, repeats=self.repeats,
                                      min_bytes=self.file_min_bytes)
            f = self._file
            self.progress(f"  ceiling: disk write {f['write_gbps']:.2f} / read {f['read_gbps']:.2f} GB/s "
                          f"({_file_detail(f)}, {f['streams']} streams, {f['bytes'] / 2**30:.2f} GiB)")
        return self._file

    def gpu(self) -> Optional[dict]:
        if self._gpu is None:
            self._gpu = gpu_ceiling(self.nbytes) or {}
            if self._gpu:
                self.progress(f"  ceiling: pinned H2D {self._gpu['write_gbps']:.2f} / D2H "
                              f"{self._gpu['read_gbps']:.2f} GB/s")
        return self._gpu or None

    def refresh(self) -> None:
        """Measure the ceilings taken so far again and keep the better value of
        each: a ceiling taken while the shared machine was busy would flatter
        every ratio; the rows ran between the two measurements."""
        def merge(old, new, keys):
            if not old or not new:
                return old
            out = dict(old)
            for k in keys:
                out[k] = max(old[k], new[k])
                out[f"{k}_samples"] = [old[k], new[k]]
            return out

        if self._mem:
            self._mem = merge(self._mem, memcpy_ceiling(self.nbytes, self.threads, self.min_bytes), ["gbps"])
        if self._file:
            self._file = merge(self._file, file_ceiling(self.workdir, self.nbytes, self.threads,
                                                        repeats=self.repeats, min_bytes=self.file_min_bytes),
                               ["write_gbps", "read_gbps", "direct_write_gbps", "direct_read_gbps",
                                "buffered_write_gbps", "buffered_read_gbps"])
        if self._gpu:
            self._gpu = merge(self._gpu, gpu_ceiling(self.nbytes), ["write_gbps", "read_gbps", "gbps"])
        self.progress("  ceilings again after the rows: " + ", ".join(
            f"{k} {v}" for k, v in (("host copy", self._mem and f"{self._mem['gbps']:.2f}"),
                                    ("disk w/r", self._file and f"{self._file['write_gbps']:.2f}/"
                                                                     f"{self._file['read_gbps']:.2f}"),
                                    ("pinned H2D/D2H", self._gpu and f"{self._gpu['write_gbps']:.2f}/"
                                                                      f"{self._gpu['read_gbps']:.2f}"))
            if v) + " GB/s (best of before and after kept)")

    def for_adapter(self, cls) -> dict:
        """{write, hot, cold} ceilings (GB/s) for a row of this adapter."""
        mem = self.memory()["gbps"]
        if cls.medium == "memory":
            return {"write": mem, "hot": mem, "cold": None, "kind": "host copy"}
        if cls.medium == "file":
            f = self.file()
            direct = getattr(cls, "direct", False) or getattr(cls, "io_direct", False)
            return {"write": f["write_gbps"], "hot": f["read_gbps"] if direct else mem,
                    "cold": f["read_gbps"], "kind": "disk sequential / host copy"}
        g = self.gpu() or {}
        return {"write": g.get("write_gbps"), "hot": g.get("read_gbps"), "cold": None,
                "kind": "cudaMemcpy pinned"}

    def as_dict(self) -> dict:
        return {k: v for k, v in (("memory", self._mem), ("file", self._file), ("gpu", self._gpu)) if v}


# ------------------------------------------------------------ measurement --

def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    own = fn(*args)
    wall = time.perf_counter() - t0
    return own if own is not None else wall


def _percentile(values, q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _sample(n: int, k: int) -> list:
    if k <= 0 or n == 0:
        return []
    if n <= k:
        return list(range(n))
    return sorted({int(i * n / k) for i in range(k)})


def measure(cls, wl: Workload, *, repeats: int = 3, latency_samples: int = 200, cold: bool = True,
            progress=lambda m: None) -> dict:
    """Run one system on one workload: write passes, hot reads, cold reads,
    per-block latencies; bytes checked. Returns the row (GB/s are 1e9 B/s)."""
    row = {"system": cls.name, "workload": wl.name, "block_bytes": wl.block_bytes, "blocks": wl.blocks,
           "threads": wl.threads if cls.uses_threads else 1, "total_bytes": wl.total_bytes}
    a = cls()
    t_start = time.perf_counter()
    try:
        a.setup(wl)
        n, total = wl.blocks, wl.total_bytes
        every = range(n)
        sample = _sample(n, latency_samples)
        writes = []
        for _ in range(max(1, repeats)):
            a.clear()
            writes.append(total / _timed(a.put_many, every) / 1e9)
        row["write_gbps"], row["write_gbps_all"] = max(writes), writes
        # Per-block put latency: one block per call into an emptied, warm
        # system; then the rest of the blocks, untimed.
        a.clear()
        put_lat = [_timed(a.put_many, range(i, i + 1)) for i in sample]
        a.put_many(every)
        fp = a.footprint()
        if fp is not None:
            row["footprint_bytes"] = fp
        wl.out.fill(0)
        hots = [total / _timed(a.get_many, every) / 1e9 for _ in range(max(1, repeats))]
        _verify(wl)
        row["hot_read_gbps"], row["hot_read_gbps_all"] = max(hots), hots
        get_lat = [_timed(a.get_many, range(i, i + 1)) for i in sample]
        if cold and a.drop_caches():
            wl.out.fill(0)
            colds, resident = [], 0
            for r in range(max(1, min(repeats, 3))):
                if r:
                    a.drop_caches()
                # What a cold read could still find in the page cache (mincore
                # over the row's files; reads nothing), outside the timing.
                resident = max(resident, resident_bytes(wl.workdir))
                colds.append(total / _timed(a.get_many, every) / 1e9)
            _verify(wl)
            row["cold_read_gbps"], row["cold_read_gbps_all"] = max(colds), colds
            row["cold_resident_bytes"] = resident
        row["verified"] = True
        for name, lat in (("put", put_lat), ("get", get_lat)):
            if lat:
                row[f"{name}_p50_us"] = _percentile(lat, 0.5) * 1e6
                row[f"{name}_p99_us"] = _percentile(lat, 0.99) * 1e6
        row["latency_samples"] = len(sample)
        split = getattr(a, "tier_split", None)
        if split is not None:
            row["tier_blocks"] = split()
        note = a.notes()
        if note:
            row["note"] = note
    except Unsupported as e:
        row["skipped"] = str(e)
    except Exception as e:  # the row records the failure; the run goes on
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            a.teardown()
        except Exception as e:
            row.setdefault("error", f"teardown: {type(e).__name__}: {e}")
    row["seconds"] = time.perf_counter() - t_start
    if "error" in row:
        progress(f"  {cls.name}: ERROR {row['error']}")
    elif "skipped" in row:
        progress(f"  {cls.name}: skipped ({row['skipped']})")
    else:
        cached = row.get("cold_resident_bytes", 0)
        progress(f"  {cls.name}: write {row['write_gbps']:.2f}  hot {row['hot_read_gbps']:.2f}"
                 + (f"  cold {row['cold_read_gbps']:.2f}" if "cold_read_gbps" in row else "")
                 + f" GB/s  ({row['seconds']:.1f} s)"
                 + (f"  [cold reads found {cached / 2**20:.1f} MiB still in the page cache]"
                    if cached > wl.total_bytes // 100 else ""))
    return row


def _annotate(rows: list, ceilings: Ceilings, classes: dict, ref_of=None) -> None:
    """Ratios to the ceiling and Cascade's speedup over each peer."""
    by_system = {r["system"]: r for r in rows}
    for r in rows:
        cls = classes[r["system"]]
        c = ceilings.for_adapter(cls)
        r["ceiling"] = {"write_gbps": c["write"], "hot_read_gbps": c["hot"], "cold_read_gbps": c["cold"],
                        "kind": c["kind"]}
        for m, ck in (("write", "write"), ("hot_read", "hot"), ("cold_read", "cold")):
            if r.get(f"{m}_gbps") and c[ck]:
                r[f"{m}_ratio"] = r[f"{m}_gbps"] / c[ck]
        ref_name = ref_of(cls) if ref_of else cls.compare_to
        if cls.is_cascade or not ref_name:
            continue
        r["vs"] = ref_name
        ref = by_system.get(ref_name)
        if not ref:
            continue
        for m in ("write", "hot_read", "cold_read"):
            if ref.get(f"{m}_gbps") and r.get(f"{m}_gbps"):
                r[f"speedup_{m}"] = ref[f"{m}_gbps"] / r[f"{m}_gbps"]


# --------------------------------------------------------------- workloads --

def _keys(prefix: str, n: int) -> list:
    return [cascade.block_id(f"compare/{prefix}/{i}") for i in range(n)]


class Runner:
    def __init__(self, args, progress):
        self.args, self.progress = args, progress
        self.classes = {c.name: c for c in all_adapters()}
        wanted = list(self.classes) if not args.systems else [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in self.classes]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; known: {', '.join(self.classes)}")
        skip = {s.strip() for s in (args.exclude or "").split(",") if s.strip()}
        self.unavailable, self.selected, self.versions = {}, [], {}
        for name in wanted:
            if name in skip:
                continue
            cls = self.classes[name]
            why = cls.why_unavailable()
            if why:
                self.unavailable[name] = why
                progress(f"{name}: not available: {why}")
            else:
                self.selected.append(cls)
                try:
                    self.versions[name] = cls.versions()
                except Exception as e:
                    self.versions[name] = {"error": str(e)}
        self.on_step = None  # called with (workload, partial result) after each step
        self.root = args.dir or tempfile.mkdtemp(prefix="cascade-compare-")
        self.own_root = not args.dir
        os.makedirs(self.root, exist_ok=True)

    def _step_done(self, workload: str, out: dict) -> None:
        if self.on_step is not None:
            self.on_step(workload, out)

    def _systems(self, workload: str) -> list:
        return [c for c in self.selected if workload in c.workloads]

    def _ceilings(self, nbytes: int, threads: int) -> "Ceilings":
        return Ceilings(self._workdir(), nbytes, threads, self.progress, self.args.ceiling_min_bytes,
                        self.args.ceiling_repeats, self.args.file_ceiling_min_bytes)

    def _workdir(self) -> str:
        return tempfile.mkdtemp(prefix="w", dir=self.root)

    def _wl(self, name, arrays, block_bytes, threads, keys, seed, **kw) -> Workload:
        return Workload(name=name, block_bytes=block_bytes, blocks=arrays.blocks, threads=threads, keys=keys,
                        data=arrays.data, out=arrays.out, data_path=arrays.data_path, out_path=arrays.out_path,
                        workdir=self._workdir(), seed=seed, **kw)

    def _run_rows(self, systems, make_wl, ceilings, ref_of=None, cold=True, repeats=None) -> list:
        # Memory and GPU rows first, then file rows: the disk probe and the file
        # rows leave gigabytes of dirty pages whose writeback would otherwise
        # run under the memory rows. Each group's ceiling is measured just
        # before it; a sync() first lets the previous step's writeback finish.
        order = {"memory": 0, "gpu": 1, "file": 2}
        rows = []
        os.sync()
        ceilings.memory()
        for cls in sorted(systems, key=lambda c: order.get(c.medium, 3)):
            if cls.medium == "file":
                ceilings.file()
            elif cls.medium == "gpu":
                ceilings.gpu()
            wl = make_wl()
            try:
                rows.append(measure(cls, wl, repeats=repeats or self.args.repeats,
                                    latency_samples=self.args.latency_samples, cold=cold, progress=self.progress))
            finally:
                shutil.rmtree(wl.workdir, ignore_errors=True)
        if self.args.refresh_ceilings:
            ceilings.refresh()
        _annotate([r for r in rows if "write_gbps" in r], ceilings, self.classes, ref_of)
        return rows

    # -- sizes ---------------------------------------------------------------
    def sizes(self) -> dict:
        a, out = self.args, {"rows": [], "ceilings": []}
        systems = self._systems("sizes")
        for size in a.sizes:
            n = a.blocks or max(a.min_blocks, a.total // size)
            self.progress(f"sizes: {fmt_size(size)} x {n} blocks ({n * size / 2**30:.2f} GiB), "
                          f"{a.threads} threads")
            arrays = SharedArrays(n, size)
            try:
                arrays.fill_random(seed=size)
                keys = _keys(f"sizes/{size}", n)
                ceilings = self._ceilings(n * size, a.threads)
                # Few large blocks make short passes: the seeds' 512 MB run took 5 repetitions.
                reps = max(a.repeats, a.large_repeats) if size >= (256 << 20) else a.repeats
                rows = self._run_rows(systems, lambda: self._wl("sizes", arrays, size, a.threads, keys, size),
                                      ceilings, repeats=reps)
                out["rows"].extend(rows)
                out["ceilings"].append({"block_bytes": size, **ceilings.as_dict()})
                self._step_done("sizes", out)
            finally:
                arrays.close()
        return out

    # -- threads -------------------------------------------------------------
    def threads(self) -> dict:
        a = self.args
        out = {"rows": [], "ceilings": [], "block_bytes": a.thread_size}
        systems = [c for c in self._systems("threads") if c.uses_threads]
        size = a.thread_size
        n = max(a.min_blocks, a.thread_total // size)
        arrays = SharedArrays(n, size)
        try:
            arrays.fill_random(seed=size + 1)
            keys = _keys(f"threads/{size}", n)
            for t in a.thread_list:
                self.progress(f"threads: {t} thread(s), {fmt_size(size)} x {n} blocks")
                ceilings = self._ceilings(n * size, t)
                rows = self._run_rows(systems, lambda: self._wl("threads", arrays, size, t, keys, size + 1),
                                      ceilings)
                out["rows"].extend(rows)
                out["ceilings"].append({"threads": t, **ceilings.as_dict()})
                self._step_done("threads", out)
        finally:
            arrays.close()
        return out

    # -- overflow ------------------------------------------------------------
    def overflow(self) -> dict:
        a = self.args
        size = a.overflow_size
        n = max(a.min_blocks, a.overflow_total // size)
        total = n * size
        out = {"rows": [], "ceilings": [], "block_bytes": size, "total_bytes": total}
        systems = self._systems("overflow")
        arrays = SharedArrays(n, size)
        try:
            arrays.fill_random(seed=size + 2)
            keys = _keys(f"overflow/{size}", n)
            for pct in a.overflow:
                frac = pct / 100.0
                if frac <= 0:
                    cap = total + max(64 << 20, total // 16)
                else:
                    cap = max(4096, int(math.ceil(total * (1 - frac) / 4096.0)) * 4096)
                self.progress(f"overflow: {pct}% beyond a host tier of {cap / 2**20:.0f} MiB "
                              f"({n} x {fmt_size(size)})")
                ceilings = self._ceilings(total, a.threads)
                ref = "cascade-host|file"
                rows = self._run_rows(
                    systems, lambda: self._wl("overflow", arrays, size, a.threads, keys, size + 2,
                                              host_capacity=cap), ceilings, ref_of=lambda c: ref)
                mem, f = ceilings.memory()["gbps"], ceilings.file()
                model_read = 1.0 / ((1 - frac) / mem + frac / f["read_gbps"])
                model_write = 1.0 / ((1 - frac) / mem + frac / f["write_gbps"])
                for r in rows:
                    r["overflow_pct"] = pct
                    r["host_capacity_bytes"] = cap
                    if r["system"] == ref and "write_gbps" in r:
                        # The ceiling of a split placement: the host part at copy speed,
                        # the rest at the disk's sequential speed.
                        r["ceiling"] = {"write_gbps": model_write, "hot_read_gbps": mem,
                                        "cold_read_gbps": model_read,
                                        "kind": "host copy for the host part, disk sequential for the rest"}
                        r["write_ratio"] = r["write_gbps"] / model_write
                        if r.get("cold_read_gbps"):
                            r["cold_read_ratio"] = r["cold_read_gbps"] / model_read
                out["rows"].extend(rows)
                out["ceilings"].append({"overflow_pct": pct, "model_cold_read_gbps": model_read,
                                        "model_write_gbps": model_write, **ceilings.as_dict()})
                self._step_done("overflow", out)
        finally:
            arrays.close()
        return out

    # -- prefix sharing ------------------------------------------------------
    def prefix(self) -> dict:
        a = self.args
        size, P, pb, C, ub = a.prefix_size, a.prefix_prompts, a.prefix_blocks, a.prefix_conversations, a.unique_blocks
        per_conv = pb + ub
        n = C * per_conv
        out = {"rows": [], "ceilings": [], "block_bytes": size, "prompts": P, "prompt_blocks": pb,
               "conversations": C, "unique_blocks": ub, "logical_bytes": n * size,
               "unique_bytes": (P * pb + C * ub) * size}
        systems = self._systems("prefix")
        arrays = SharedArrays(n, size)
        try:
            rng = np.random.default_rng(size + 3)
            prompts = [np.frombuffer(rng.bytes(pb * size), np.uint8).reshape(pb, size) for _ in range(P)]
            for c in range(C):
                base = c * per_conv
                arrays.data[base:base + pb] = prompts[c % P]
                arrays.data[base + pb:base + per_conv] = np.frombuffer(rng.bytes(ub * size), np.uint8).reshape(ub, size)
            arrays.out.reshape(-1)[:] = 1
            named = [cascade.block_id(f"conv-{c}/block-{j}") for c in range(C) for j in range(per_conv)]
            chained = []
            for c in range(C):
                prev = b"namespace:model=synthetic;dtype=uint8;tp=0"
                for j in range(per_conv):
                    tokens = f"prompt-{c % P}/block-{j}" if j < pb else f"conv-{c}/block-{j}"
                    prev = hashlib.sha256(prev + tokens.encode()).digest()[:16]
                    chained.append(prev.hex())
            for mode, keys in (("per-request ids", named), ("prefix-chained ids", chained)):
                self.progress(f"prefix: {C} conversations over {P} system prompts, {mode}, "
                              f"{n} x {fmt_size(size)}")
                ceilings = self._ceilings(n * size, a.threads)
                rows = self._run_rows(systems, lambda: self._wl("prefix", arrays, size, a.threads, keys, size + 3,
                                                                dedup=True), ceilings, cold=False)
                for r in rows:
                    r["key_mode"] = mode
                    r["logical_bytes"] = n * size
                    fp = r.get("footprint_bytes")
                    if fp:
                        r["dedup_ratio"] = n * size / fp
                        r["saved_bytes"] = max(0, n * size - fp)
                out["rows"].extend(rows)
                self._step_done("prefix", out)
        finally:
            arrays.close()
        return out

    def close(self) -> None:
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def run_compare(args, progress, on_step=None) -> dict:
    from cascade.machine import machine_info

    runner = Runner(args, progress)
    report = {
        "command": "cascade " + " ".join(getattr(args, "argv", [])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("fn", "argv") and not callable(v)},
        "systems": {c.name: {"description": c.description, "medium": c.medium, "compare_to": c.compare_to,
                             "versions": runner.versions.get(c.name, {})} for c in runner.selected},
        "unavailable": runner.unavailable,
        "work_dir_filesystem": _fs_type(runner.root),
        "workloads": {},
    }
    def step(workload, partial):
        report["workloads"][workload] = partial
        if on_step is not None:
            on_step(report)  # what is done so far survives a run cut short

    runner.on_step = step
    try:
        for w in args.workloads:
            t0 = time.perf_counter()
            report["workloads"][w] = getattr(runner, w)()
            report["workloads"][w]["seconds"] = time.perf_counter() - t0
            if on_step is not None:
                on_step(report)
    finally:
        runner.close()
    return report


def _fs_type(path: str) -> str:
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and os.path.abspath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    except OSError:
        pass
    return fstype


# ----------------------------------------------------------------- output --

def _g(v) -> str:
    return "" if v is None else f"{v:.2f}"


def _x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def _lat(us) -> str:
    if us is None:
        return ""
    if us >= 10000:
        return f"{us / 1000:.1f} ms"
    return f"{us:.0f} us"


def _status(r) -> Optional[str]:
    if "error" in r:
        return "error: " + r["error"]
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    return None


def rows_table(rows: list, first: str) -> tuple:
    """(headers, cells) of a result table; `first` names the column that
    tells rows apart (block, threads, overflow)."""
    headers = [first, "system", "write GB/s", "hot read GB/s", "cold read GB/s", "write/ceil", "hot/ceil",
               "cold/ceil", "put p50", "put p99", "get p50", "get p99", "vs", "Cascade x write",
               "Cascade x hot", "Cascade x cold"]
    cells = []
    for r in rows:
        lead = {"block": lambda: fmt_size(r["block_bytes"]), "threads": lambda: str(r["threads"]),
                "overflow": lambda: f"{r.get('overflow_pct', 0)}%"}[first]()
        st = _status(r)
        if st:
            cells.append([lead, r["system"], st] + [""] * (len(headers) - 3))
            continue
        cells.append([lead, r["system"], _g(r.get("write_gbps")), _g(r.get("hot_read_gbps")),
                      _g(r.get("cold_read_gbps")), _g(r.get("write_ratio")), _g(r.get("hot_read_ratio")),
                      _g(r.get("cold_read_ratio")), _lat(r.get("put_p50_us")), _lat(r.get("put_p99_us")),
                      _lat(r.get("get_p50_us")), _lat(r.get("get_p99_us")), r.get("vs", ""),
                      _x(r.get("speedup_write")), _x(r.get("speedup_hot_read")), _x(r.get("speedup_cold_read"))])
    return headers, cells


def prefix_table(rows: list) -> tuple:
    headers = ["ids", "system", "logical MiB", "stored MiB", "dedup ratio", "saved MiB", "write GB/s",
               "hot read GB/s"]
    cells = []
    for r in rows:
        st = _status(r)
        if st:
            cells.append([r.get("key_mode", ""), r["system"], st] + [""] * 5)
            continue
        fp = r.get("footprint_bytes")
        cells.append([r.get("key_mode", ""), r["system"], f"{r['logical_bytes'] / 2**20:.1f}",
                      "" if fp is None else f"{fp / 2**20:.1f}", _x(r.get("dedup_ratio")),
                      "" if fp is None else f"{r.get('saved_bytes', 0) / 2**20:.1f}",
                      _g(r.get("write_gbps")), _g(r.get("hot_read_gbps"))])
    return headers, cells


def _ceiling_lines(w: dict, key: str) -> list:
    out = []
    for c in w.get("ceilings", []):
        label = {"block_bytes": lambda v: fmt_size(v), "threads": lambda v: f"{v} threads",
                 "overflow_pct": lambda v: f"{v}% overflow"}[key](c[key])
        parts = []
        if "memory" in c:
            parts.append(f"host copy {c['memory']['gbps']:.2f}")
        if "file" in c:
            f = c["file"]
            parts.append(f"disk write {f['write_gbps']:.2f} read {f['read_gbps']:.2f} ({_file_detail(f)})")
        if "gpu" in c:
            parts.append(f"pinned H2D {c['gpu']['write_gbps']:.2f} D2H {c['gpu']['read_gbps']:.2f}")
        if "model_cold_read_gbps" in c:
            parts.append(f"split-placement model: write {c['model_write_gbps']:.2f} "
                         f"cold read {c['model_cold_read_gbps']:.2f}")
        out.append(f"  {label}: " + ", ".join(parts) + " GB/s")
    return out


_TITLES = {"sizes": ("block", "Block sizes"), "threads": ("threads", "Thread scaling"),
           "overflow": ("overflow", "Overflow beyond the host tier (cold reads)")}


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [f"cascade bench compare: {m.get('cpu')}, {m.get('cores')} cores, {report['date']}",
             f"work directory file system: {report.get('work_dir_filesystem')}"]
    for name, why in report.get("unavailable", {}).items():
        lines.append(f"not run: {name}: {why}")
    for w, data in report["workloads"].items():
        lines.append("")
        if w == "prefix":
            lines.append(f"Prefix sharing: {data['conversations']} conversations over {data['prompts']} system "
                         f"prompts of {data['prompt_blocks']} blocks, {data['unique_blocks']} own blocks each, "
                         f"{fmt_size(data['block_bytes'])} blocks; unique content "
                         f"{data['unique_bytes'] / 2**20:.1f} MiB of {data['logical_bytes'] / 2**20:.1f} MiB")
            lines.append(format_table(*prefix_table(data["rows"])))
            continue
        first, title = _TITLES[w]
        extra = f" ({fmt_size(data['block_bytes'])} blocks)" if "block_bytes" in data else ""
        lines.append(format_table(*rows_table(data["rows"], first), title=title + extra))
        lines.append("ceilings (measured in this run):")
        lines.extend(_ceiling_lines(data, {"block": "block_bytes", "threads": "threads",
                                           "overflow": "overflow_pct"}[first]))
    lines.append("")
    lines.append("GB/s = 1e9 bytes/s. Cascade x = Cascade's row named in 'vs' divided by the peer's "
                 "(above 1: Cascade faster).")
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    """The tables as Markdown (for docs/benchmarks.md)."""
    def md(headers, cells):
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
        return "\n".join(out)

    parts = []
    for w, data in report["workloads"].items():
        if w == "prefix":
            parts.append("#### Prefix sharing\n\n" + md(*prefix_table(data["rows"])))
            continue
        first, title = _TITLES[w]
        parts.append(f"#### {title}\n\n" + md(*rows_table(data["rows"], first)) + "\n\nCeilings:\n\n"
                     + "\n".join("-" + line[1:] for line in _ceiling_lines(
                         data, {"block": "block_bytes", "threads": "threads", "overflow": "overflow_pct"}[first])))
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------- CLI --

def add_arguments(p) -> None:
    p.add_argument("--systems", help="comma-separated systems (default: all; see --list)")
    p.add_argument("--exclude", help="comma-separated systems to leave out")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--size", action="append", help="block size, repeatable (default: 64KiB 1MiB 16MiB 512MiB)")
    p.add_argument("--total", default="1GiB", help="bytes per block size (default 1GiB)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per size (overrides --total)")
    p.add_argument("--min-blocks", type=int, default=2, help="at least this many blocks per size (default 2)")
    p.add_argument("--threads", type=int, default=0, help="threads (default: one per core)")
    p.add_argument("--thread-list", help="thread counts for the scaling workload (default 1,2,4..cores)")
    p.add_argument("--thread-size", default="1MiB", help="block size of the scaling workload")
    p.add_argument("--thread-total", default="512MiB", help="bytes of the scaling workload")
    p.add_argument("--overflow", default="0,50,75,90", help="percent of the data beyond the host tier")
    p.add_argument("--overflow-size", default="1MiB", help="block size of the overflow workload")
    p.add_argument("--overflow-total", default="1GiB", help="bytes of the overflow workload")
    p.add_argument("--prefix-size", default="256KiB", help="block size of the prefix-sharing workload")
    p.add_argument("--prefix-prompts", type=int, default=4, help="distinct system prompts")
    p.add_argument("--prefix-blocks", type=int, default=8, help="blocks per system prompt")
    p.add_argument("--prefix-conversations", type=int, default=64, help="conversations")
    p.add_argument("--unique-blocks", type=int, default=4, help="blocks of each conversation's own")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per phase; the best is reported")
    p.add_argument("--large-repeats", type=int, default=5,
                   help="at least this many passes for blocks of 256 MiB and more (default 5, as the seeds)")
    p.add_argument("--latency-samples", type=int, default=200, help="blocks timed one by one per row")
    p.add_argument("--dir", help="directory for file-based systems (default: a new temporary directory)")
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    p.add_argument("--json", metavar="FILE", help="JSON path (default OUT/compare.json)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--lmcache-python", help="interpreter of an environment with LMCache installed")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every system")
    p.add_argument("--list", action="store_true", help="list the systems and whether each can run here")
    p.add_argument("--from-json", metavar="FILE",
                   help="measure nothing: print the tables and write the Markdown and plots of a saved report")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _apply_quick(args) -> None:
    args.ceiling_min_bytes, args.ceiling_repeats, args.refresh_ceilings = 16 << 20, 1, False
    args.file_ceiling_min_bytes = 16 << 20
    args.size = args.size or ["64KiB", "1MiB"]
    args.total, args.repeats, args.latency_samples, args.large_repeats = "4MiB", 1, 4, 1
    args.thread_total, args.overflow_total, args.overflow_size = "4MiB", "8MiB", "1MiB"
    args.prefix_size, args.prefix_conversations, args.prefix_prompts = "64KiB", 6, 2
    args.prefix_blocks, args.unique_blocks = 2, 1


def normalise_args(args) -> None:
    args.ceiling_min_bytes, args.ceiling_repeats, args.refresh_ceilings = CEILING_MIN_BYTES, 2, True
    args.file_ceiling_min_bytes = FILE_CEILING_MIN_BYTES
    if args.quick:
        _apply_quick(args)
    args.sizes = [parse_size_arg(s) for s in (args.size or DEFAULT_SIZES)]
    args.total = parse_size_arg(args.total)
    args.thread_size, args.thread_total = parse_size_arg(args.thread_size), parse_size_arg(args.thread_total)
    args.overflow_size, args.overflow_total = parse_size_arg(args.overflow_size), parse_size_arg(args.overflow_total)
    args.prefix_size = parse_size_arg(args.prefix_size)
    args.threads = args.threads or os.cpu_count() or 1
    if args.thread_list:
        args.thread_list = [int(t) for t in str(args.thread_list).split(",") if t.strip()]
    else:
        cores = os.cpu_count() or 1
        args.thread_list = sorted({1 << k for k in range(cores.bit_length()) if (1 << k) <= cores} | {cores})
    args.overflow = [int(p) for p in str(args.overflow).split(",") if p.strip()]
    if isinstance(args.workloads, str):
        args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"unknown workloads {bad}; known: {', '.join(WORKLOADS)}")
    if args.lmcache_python:
        os.environ["CASCADE_LMCACHE_PYTHON"] = args.lmcache_python


def list_systems() -> str:
    rows = []
    for c in all_adapters():
        why = c.why_unavailable()
        rows.append([c.name, c.medium, c.compare_to or "-", "yes" if not why else "no: " + why])
    return format_table(["system", "medium", "compared with", "runs here"], rows)


def main(args, progress) -> int:
    normalise_args(args)
    if args.list:
        print(list_systems())
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = args.json or os.path.join(args.out, "compare.json")

    def save(report):
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2, default=str)
        os.replace(path + ".tmp", path)

    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
    else:
        report = run_compare(args, progress, on_step=save)
    text = format_report(report)
    print(text)
    if not args.from_json:
        save(report)
    with open(os.path.join(args.out, "compare.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(format_markdown(report))
    progress(f"wrote {'' if args.from_json else path + ', '}compare.txt and compare.md in {args.out}")
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            progress("plots skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            from cascade.bench.plots import plot_report
            for p in plot_report(report, args.out):
                progress(f"wrote {p}")
    failed = [r for w in report["workloads"].values() for r in w["rows"] if "error" in r]
    return 1 if failed else 0
