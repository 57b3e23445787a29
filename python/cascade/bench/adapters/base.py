"""The interface every system in `cascade bench compare` implements, and the
workload it is driven with.

A workload is N blocks of S bytes: a 2-D array `data` (one row per block) in
shared memory, an equally shaped `out` array that reads land in, one key per
block (32 hex characters), a thread count and an empty directory for systems
that write files. The harness owns the bytes; an adapter only moves them, so
every system stores and returns exactly the same bytes and the harness checks
them afterwards.

An adapter:

    why_unavailable()      classmethod: None when the system can run here, else
                           one sentence saying exactly what is missing
    setup(workload)        start the system (server, files, store) for this workload
    put_many(indices)      store blocks data[i] under keys[i] for i in indices
    get_many(indices)      read blocks keys[i] into out[i]; raise on a miss
    drop_caches()          make the next get_many cold (page cache dropped);
                           False when the system has no cold state (memory)
    clear()                remove every block (before a repeated write pass)
    footprint()            bytes the system holds for the stored blocks
    teardown()             stop and delete everything setup made

put_many and get_many may return the seconds they measured themselves (an
adapter that drives another process times the work there, without the IPC);
otherwise the harness times the call. Both are called from one thread; an
adapter spreads work over `workload.threads` threads itself.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


class Unsupported(Exception):
    """This system cannot run this particular workload (the row is skipped
    with the message as its reason)."""


@dataclass
class Workload:
    name: str
    block_bytes: int
    blocks: int
    threads: int
    keys: list
    data: np.ndarray  # (blocks, block_bytes) uint8, page aligned, shared memory
    out: np.ndarray  # same shape: reads land here
    data_path: str  # the shared-memory files behind data and out, for
    out_path: str  # systems driven in another process
    workdir: str  # empty directory for file-based systems
    seed: int = 0
    host_capacity: int | None = None  # overflow workload: bytes of the host tier
    dedup: bool = False  # prefix workload: ask systems that can to dedup
    extra: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.blocks * self.block_bytes


class Adapter:
    """Base class: one subclass per system (or per variant of one)."""

    #: row label, unique, lower case ("redis", "posix-psync", "cascade-host")
    name: str = ""
    #: "memory", "file" or "gpu": picks the ceiling the row is compared with
    medium: str = "memory"
    #: the Cascade row a peer is compared with ("" for Cascade's own rows)
    compare_to: str = ""
    #: True for Cascade's rows
    is_cascade: bool = False
    #: one line: what the row measures and how the system is driven
    description: str = ""
    #: False when the system ignores the thread count (one connection, a global lock)
    uses_threads: bool = True
    #: workloads this adapter takes part in by default
    workloads: tuple = ("sizes", "threads", "prefix")

    @classmethod
    def why_unavailable(cls) -> str | None:
        return None

    @classmethod
    def versions(cls) -> dict:
        """Versions of the software behind the row (library, server)."""
        return {}

    def setup(self, wl: Workload) -> None:
        self.wl = wl

    def put_many(self, indices: Sequence[int]) -> float | None:
        raise NotImplementedError

    def get_many(self, indices: Sequence[int]) -> float | None:
        raise NotImplementedError

    def drop_caches(self) -> bool:
        return False

    def clear(self) -> None:
        raise NotImplementedError

    def footprint(self) -> int | None:
        return None

    def teardown(self) -> None:
        pass

    def notes(self) -> str:
        """Anything the reader should know about this row in this run."""
        return ""


# ---- helpers shared by adapters -------------------------------------------


def split(indices: Sequence[int], parts: int) -> list:
    """indices cut into at most `parts` contiguous, non-empty pieces."""
    indices = list(indices)
    parts = max(1, min(parts, len(indices)))
    step, extra = divmod(len(indices), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + step + (1 if p < extra else 0)
        out.append(indices[start:end])
        start = end
    return [o for o in out if o]


def run_parallel(fn: Callable, indices: Sequence[int], threads: int) -> None:
    """fn(slot, chunk) on `threads` contiguous chunks of indices, slot being
    the chunk's number (0..threads-1); the first error is raised."""
    chunks = split(indices, threads)
    if len(chunks) <= 1:
        for c in chunks:
            fn(0, c)
        return
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        for f in [pool.submit(fn, slot, c) for slot, c in enumerate(chunks)]:
            f.result()


def drop_file_cache(path: str) -> int:
    """Write back and drop the page cache of every file under path: one
    sync() (dirty pages cannot be dropped; one sync is far cheaper than an
    fsync per file), then posix_fadvise(DONTNEED) on each file. Returns the
    number of files."""
    files = _files_under(path)
    os.sync()
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def _files_under(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    out: list[str] = []
    for root, _dirs, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return out


_libc = None


def resident_bytes(path: str) -> int:
    """Bytes of the files under path that are in the page cache now
    (mmap + mincore, which reads nothing): what a "cold" read would still
    find in memory. Files removed meanwhile count as 0."""
    import ctypes

    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    page = os.sysconf("SC_PAGE_SIZE")
    failed = ctypes.c_void_p(-1).value
    total = 0
    for f in _files_under(path):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == failed:
                raise OSError(ctypes.get_errno(), f"mmap of {f} for mincore failed")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                total += min(size, sum(v & 1 for v in vec) * page)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def disk_usage(path: str) -> int:
    """Bytes allocated on disk for every file under path (st_blocks)."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned anonymous buffer (mmap), as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))


def is_aligned(arr: np.ndarray, alignment: int = 4096) -> bool:
    return arr.ctypes.data % alignment == 0 and arr.nbytes % alignment == 0


def write_all(fd: int, buf, offset: int | None = None) -> None:
    """Write every byte of buf (the kernel may write less than asked)."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        if offset is None:
            n = os.write(fd, mv[done:])
        else:
            n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write: {done} of {len(mv)} bytes")
        done += n


def read_all(fd: int, buf, offset: int = 0) -> int:
    """Read into every byte of buf from offset; returns bytes read (less at EOF)."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
