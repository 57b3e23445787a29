"""Cascade's own rows: the host tier, the file tier (page cache and O_DIRECT),
host|file with overflow, and the GPU tier. Driven through the public Python
API with one 2-D array per batch (put_batch / get_batch), as an engine would."""

from __future__ import annotations

import itertools
import os
import tempfile

import cascade
from cascade.bench.adapters.base import Adapter, Unsupported, drop_file_cache

_counter = itertools.count()


def _contiguous(indices) -> slice | None:
    if isinstance(indices, range) and indices.step == 1:
        return slice(indices.start, indices.stop)
    idx = list(indices)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return None


class _CascadeAdapter(Adapter):
    is_cascade = True
    pipeline = "host"

    @classmethod
    def versions(cls) -> dict:
        return {
            "cascade": cascade.__version__,
            "build": (
                f"cuda={cascade.HAVE_CUDA} io_uring={cascade.HAVE_URING} mpi={cascade.HAVE_MPI}"
            ),
        }

    def _config(self, wl):
        cfg = cascade.CascadeConfig()
        cfg.pipeline = self.pipeline
        cfg.use_gpu = "gpu" in self.pipeline
        cfg.num_io_threads = wl.threads
        cfg.dedup_enabled = bool(wl.dedup)
        slack = max(64 << 20, wl.total_bytes // 16)
        cfg.shm_capacity_bytes = wl.total_bytes + slack
        cfg.shm_path = f"/dev/shm/cascade-compare-{os.getpid()}-{next(_counter)}"
        return cfg

    def setup(self, wl) -> None:
        self.wl = wl
        self.store = cascade.CascadeStore(self._config(wl))

    def put_many(self, indices):
        wl, keys = self.wl, self.wl.keys
        s = _contiguous(indices)
        if s is not None and s.stop - s.start == 1:
            ok = self.store.put(keys[s.start], wl.data[s.start])
            stored = 1 if ok else 0
        elif s is not None:
            stored = self.store.put_batch(keys[s], wl.data[s])
        else:
            idx = list(indices)
            stored = self.store.put_batch([keys[i] for i in idx], [wl.data[i] for i in idx])
        if stored != len(indices):
            raise RuntimeError(f"{self.name}: stored {stored} of {len(indices)} blocks")
        return None

    def get_many(self, indices):
        wl, keys = self.wl, self.wl.keys
        s = _contiguous(indices)
        if s is not None and s.stop - s.start == 1:
            found, _size = self.store.get(keys[s.start], wl.out[s.start])
            found = int(found)
        elif s is not None:
            found, _sizes = self.store.get_batch(keys[s], wl.out[s])
        else:
            idx = list(indices)
            found, _sizes = self.store.get_batch([keys[i] for i in idx], [wl.out[i] for i in idx])
        if found != len(indices):
            raise RuntimeError(f"{self.name}: found {found} of {len(indices)} blocks")
        return None

    def clear(self) -> None:
        self.store.clear()

    def footprint(self) -> int | None:
        return int(self.store.get_stats()["physical_bytes"])

    def stats(self) -> dict:
        return self.store.get_stats()

    def teardown(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
            del self.store


class CascadeHost(_CascadeAdapter):
    name = "cascade-host"
    medium = "memory"
    description = "Cascade host tier (/dev/shm arena), put_batch/get_batch"


def _file_tier_problem() -> str | None:
    """None when a store with a file tier opens here, else why not."""
    d = tempfile.mkdtemp(prefix="cascade-compare-probe-")
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "file"
    cfg.use_gpu = False
    cfg.file_path = d
    cfg.num_io_threads = 1
    try:
        with cascade.CascadeStore(cfg):
            pass
        return None
    except cascade.CascadeError as e:
        return f"this build's file tier does not open ({type(e).__name__}: {e})"
    finally:
        for root, dirs, files in os.walk(d, topdown=False):
            for f in files:
                os.unlink(os.path.join(root, f))
            for sub in dirs:
                os.rmdir(os.path.join(root, sub))
        os.rmdir(d)


class _CascadeFileAdapter(_CascadeAdapter):
    medium = "file"
    io_direct = False

    @classmethod
    def why_unavailable(cls) -> str | None:
        return _file_tier_problem()

    def _config(self, wl):
        cfg = super()._config(wl)
        self.dir = os.path.join(wl.workdir, self.name)
        os.makedirs(self.dir, exist_ok=True)
        cfg.file_path = self.dir
        cfg.io_direct = self.io_direct
        # A bound with room for every block twice (records, dead space, and
        # the overflow workload's demotions).
        cfg.file_capacity_bytes = 2 * wl.total_bytes + (256 << 20)
        return cfg

    def drop_caches(self) -> bool:
        self.store.flush()
        drop_file_cache(self.dir)
        return True


class CascadeFile(_CascadeFileAdapter):
    name = "cascade-file"
    pipeline = "file"
    description = "Cascade file tier alone: append-only segment files, pread/pwrite, page cache on"


class CascadeFileDirect(_CascadeFileAdapter):
    name = "cascade-file-direct"
    pipeline = "file"
    io_direct = True
    description = "Cascade file tier alone with io_direct (O_DIRECT segment I/O)"


class CascadeHostFile(_CascadeFileAdapter):
    name = "cascade-host|file"
    pipeline = "host|file"
    workloads = ("overflow",)
    description = (
        "Cascade host|file: host arena sized to hold part of the data, the rest demoted "
        "to segment files; reads without promotion"
    )

    def _config(self, wl):
        cfg = super()._config(wl)
        if wl.host_capacity is not None:
            cfg.shm_capacity_bytes = wl.host_capacity
        # Reads leave blocks where they are, so every read pass sees the same
        # split between host and file (promotion would turn reads into writes).
        cfg.promote_on_hit = False
        return cfg

    def tier_split(self) -> dict:
        tiers = self.store.get_stats().get("tiers", {})
        return {t: int(v.get("blocks", 0)) for t, v in tiers.items()}


class CascadeGpu(_CascadeAdapter):
    name = "cascade-gpu"
    pipeline = "gpu"
    medium = "gpu"
    workloads = ("sizes",)
    description = (
        "Cascade GPU tier: put_batch from host memory (H2D), get_batch into host memory (D2H)"
    )

    @classmethod
    def why_unavailable(cls) -> str | None:
        if not cascade.HAVE_CUDA:
            return (
                "this build of cascade has no CUDA (built with CASCADE_WITH_CUDA=OFF or "
                "without nvcc)"
            )
        if not cascade.gpu_usable():
            return "no usable CUDA GPU on this machine"
        return None

    def _config(self, wl):
        cfg = super()._config(wl)
        cfg.gpu_capacity_bytes = wl.total_bytes + max(64 << 20, wl.total_bytes // 16)
        return cfg


class CascadeGpuPinned(CascadeGpu):
    name = "cascade-gpu-pinned"
    description = (
        "Cascade GPU tier with the caller's host buffers registered with cudaHostRegister "
        "(through torch, as for torch-pinned): DMA straight from/to them"
    )

    @classmethod
    def why_unavailable(cls) -> str | None:
        why = super().why_unavailable()
        if why:
            return why
        from cascade.bench.adapters.torch_copy import _torch_problem

        problem = _torch_problem()
        # cascade has no call to register a caller's memory; torch's runtime bindings do it.
        return f"registering host memory needs torch with CUDA: {problem}" if problem else None

    def setup(self, wl) -> None:
        from cascade.bench.adapters.torch_copy import register_host

        self.registered = register_host([wl.data, wl.out])
        super().setup(wl)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if getattr(self, "registered", None):
                from cascade.bench.adapters.torch_copy import unregister_host

                unregister_host(self.registered)
                self.registered = []


ADAPTERS = [
    CascadeHost,
    CascadeFile,
    CascadeFileDirect,
    CascadeHostFile,
    CascadeGpu,
    CascadeGpuPinned,
]

__all__ = ["ADAPTERS", "Unsupported"]
