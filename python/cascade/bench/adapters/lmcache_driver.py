"""Drives LMCache's LocalCPUBackend or LocalDiskBackend for `cascade bench
compare`. Run by the interpreter of an environment where LMCache is
installed (it pins its own torch and numpy), not imported by cascade.

Protocol: one JSON request per line on stdin, one JSON reply per line on the
original stdout (library output is sent to stderr). The workload's bytes are
the harness's own shared-memory files (data_path, out_path), mapped here, so
LMCache stores and returns exactly the bytes the harness checks. Times are
measured here, around LMCache calls only.

How the backends are driven (as LMCache's storage manager drives them):
- put: allocate a MemoryObj from the LocalCPUBackend's allocator, copy the
  block into it (where the engine copies from GPU pages), submit_put_task;
  for disk, the write runs on LMCache's disk worker threads and the put is
  done when every completion callback has fired.
- get: get_blocking (cpu) or batched_get_blocking (disk, LMCache's read
  thread pool), then copy the MemoryObj into the output row.
"""

import asyncio
import json
import mmap
import os
import sys
import threading
import time

_ALLOC_TIMEOUT_S = 120.0
# Copies of at least this many bytes use torch's thread pool (the workload's
# thread count); smaller ones are a plain single-threaded copy. torch's
# OpenMP pool spun for milliseconds per 64 KiB copy on a busy 2-core machine,
# which would have been charged to LMCache. Cascade splits copies at the same size.
_PARALLEL_COPY_BYTES = 4 << 20
_WRITE_TIMEOUT_S = 600.0


def _open_array(path, rows, cols, np):
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, rows * cols) if rows * cols else None
    finally:
        os.close(fd)
    if m is None:
        return np.zeros((rows, cols), dtype=np.uint8), None
    return np.frombuffer(m, dtype=np.uint8).reshape(rows, cols), m


