"""File-per-block POSIX storage, the layout of file-based KV-cache stores such
as LMCache's local disk backend: one file per block, named by the block's id, in
4096 subdirectories (the id's first three hex digits), written to a temporary
name and renamed into place, read back with one open/read/close per block.
No fsync on put (the stores it models do not sync either).

Two engines: buffered pread/pwrite (psync) from a thread pool, and O_DIRECT
from page-aligned buffers (the harness's buffers are page aligned; an
unaligned block goes through an mmap-allocated bounce buffer).
"""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np

from cascade.bench.adapters.base import (
    Adapter,
    Unsupported,
    aligned_buffer,
    disk_usage,
    drop_file_cache,
    read_all,
    run_parallel,
    write_all,
)

_ALIGN = 4096


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _FilePerBlock(Adapter):
    medium = "file"
    direct = False

    def setup(self, wl) -> None:
        self.wl = wl
        self.dir = os.path.join(wl.workdir, self.name)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self._made: set = set()
        self._bounce: dict = {}
        self.row_aligned = (
            wl.block_bytes % _ALIGN == 0
            and wl.data.ctypes.data % _ALIGN == 0
            and wl.out.ctypes.data % _ALIGN == 0
        )

    def _path(self, i: int) -> str:
        key = self.wl.keys[i]
        sub = key[:3]
        if sub not in self._made:
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
            self._made.add(sub)
        return os.path.join(self.dir, sub, key)

    def _bounce_for(self, slot: int):
        b = self._bounce.get(slot)
        if b is None:
            b = self._bounce[slot] = aligned_buffer(_round_up(self.wl.block_bytes))
        return b

    def _write_one(self, slot: int, i: int) -> None:
        wl = self.wl
        path = self._path(i)
        tmp = f"{path}.tmp{slot}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(tmp, flags, 0o644)
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL:
                raise Unsupported(f"the file system of {self.dir} refuses O_DIRECT") from None
            raise
        try:
            row = wl.data[i]
            if not self.direct or self.row_aligned:
                write_all(fd, row)
            else:  # O_DIRECT needs aligned memory and lengths: bounce, pad, trim
                b = self._bounce_for(slot)
                n = wl.block_bytes
                np.frombuffer(b, dtype=np.uint8, count=n)[:] = row
                write_all(fd, b[: _round_up(n)])
                os.ftruncate(fd, n)
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def _read_one(self, slot: int, i: int) -> None:
        wl = self.wl
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(self._path(i), flags)
        except FileNotFoundError:
            raise RuntimeError(f"{self.name}: block {i} missing") from None
        try:
            n = wl.block_bytes
            if not self.direct or self.row_aligned:
                got = read_all(fd, wl.out[i])
            else:
                b = self._bounce_for(slot)
                got = read_all(fd, b[: _round_up(n)])
                wl.out[i] = np.frombuffer(b, dtype=np.uint8, count=n)
            if got != n:
                raise RuntimeError(f"{self.name}: block {i} has {got} bytes, expected {n}")
        finally:
            os.close(fd)

    def put_many(self, indices):
        def work(slot, idx):
            for i in idx:
                self._write_one(slot, i)

        run_parallel(work, indices, self.wl.threads)
        return None

    def get_many(self, indices):
        def work(slot, idx):
            for i in idx:
                self._read_one(slot, i)

        run_parallel(work, indices, self.wl.threads)
        return None

    def drop_caches(self) -> bool:
        drop_file_cache(self.dir)
        return True

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self._made = set()

    def footprint(self) -> int | None:
        return disk_usage(self.dir)

    def teardown(self) -> None:
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)
        self._bounce = {}


class PosixPsync(_FilePerBlock):
    name = "posix-psync"
    compare_to = "cascade-file"
    workloads = ("sizes", "threads", "overflow", "prefix")
    description = (
        "file per block in 4096 subdirectories, temp file then rename, buffered "
        "write/pread from a thread pool (LMCache local disk / UCM Posix psync)"
    )


class PosixDirect(_FilePerBlock):
    name = "posix-odirect"
    compare_to = "cascade-file-direct"
    direct = True
    description = (
        "file per block as posix-psync, O_DIRECT from page-aligned buffers "
        "(UCM Posix with io_direct)"
    )

    @classmethod
    def why_unavailable(cls) -> str | None:
        if not hasattr(os, "O_DIRECT"):
            return "this platform has no O_DIRECT"
        return None

    def notes(self) -> str:
        return "O_DIRECT: every read is cold"


ADAPTERS = [PosixPsync, PosixDirect]
