"""The hardware ceilings each comparison row is set against, measured in the
same run: host copy for memory rows, the directory's sequential write and
read for file rows, pinned cudaMemcpy for GPU rows."""

from __future__ import annotations

import os
import time

import numpy as np

import cascade
from cascade import _core
from cascade.bench.adapters.base import (
    aligned_buffer,
    drop_file_cache,
    read_all,
    resident_bytes,
    write_all,
)

# Ceilings use at least this many bytes (less is dominated by setup, or on a
# disk by its burst behaviour); --quick lowers both.
CEILING_MIN_BYTES = 256 << 20
FILE_CEILING_MIN_BYTES = 1 << 30


def memcpy_ceiling(nbytes: int, threads: int, min_bytes: int = CEILING_MIN_BYTES) -> dict:
    nbytes = max(min_bytes, min(nbytes, 2 << 30))
    c = _core.memcpy_bandwidth(nbytes, threads, 3)
    return {
        "kind": "host copy",
        "bytes": nbytes,
        "threads": threads,
        "gbps": c["gbps"],
        "memcpy_gbps": c.get("memcpy_gbps"),
        "stream_gbps": c.get("stream_gbps"),
    }


def _sequential_probe(
    directory: str, total: int, streams: int, io_bytes: int, direct: bool, repeats: int
) -> tuple:
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
                        raise RuntimeError(
                            f"the page cache kept {left} of {per * streams} probe bytes "
                            "after posix_fadvise(DONTNEED): no cold read possible here"
                        )
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


def file_ceiling(
    directory: str,
    nbytes: int,
    threads: int,
    io_bytes: int = 16 << 20,
    repeats: int = 2,
    min_bytes: int = FILE_CEILING_MIN_BYTES,
) -> dict:
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
    out = {
        "kind": "sequential, best of O_DIRECT and buffered+fdatasync (cold)",
        "streams": streams,
        "io_bytes": io_bytes,
        "repeats": repeats,
    }
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
                direct = (
                    max(r["write_gbps"] for r in runs),
                    max(r["read_gbps"] for r in runs),
                    runs[0]["bytes"],
                )
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
    out.update(
        {
            "bytes": buffered[2],
            "direct": direct is not None,
            "direct_write_gbps": dw,
            "direct_read_gbps": dr,
            "buffered_write_gbps": buffered[0],
            "buffered_read_gbps": buffered[1],
            "write_gbps": max(dw, buffered[0]),
            "read_gbps": max(dr, buffered[1]),
        }
    )
    return out


def _file_detail(f: dict) -> str:
    direct = (
        f"O_DIRECT {f['direct_write_gbps']:.2f}/{f['direct_read_gbps']:.2f}"
        if f.get("direct", True)
        else f"no O_DIRECT: {f.get('direct_error', 'refused')}"
    )
    return f"{direct}, buffered {f['buffered_write_gbps']:.2f}/{f['buffered_read_gbps']:.2f}"


def gpu_ceiling(nbytes: int) -> dict | None:
    from cascade.bench.adapters.torch_copy import _torch_problem, pinned_copy_ceiling

    if _torch_problem():
        return None
    return pinned_copy_ceiling(nbytes)


class Ceilings:
    """The ceilings of one workload step, measured on demand, once."""

    def __init__(
        self,
        workdir: str,
        nbytes: int,
        threads: int,
        progress,
        min_bytes: int = CEILING_MIN_BYTES,
        repeats: int = 2,
        file_min_bytes: int = FILE_CEILING_MIN_BYTES,
    ):
        self.workdir, self.nbytes, self.threads, self.progress = workdir, nbytes, threads, progress
        self.min_bytes, self.repeats, self.file_min_bytes = min_bytes, repeats, file_min_bytes
        # Each ceiling is measured on first use.
        self._mem: dict | None = None
        self._file: dict | None = None
        self._gpu: dict | None = None

    def memory(self) -> dict:
        if self._mem is None:
            m = self._mem = memcpy_ceiling(self.nbytes, self.threads, self.min_bytes)
            self.progress(f"  ceiling: host copy {m['gbps']:.2f} GB/s ({self.threads} threads)")
        return self._mem

    def file(self) -> dict:
        if self._file is None:
            f = self._file = file_ceiling(
                self.workdir,
                self.nbytes,
                self.threads,
                repeats=self.repeats,
                min_bytes=self.file_min_bytes,
            )
            self.progress(
                f"  ceiling: disk write {f['write_gbps']:.2f} / read {f['read_gbps']:.2f} GB/s "
                f"({_file_detail(f)}, {f['streams']} streams, {f['bytes'] / 2**30:.2f} GiB)"
            )
        return self._file

    def gpu(self) -> dict | None:
        if self._gpu is None:
            self._gpu = gpu_ceiling(self.nbytes) or {}
            if self._gpu:
                self.progress(
                    f"  ceiling: pinned H2D {self._gpu['write_gbps']:.2f} / D2H "
                    f"{self._gpu['read_gbps']:.2f} GB/s"
                )
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
            self._mem = merge(
                self._mem, memcpy_ceiling(self.nbytes, self.threads, self.min_bytes), ["gbps"]
            )
        if self._file:
            self._file = merge(
                self._file,
                file_ceiling(
                    self.workdir,
                    self.nbytes,
                    self.threads,
                    repeats=self.repeats,
                    min_bytes=self.file_min_bytes,
                ),
                [
                    "write_gbps",
                    "read_gbps",
                    "direct_write_gbps",
                    "direct_read_gbps",
                    "buffered_write_gbps",
                    "buffered_read_gbps",
                ],
            )
        if self._gpu:
            self._gpu = merge(
                self._gpu, gpu_ceiling(self.nbytes), ["write_gbps", "read_gbps", "gbps"]
            )
        self.progress(
            "  ceilings again after the rows: "
            + ", ".join(
                f"{k} {v}"
                for k, v in (
                    ("host copy", self._mem and f"{self._mem['gbps']:.2f}"),
                    (
                        "disk w/r",
                        self._file
                        and f"{self._file['write_gbps']:.2f}/{self._file['read_gbps']:.2f}",
                    ),
                    (
                        "pinned H2D/D2H",
                        self._gpu and f"{self._gpu['write_gbps']:.2f}/{self._gpu['read_gbps']:.2f}",
                    ),
                )
                if v
            )
            + " GB/s (best of before and after kept)"
        )

    def for_adapter(self, cls) -> dict:
        """{write, hot, cold} ceilings (GB/s) for a row of this adapter."""
        mem = self.memory()["gbps"]
        if cls.medium == "memory":
            return {"write": mem, "hot": mem, "cold": None, "kind": "host copy"}
        if cls.medium == "file":
            f = self.file()
            direct = getattr(cls, "direct", False) or getattr(cls, "io_direct", False)
            return {
                "write": f["write_gbps"],
                "hot": f["read_gbps"] if direct else mem,
                "cold": f["read_gbps"],
                "kind": "disk sequential / host copy",
            }
        g = self.gpu() or {}
        return {
            "write": g.get("write_gbps"),
            "hot": g.get("read_gbps"),
            "cold": None,
            "kind": "cudaMemcpy pinned",
        }

    def as_dict(self) -> dict:
        return {
            k: v for k, v in (("memory", self._mem), ("file", self._file), ("gpu", self._gpu)) if v
        }