class Driver:
    def __init__(self):
        import numpy as np
        import torch

        self.np, self.torch = np, torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.CacheEngineKey = CacheEngineKey
        self.LMCacheEngineConfig = LMCacheEngineConfig
        self.MixedMemoryAllocator = MixedMemoryAllocator
        self.fmt = MemoryFormat.KV_2LTD  # LMCache's default (non-layerwise) chunk format
        self.LocalCPUBackend = LocalCPUBackend
        self.LocalDiskBackend = LocalDiskBackend
        self.cpu = self.disk = None
        self.loop = None

    # -- lifecycle -----------------------------------------------------------
    def setup(self, req):
        np, torch = self.np, self.torch
        self.req = req
        self.backend = req["backend"]
        self.n, self.size = req["blocks"], req["block_bytes"]
        self.threads = max(1, req["threads"])
        torch.set_num_threads(self.threads)
        data, self._dm = _open_array(req["data_path"], self.n, self.size, np)
        out, self._om = _open_array(req["out_path"], self.n, self.size, np)
        self.src, self.dst = torch.from_numpy(data), torch.from_numpy(out)
        self.keys = [
            self.CacheEngineKey("cascade-compare", 1, 0, int(k, 16), torch.uint8)
            for k in req["keys"]
        ]
        self.shape = torch.Size([self.size])
        self.disk_dir = os.path.join(req["workdir"], "lmcache-disk") + "/"
        self._make()
        return {}

    def _make(self):
        total = self.n * self.size
        gib = float(1 << 30)
        if self.backend == "cpu":
            pool = total + max(64 << 20, total // 16)
        else:  # staging only: reads allocate one batch at a time
            pool = min(total, 1 << 30) + self.size + (64 << 20)
        pool = (pool + 4095) // 4096 * 4096
        cfg = self.LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=(self.backend == "cpu"),
            max_local_cpu_size=pool / gib,
            local_disk=self.disk_dir if self.backend == "disk" else None,
            max_local_disk_size=(2 * total + (256 << 20)) / gib,
            extra_config={"disk_io_threads": self.threads},
        )
        self.pool_bytes = pool
        alloc = self.MixedMemoryAllocator(pool)
        self.cpu = self.LocalCPUBackend(cfg, memory_allocator=alloc)
        if self.backend == "disk":
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True).start()
            os.makedirs(self.disk_dir, exist_ok=True)
            self.disk = self.LocalDiskBackend(cfg, self.loop, self.cpu, dst_device="cpu")

    def _close(self):
        if self.disk is not None:
            for k in list(self.disk.dict.keys()):
                self.disk.remove(k)
            self.disk.close()
            self.disk = None
        if self.cpu is not None:
            for k in list(self.cpu.hot_cache.keys()):
                self.cpu.remove(k)
            close = getattr(self.cpu.memory_allocator, "close", None)
            if close is not None:
                close()
            self.cpu = None

    def clear(self, req):
        self._close()
        self._make()
        return {}

    def teardown(self, req):
        self._close()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
        return {}

    # -- data path -----------------------------------------------------------
    def _copy(self, dst, src):
        """Copy one block between a harness row and a MemoryObj's tensor (where
        LMCache's engine would run its GPU<->CPU transfer)."""
        src = src.view(self.torch.uint8).reshape(-1)[: self.size]
        if self.size >= _PARALLEL_COPY_BYTES:
            dst.copy_(src)
        else:
            self.np.copyto(dst.numpy(), src.numpy())

    def _allocate(self):
        deadline = time.monotonic() + _ALLOC_TIMEOUT_S
        while True:
            mo = self.cpu.allocate(self.shape, self.torch.uint8, self.fmt, busy_loop=False)
            if mo is not None:
                return mo
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "LMCache's allocator found no room within "
                    f"{_ALLOC_TIMEOUT_S:.0f} s (pool {self.pool_bytes} bytes)"
                )
            time.sleep(0.001)

    def put(self, req):
        idx = _indices(req)
        t0 = time.perf_counter()
        if self.backend == "cpu":
            for i in idx:
                key = self.keys[i]
                if self.cpu.contains(key):
                    continue  # the engine looks up before storing
                mo = self._allocate()
                self._copy(mo.tensor, self.src[i])
                self.cpu.submit_put_task(key, mo)
                mo.ref_count_down()  # the backend holds its own reference
        else:
            pending = set()
            done = threading.Condition()

            def finished(key):
                with done:
                    pending.discard(key)
                    done.notify_all()

            for i in idx:
                key = self.keys[i]
                with done:
                    if key in pending or self.disk.contains(key):
                        continue
                    pending.add(key)
                mo = self._allocate()
                self._copy(mo.tensor, self.src[i])
                self.disk.submit_put_task(key, mo, on_complete_callback=finished)
                mo.ref_count_down()
            deadline = time.monotonic() + _WRITE_TIMEOUT_S
            with done:
                while pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(
                            f"{len(pending)} LMCache disk writes did not complete "
                            f"within {_WRITE_TIMEOUT_S:.0f} s"
                        )
                    done.wait(min(left, 1.0))
        return {"seconds": time.perf_counter() - t0}

    def get(self, req):
        idx = _indices(req)
        t0 = time.perf_counter()
        if self.backend == "cpu":
            for i in idx:
                mo = self.cpu.get_blocking(self.keys[i])
                if mo is None:
                    raise RuntimeError(f"LMCache LocalCPUBackend: block {i} missing")
                self._copy(self.dst[i], mo.tensor)
                mo.ref_count_down()
        else:
            # Batches small enough for the staging pool (batched_get_blocking
            # allocates every buffer of a batch before reading).
            per = max(1, (self.pool_bytes - (64 << 20)) // max(self.size, 1) // 2)
            for s in range(0, len(idx), per):
                part = idx[s : s + per]
                mos = self.disk.batched_get_blocking([self.keys[i] for i in part])
                for i, mo in zip(part, mos):
                    if mo is None:
                        raise RuntimeError(f"LMCache LocalDiskBackend: block {i} missing")
                    self._copy(self.dst[i], mo.tensor)
                    mo.ref_count_down()
        return {"seconds": time.perf_counter() - t0}

    def drop(self, req):
        n = 0
        if self.backend == "disk":  # as the harness does for every file-based system
            os.sync()
            for root, _d, names in os.walk(self.disk_dir):
                for name in names:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                    n += 1
        return {"files": n, "cold": self.backend == "disk"}

    def footprint(self, req):
        if self.backend == "cpu":
            return {"bytes": sum(mo.get_physical_size() for mo in self.cpu.hot_cache.values())}
        total = 0
        for root, _d, names in os.walk(self.disk_dir):
            for name in names:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
        return {"bytes": total}


def _indices(req):
    if "lo" in req:
        return list(range(req["lo"], req["hi"]))
    return list(req["indices"])


def _versions():
    import lmcache
    import numpy
    import torch

    return {
        "lmcache": getattr(lmcache, "__version__", "unknown"),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
    }


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the libraries print goes to stderr
    sys.stdout = sys.stderr
    driver = None
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "hello":
                reply = {"versions": _versions()}
            elif op == "quit":
                proto.write(json.dumps({"ok": True}) + "\n")
                break
            else:
                if driver is None:
                    driver = Driver()
                reply = getattr(driver, op)(req)
            reply["ok"] = True
        except Exception as e:  # reported to the harness, which raises it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    if driver is not None and (driver.cpu is not None or driver.disk is not None):
        try:
            driver.teardown({})
        except Exception:
            pass


if __name__ == "__main__":
    main()
