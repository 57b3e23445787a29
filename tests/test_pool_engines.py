"""Engines on the node pool: the vLLM connector's worker stores and the KV
path (save_paged / load_paged, what the connector's workers run) through one
pool server. Replica B loads what replica A saved, a restarted server still
serves it, and another model never hits it."""

from __future__ import annotations

import os
import time
import uuid

import pytest

import cascade
from cascade import _core
from cascade.integrations.connector_config import parse_connector_config, worker_store_config
from cascade.integrations.ids import KvNamespace, prefix_block_ids

torch = pytest.importorskip("torch")
from cascade.integrations.kv import PagedKv, load_paged, save_paged  # noqa: E402

BLOCK = 16
LAYERS, HEADS, HEAD = 2, 2, 32


@pytest.fixture
def pool(tmp_path):
    shm = f"/dev/shm/cascade-test-engines-{uuid.uuid4().hex[:12]}"
    sock = str(tmp_path / "pool.sock")

    def start():
        cfg = _core.CascadeConfig()
        cfg.pipeline = "host"
        cfg.use_gpu = False
        cfg.shm_capacity_bytes = 64 << 20
        cfg.shm_path = shm
        cfg.shm_persist = True  # a restarted server keeps its blocks
        return _core.PoolServer(cfg, sock)

    servers = [start()]
    yield sock, servers, start
    for s in servers:
        if not s.closed:
            s.close()
    if os.path.exists(shm):
        os.unlink(shm)


def engine_store(sock: str, engine_key: str, rank: int = 0):
    cfg = parse_connector_config({"pool_socket": sock, "store_pipeline": "host"})
    return cascade.CascadeStore(worker_store_config(cfg, engine_key=engine_key, rank=rank, world=1))


def kv_cache(blocks: int, seed: int | None = None):
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    layers = [
        torch.randn(blocks, HEADS, BLOCK, 2 * HEAD, generator=g)
        if seed is not None
        else torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD)
        for _ in range(LAYERS)
    ]
    return layers, PagedKv.from_layers(layers, "packed_kv")


def test_worker_store_config_on_the_pool():
    cfg = parse_connector_config({"pool_socket": "/run/cascade/pool.sock"})
    c = worker_store_config(cfg, engine_key="e", rank=3, world=4)
    assert c.pipeline == "pool" and c.pool_socket == "/run/cascade/pool.sock"
    assert c.pool_namespace == "vllm"
    cfg = parse_connector_config(
        {"pool_socket": "/p.sock", "pool_namespace": "team-a", "store_pipeline": "gpu|host"}
    )
    c = worker_store_config(cfg, engine_key="e", rank=0, world=1, gpu_device=1)
    assert c.pipeline == "gpu|pool" and c.pool_namespace == "team-a" and c.gpu_device_id == 1
    with pytest.raises(ValueError, match="server owns the tiers below the pool"):
        parse_connector_config({"pool_socket": "/p.sock", "storage_path": "/kv"})


def test_replica_b_loads_what_replica_a_saved_and_a_restarted_server_keeps_it(pool):
    sock, servers, start = pool
    ns = KvNamespace(model="m", dtype="float32", layout="packed_kv", block_size=BLOCK)
    tokens = list(range(5 * BLOCK))
    ids = prefix_block_ids(tokens, ns)
    blocks = list(range(len(ids)))

    a = engine_store(sock, "replica-a")
    src, kv_a = kv_cache(len(ids), seed=1)
    assert save_paged(a, kv_a, blocks, ids) == [None] * len(ids)
    a.close()

    b = engine_store(sock, "replica-b")
    dst, kv_b = kv_cache(len(ids))
    assert load_paged(b, kv_b, blocks, ids) == [None] * len(ids)
    assert all(torch.equal(x, y) for x, y in zip(src, dst))
    # Another model's ids for the same tokens: nothing to load.
    other = prefix_block_ids(
        tokens, KvNamespace(model="m2", dtype="float32", layout="packed_kv", block_size=BLOCK)
    )
    assert b.contains_batch(other) == [False] * len(other)
    b.close()

    servers[0].close()  # flushes: every block sealed in the kept arena
    servers.append(start())
    c = engine_store(sock, "replica-a")
    dst, kv_c = kv_cache(len(ids))
    assert load_paged(c, kv_c, blocks, ids) == [None] * len(ids)
    assert all(torch.equal(x, y) for x, y in zip(src, dst))
    stats = servers[-1].stats()["store"]["tiers"]["host"]
    assert stats["reattached_blocks"] >= len(ids)
    c.close()


