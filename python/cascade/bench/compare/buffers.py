"""The arrays every system of the comparison writes from and reads into:
seeded random data and an output array, (blocks, block_bytes) uint8 in
/dev/shm files so that systems driven from another process map the same
bytes, and the check that what was read back is what was written."""

from __future__ import annotations

import atexit
import itertools
import mmap
import os

import numpy as np

from cascade.bench.adapters import Workload

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
        self._maps: list = []
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
        del self.data, self.out  # the maps close only when no view is left
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
        a, b = wl.data[s : s + rows], wl.out[s : s + rows]
        if not np.array_equal(a, b):
            bad = s + int(np.nonzero((a != b).any(axis=1))[0][0])
            raise RuntimeError(f"bytes read back differ from bytes written (block {bad})")
