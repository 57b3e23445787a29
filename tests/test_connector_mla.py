"""Multi-head latent attention (DeepSeek-style) without vLLM: the ``mla`` KV
layout (one latent vector per token, stored as flat bytes), its ids (one
namespace per pipeline stage, shared by the tensor-parallel ranks), and the
connector's planner and workers with one rank storing and both loading."""

import pytest

torch = pytest.importorskip("torch")

from cascade.integrations import connector_lookup as lk  # noqa: E402
from cascade.integrations.connector_config import ConnectorConfig  # noqa: E402
from cascade.integrations.connector_core import (  # noqa: E402
    KvTransferWorker,
    RankShards,
    SchedulerPlanner,
)
from cascade.integrations.ids import KvNamespace, prefix_block_ids  # noqa: E402
from cascade.integrations.kv import PagedKv, load_paged, mla_block_bytes, save_paged  # noqa: E402
from connector_helpers import (  # noqa: E402
    BS,
    CUDA,
    PROMPT,
    engine_key,
    gpu_test_store,
    open_store,
    planner_for,
    schedule_prefill,
)

LATENT, LAYERS, NB = 24, 3, 16


def mla_layers(seed=None, *, four_d=True, dtype=torch.bfloat16, pad=0, device="cpu"):
    """vLLM's MLA views: [blocks, 1, block_size, latent] per layer over one buffer,
    with ``pad`` elements after each block (a padded page)."""
    per_block = BS * LATENT + pad
    buf = torch.zeros(LAYERS, NB, per_block, dtype=dtype)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    buf = buf.to(device)
    out = {}
    for i in range(LAYERS):
        t = buf[i, :, : BS * LATENT]
        t = t.unflatten(1, (1, BS, LATENT)) if four_d else t.unflatten(1, (BS, LATENT))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def block_rows(layers, block):
    """A block's stored bytes by the format: each layer's [block_size, latent], layer-major."""
    return b"".join(
        t[block].reshape(BS, LATENT).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        for t in layers.values()
    )


def test_mla_namespaces_shared_by_tensor_parallel_ranks():
    s = RankShards.replicated_tp(
        model="deepseek-test", dtype="bfloat16", layout="mla", block_size=16, tp_size=2, pp_size=1
    )
    assert s.world == 2 and s.savers == frozenset({0})
    assert s.namespaces[0] is s.namespaces[1]
    ns = s.namespaces[0]
    assert (ns.layout, ns.tp_rank, ns.tp_world) == ("mla", 0, 1)
    # Test vector (docs/formats.md, "Token block ids", MLA).
    ids = prefix_block_ids(range(100, 116), ns)
    assert len(ids) == 1 and ids == prefix_block_ids(range(100, 116), s.namespaces[1])
    # Pipeline stages hold different layers: one namespace per stage, its first rank stores.
    s = RankShards.replicated_tp(
        model="deepseek-test", dtype="bfloat16", layout="mla", block_size=16, tp_size=2, pp_size=2
    )
    assert [ns.layout for ns in s.namespaces] == ["mla/pp=0of2"] * 2 + ["mla/pp=1of2"] * 2
    assert s.savers == frozenset({0, 2})
    assert s.namespaces[1] is s.namespaces[0] and s.namespaces[2] is s.namespaces[3]
    assert s.namespaces[0].digest != s.namespaces[2].digest
    # Per-rank shards (K/V heads split over ranks) are what they were: rank r of the world.
    base = KvNamespace("llama-test", "bfloat16", "packed_kv", 16, 0, 2)
    p = RankShards.per_rank(base)
    assert [ns.tp_rank for ns in p.namespaces] == [0, 1] and p.savers == frozenset({0, 1})
    with pytest.raises(ValueError, match="positive"):
        RankShards.replicated_tp(
            model="m", dtype="bf16", layout="mla", block_size=16, tp_size=0, pp_size=1
        )


def test_mla_test_vector():
    """docs/formats.md, "Token block ids": the MLA namespace's test vector."""
    ns = KvNamespace("deepseek-test", "bfloat16", "mla", 4, 0, 1)
    assert prefix_block_ids([100, 101, 102, 103], ns) == ["5bfb92f2ac7d1b62b59f7024296204bf"]


@pytest.mark.parametrize("four_d", [True, False])
@pytest.mark.parametrize("pad", [0, 8])
def test_mla_layout_stores_latent_rows_layer_major(four_d, pad):
    src = mla_layers(1, four_d=four_d, pad=pad)
    kv = PagedKv.from_layers(src, "mla", block_size=BS)
    assert kv.kind == "mla" and kv.layout == "flat_bytes" and kv.block_size == BS
    assert kv.stored_block_bytes == LAYERS * BS * LATENT * 2
    store = open_store()
    try:
        ids = [f"{i:032x}" for i in (1, 2, 3)]
        assert save_paged(store, kv, [2, 7, 11], ids) == [None] * 3
        for i, b in zip(ids, (2, 7, 11)):
            assert store.get(i) == block_rows(src, b)
        dst = mla_layers(None, four_d=four_d, pad=pad)
        kv_dst = PagedKv.from_layers(dst, "mla", block_size=BS)
        assert load_paged(store, kv_dst, [0, 5, 9], ids) == [None] * 3
        for a, b in zip((2, 7, 11), (0, 5, 9)):
            for name in src:
                assert torch.equal(src[name][a], dst[name][b])
        untouched = [b for b in range(NB) if b not in (0, 5, 9)]
        assert not any(dst[n][untouched].any() for n in dst)
        # Layer by layer: the same bytes at the same offsets.
        dst2 = mla_layers(None, four_d=four_d, pad=pad)
        kv2 = PagedKv.from_layers(dst2, "mla", block_size=BS)
        for layer in range(LAYERS):
            assert load_paged(store, kv2, [4], ids[:1], layers=(layer, layer + 1)) == [None]
        assert block_rows(dst2, 4) == block_rows(src, 2)
    finally:
        store.close()