def test_a_save_asks_the_server_which_blocks_it_holds_once_per_batch(pool):
    """Which blocks of a save are stored already, and their sizes, are one
    lookup for the batch, not a request (or two) per block; a block stored
    with another size is still refused."""
    sock, servers, _ = pool
    ns = KvNamespace(model="m", dtype="float32", layout="packed_kv", block_size=BLOCK)
    ids = prefix_block_ids(list(range(64 * BLOCK)), ns)
    blocks = list(range(len(ids)))
    cfg = parse_connector_config({"pool_socket": sock, "store_pipeline": "host"})
    c = worker_store_config(cfg, engine_key="replica-a", rank=0, world=1)
    c.num_io_threads = 2  # the put's own requests: one pair of sub-batches per thread
    w = cascade.CascadeStore(c)
    _, kv = kv_cache(len(ids), seed=3)
    assert save_paged(w, kv, blocks[:8], ids[:8]) == [None] * 8
    before = servers[0].stats()["requests"]
    assert save_paged(w, kv, blocks, ids) == [None] * len(ids)
    requests = servers[0].stats()["requests"] - before
    assert requests < len(ids) // 2, requests
    # Every block stored already: the lookup answers their sizes too.
    before = servers[0].stats()["requests"]
    assert save_paged(w, kv, blocks, ids) == [None] * len(ids)
    assert servers[0].stats()["requests"] - before <= 2
    w.put("f" * 32, b"x" * 3)
    assert "stored with 3 bytes" in save_paged(w, kv, [0], ["f" * 32])[0]
    w.close()


def test_a_running_worker_loads_and_saves_again_once_its_server_is_back(pool):
    """The server stops while a worker's store stays open: loads miss and
    saves fail meanwhile, and once a server is back on the kept arena the
    same store, connected again by itself, loads what it saved before and
    saves anew."""
    sock, servers, start = pool
    ns = KvNamespace(model="m", dtype="float32", layout="packed_kv", block_size=BLOCK)
    ids = prefix_block_ids(list(range(6 * BLOCK)), ns)
    blocks = list(range(len(ids)))
    w = engine_store(sock, "replica-a")
    try:
        src, kv = kv_cache(len(ids), seed=5)
        assert save_paged(w, kv, blocks[:3], ids[:3]) == [None] * 3
        servers[0].close()
        deadline = time.monotonic() + 10
        while not w.get_stats()["tiers"]["pool"]["disconnected"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _, kv_miss = kv_cache(len(ids))
        errors = load_paged(w, kv_miss, blocks[:3], ids[:3])
        # Why is said: the server is gone (not "not stored").
        assert all(e is not None and "node pool server is gone" in e for e in errors), errors
        assert all(e is not None for e in save_paged(w, kv, blocks[3:], ids[3:]))
        # The arena is free once the worker let go of it: the server starts
        # on it again and reattaches what it held.
        while True:
            try:
                servers.append(start())
                break
            except cascade.BusyError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        while w.get_stats()["tiers"]["pool"]["reconnects"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert save_paged(w, kv, blocks[3:], ids[3:]) == [None] * 3
        dst, kv_back = kv_cache(len(ids))
        assert load_paged(w, kv_back, blocks, ids) == [None] * len(ids)
        assert all(torch.equal(x, y) for x, y in zip(src, dst))
    finally:
        w.close()


def test_a_worker_without_its_pool_server_fails_clearly(tmp_path):
    with pytest.raises(cascade.UnavailableError, match="no node pool server listens"):
        engine_store(str(tmp_path / "none.sock"), "e")


@pytest.mark.skipif(not _core.HAVE_UCX, reason="built without a transport (UCX)")
def test_an_engine_on_another_node_loads_what_this_one_saved():
    from cluster_helpers import in_process_cluster

    ns = KvNamespace(model="m", dtype="float32", layout="packed_kv", block_size=BLOCK)
    tokens = list(range(12 * BLOCK))
    ids = prefix_block_ids(tokens, ns)
    blocks = list(range(len(ids)))
    with in_process_cluster(3) as (socks, servers):
        a = engine_store(socks[0], "node-a")
        src, kv_a = kv_cache(len(ids), seed=3)
        assert save_paged(a, kv_a, blocks, ids) == [None] * len(ids)
        a.close()
        assert servers[0].cluster_drain(5000)
        # The scheduler's lookup on node B finds the whole prefix ...
        b = engine_store(socks[1], "node-b")
        assert b.contains_batch(ids) == [True] * len(ids)
        # ... and its worker loads it byte-exact.
        dst, kv_b = kv_cache(len(ids))
        assert load_paged(b, kv_b, blocks, ids) == [None] * len(ids)
        assert all(torch.equal(x, y) for x, y in zip(src, dst))
        b.close()
        stats = [s.cluster_stats() for s in servers]
        assert stats[1]["fetched"] + stats[1]["served_commits"] >= len(ids) // 3
        assert all(s["checksum_failures"] == 0 for s in stats)
