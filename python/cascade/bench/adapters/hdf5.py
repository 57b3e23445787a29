"""HDF5 through h5py, as a KV store would use it: one file, one dataset per
block named by the block's id; a contiguous variant and a chunked one (1 MiB
chunks, no filters). put ends with a flush (metadata to the OS, no fsync);
get reads straight into the output row (read_direct). h5py serialises every
call on one lock, so the thread count does not apply.
"""

from __future__ import annotations

import os

from cascade.bench.adapters.base import Adapter, drop_file_cache

_CHUNK = 1 << 20


class _Hdf5(Adapter):
    medium = "file"
    compare_to = "cascade-file"
    uses_threads = False
    chunked = False

    @classmethod
    def why_unavailable(cls) -> str | None:
        try:
            import h5py  # noqa: F401
        except ImportError:
            return "python package h5py is not installed (pip install h5py)"
        return None

    @classmethod
    def versions(cls) -> dict:
        import h5py

        return {"h5py": h5py.__version__, "libhdf5": h5py.version.hdf5_version}

    def setup(self, wl) -> None:
        import h5py

        self.h5py = h5py
        self.wl = wl
        self.path = os.path.join(wl.workdir, f"{self.name}.h5")
        self.f = h5py.File(self.path, "w")

    def _reopen(self, mode: str) -> None:
        self.f.close()
        self.f = self.h5py.File(self.path, mode)

    def put_many(self, indices):
        wl, f = self.wl, self.f
        chunks = (min(_CHUNK, wl.block_bytes),) if self.chunked and wl.block_bytes else None
        for i in indices:
            key = wl.keys[i]
            if key in f:  # same id, same content: stored once (prefix-chained ids)
                continue
            f.create_dataset(key, data=wl.data[i], chunks=chunks)
        f.flush()
        return None

    def get_many(self, indices):
        wl, f = self.wl, self.f
        for i in indices:
            try:
                ds = f[wl.keys[i]]
            except KeyError:
                raise RuntimeError(f"{self.name}: block {i} missing") from None
            if ds.shape != (wl.block_bytes,):
                raise RuntimeError(f"{self.name}: block {i} has shape {ds.shape}")
            if wl.block_bytes:
                ds.read_direct(wl.out[i])
        return None

    def drop_caches(self) -> bool:
        self.f.close()
        drop_file_cache(self.path)
        self.f = self.h5py.File(self.path, "r+")
        return True

    def clear(self) -> None:
        self._reopen("w")

    def footprint(self) -> int | None:
        self.f.flush()
        return os.stat(self.path).st_blocks * 512

    def teardown(self) -> None:
        f = getattr(self, "f", None)
        if f is not None:
            f.close()
            self.f = None
        if getattr(self, "path", None) and os.path.exists(self.path):
            os.unlink(self.path)

    def notes(self) -> str:
        return "h5py serialises calls: one thread"


class Hdf5Contiguous(_Hdf5):
    name = "hdf5"
    workloads = ("sizes", "prefix")
    description = "h5py: one file, one contiguous dataset per block, read_direct"


class Hdf5Chunked(_Hdf5):
    name = "hdf5-chunked"
    chunked = True
    workloads = ("sizes",)
    description = "h5py: one file, one chunked dataset per block (1 MiB chunks, no filters)"


ADAPTERS = [Hdf5Contiguous, Hdf5Chunked]