def test_mla_layout_refuses_what_it_cannot_store_exactly():
    t = torch.zeros(NB, BS, LATENT, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds blocks of 4 tokens"):
        mla_block_bytes(t, block_size=32)
    strided = torch.zeros(NB, BS, 2 * LATENT, dtype=torch.bfloat16)[:, :, :LATENT]
    with pytest.raises(ValueError, match="must be contiguous.*token stride 48"):
        PagedKv.from_layers([strided], "mla")
    with pytest.raises(ValueError, match="must be contiguous"):
        PagedKv.from_layers([torch.zeros(NB, LATENT, BS).transpose(1, 2)], "mla")
    with pytest.raises(ValueError, match=r"MLA KV cache layer is \[num_blocks"):
        PagedKv.from_layers([torch.zeros(NB, 2, BS, LATENT)], "mla")
    with pytest.raises(TypeError, match="must be a tensor"):
        mla_block_bytes([1, 2, 3])


def test_tensor_parallel_mla_stores_once_and_every_rank_loads():
    """Two TP ranks over one shared store (as with a node pool): the planner gives
    both the same ids, rank 1 stores nothing, and both load rank 0's blocks."""
    key = engine_key()
    shards = RankShards.replicated_tp(
        model="deepseek-test", dtype="bfloat16", layout="mla", block_size=BS, tp_size=2, pp_size=1
    )
    store = open_store()
    config = ConnectorConfig()
    workers, src = [], mla_layers(7)
    for r in (0, 1):
        w = KvTransferWorker(config, store, rank=r, world=2, stores_blocks=r in shards.savers)
        w.register(src, block_size=BS, layout="mla")
        lk.register_worker(key, r, w.prefix_length)
        workers.append(w)
    try:
        planner = SchedulerPlanner(
            config,
            shards.namespaces[0],
            lk.PrefixLookup(key, 2, mode="off"),
            shards=shards,
        )
        table_a = [3, 9, 4, 11, 7, 12]
        n, plan = schedule_prefill(planner, "a", PROMPT, table_a)
        assert n == 0 and len(plan.saves) == 1
        job = plan.saves[0]
        assert job.ids[0] is job.ids[1]  # one list of ids for both ranks
        assert job.ids[0] == prefix_block_ids(PROMPT[: 5 * BS], shards.namespaces[0])
        for w in workers:
            w.submit_saves(plan)
        assert all(w.wait_all_saves(timeout=10) for w in workers)
        assert workers[0].metrics.totals["save_blocks"] == 5
        assert workers[1].metrics.totals.get("save_blocks", 0) == 0
        # Rank 1 reports the request's saves done (vLLM frees the pages once every rank has).
        assert workers[1].finished_saving({"a"}) == {"a"}

        dst = {r: mla_layers() for r in (0, 1)}
        for r, w in enumerate(workers):
            w.register(dst[r], block_size=BS, layout="mla")
        table_b = [1, 2, 5, 6, 8, 10]
        n, plan = schedule_prefill(planner, "b", PROMPT, table_b)
        assert n == 5 * BS and not plan.saves
        for w in workers:
            w.start_load(plan)
            assert w.take_load_errors() == set()
        for r in (0, 1):
            for a, b in zip(table_a[:5], table_b[:5]):
                assert block_rows(dst[r], b) == block_rows(src, a)
    finally:
        for r, w in enumerate(workers):
            lk.unregister_worker(key, r)
            w.close()  # the shared store: closed by the first, a no-op for the second


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no usable CUDA GPU (or a build without CUDA)")
@pytest.mark.parametrize("pipeline", ["host", "gpu|host"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_mla_cuda_pages_save_then_load(pipeline, layerwise):
    """The worker's CUDA path with MLA pages (padded, in device memory): the
    stored bytes follow the format, and a load fills other pages with them."""
    store = gpu_test_store(pipeline)
    key = engine_key()
    worker = KvTransferWorker(ConnectorConfig(use_layerwise=layerwise), store, rank=0, world=1)
    try:
        src = mla_layers(11, pad=8, device="cuda")
        worker.register(src, block_size=BS, layout="mla")
        lk.register_worker(key, 0, worker.prefix_length)
        p = planner_for(key)
        table_a = [3, 9, 4, 11, 7, 12]
        _, plan = schedule_prefill(p, "a", PROMPT, table_a)
        worker.submit_saves(plan)
        assert worker.wait_all_saves(timeout=30)
        ids = plan.saves[0].ids[0]
        for i, b in zip(ids, table_a):
            assert store.get(i) == block_rows(src, b)

        dst = mla_layers(None, pad=8, device="cuda")
        worker.register(dst, block_size=BS, layout="mla")
        table_b = [1, 2, 5, 6, 8, 10]
        n, plan = schedule_prefill(p, "b", PROMPT, table_b)
        assert n == 5 * BS
        worker.start_load(plan)
        for name in dst:
            if layerwise:
                worker.wait_layer(name)
        worker.finish_loads()
        torch.cuda.synchronize()
        assert worker.take_load_errors() == set()
        for a, b in zip(table_a[:5], table_b[:5]):
            assert block_rows(dst, b) == block_rows(src, a)
        assert not any(dst[n][table_b[5]].any() for n in dst)
    finally:
        lk.unregister_worker(key, 0)
        worker.close()
        store.close()
