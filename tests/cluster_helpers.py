"""Node servers of one cluster in this process, for engine tests: PoolServers
with cluster members over UCX (TCP) and a view installed directly, with no
coordination service (test_cluster_data.py runs the real thing)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid

from cascade import _core
from cascade.cluster import PlacementRing


@contextlib.contextmanager
def in_process_cluster(
    n: int,
    capacity: int = 64 << 20,
    map_same_host: bool = True,
    arenas: list[str] | None = None,
):
    """Yields the servers' socket paths; the view places ids over all n.
    map_same_host: the servers map each other's arenas (one host) or move
    blocks over UCX only. arenas, when given, gets the servers' arena paths."""
    d = tempfile.mkdtemp(prefix="cascade-cl-")
    servers: list = []
    shms: list[str] = [] if arenas is None else arenas
    try:
        for i in range(n):
            cfg = _core.CascadeConfig()
            cfg.pipeline = "host"
            cfg.use_gpu = False
            cfg.shm_capacity_bytes = capacity
            cfg.shm_path = f"/dev/shm/cascade-test-cl-{uuid.uuid4().hex[:12]}"
            shms.append(cfg.shm_path)
            servers.append(_core.PoolServer(cfg, os.path.join(d, f"n{i}.sock")))
        addresses = [
            s.start_cluster(f"n{i}", 1, fabrics="tcp", map_same_host=map_same_host)
            for i, s in enumerate(servers)
        ]
        ring = PlacementRing([f"n{i}" for i in range(n)])
        positions, owners = ring.points()
        members = [(m, 1, addresses[int(m[1:])]) for m in ring.members]
        for s in servers:
            s.set_cluster_view(1, members, positions, owners, 1)
        yield [os.path.join(d, f"n{i}.sock") for i in range(n)], servers
    finally:
        for s in servers:
            if not s.closed:
                s.close()
        for p in shms:
            if os.path.exists(p):
                os.unlink(p)
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
