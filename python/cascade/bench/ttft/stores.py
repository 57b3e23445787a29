"""The Cascade stores behind the cached modes: a host tier in shared memory
(hot), a file tier opened cold on its directory (cold)."""

from __future__ import annotations

import os

_shm_counter = [0]


def _shm_path(tag: str) -> str:
    _shm_counter[0] += 1
    return f"/dev/shm/cascade-ttft-{os.getpid()}-{tag}-{_shm_counter[0]}"


def _config(pipeline: str, *, capacity: int = 0, directory: str = "", direct: bool = True):
    import cascade

    cfg = cascade.CascadeConfig()
    cfg.pipeline = pipeline
    cfg.use_gpu = False
    if "host" in pipeline:
        cfg.shm_capacity_bytes = max(capacity, 64 << 20)
        cfg.shm_path = _shm_path(pipeline.replace("|", "-"))
    if "file" in pipeline:
        cfg.file_path = directory
        cfg.io_direct = direct
    return cfg
