"""The Cascade stores behind the cached modes: a host tier in shared memory,
or a client of a node pool server (hot), a file tier opened cold on its
directory (cold)."""

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


class PoolStore:
    """A node pool server in this process, as `cascade serve` runs it (its
    arena backed at start), and one client store of it: the hot store of
    `--hot-store pool`. close() closes the client, then the server."""

    def __init__(self, capacity: int, socket_dir: str):
        import cascade
        from cascade import _core

        cfg = _config("host", capacity=capacity)
        cfg.shm_populate = _core.ShmPopulate.FULL
        self.socket = os.path.join(socket_dir, f"pool-{_shm_counter[0]}.sock")
        self.server = _core.PoolServer(cfg, self.socket)
        try:
            self.store = cascade.CascadeStore(
                cascade.config_from_dict(
                    {"pipeline": "pool", "pool_socket": self.socket, "use_gpu": False}
                )
            )
        except BaseException:
            self.server.close()
            raise

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            self.server.close()
