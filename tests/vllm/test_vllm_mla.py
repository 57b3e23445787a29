"""CascadeConnector under real vLLM (0.33) with multi-head latent attention and
with models of several attention kinds: the MLA KV layout vLLM allocates for a
tiny DeepSeek-V2 config, saved and loaded byte for byte, stored once for every
tensor-parallel rank; sliding-window + full attention as vLLM groups it for a
connector (one group: byte-exact) and what is refused at startup (several
groups, sliding-window-only, Mamba state, MLA over TP without a shared store).
Run by `make test-vllm` (tests/vllm/vllm_harness.py)."""

import os
import uuid

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm",
)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_harness import (  # noqa: E402
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    MLA_HEAD_SIZE,
    NUM_LAYERS,
    SAMPLED_TOKEN,
    Engine,
    make_vllm_config,
    mla_spec,
    write_tiny_deepseek,
    write_tiny_llama,
)

from cascade import _core  # noqa: E402
from cascade.integrations.ids import KvNamespace, prefix_block_ids  # noqa: E402
from cascade.integrations.vllm import CascadeConnector  # noqa: E402

BS = 16
PROMPT = list(range(300, 350))  # 3 full blocks and 2 tokens


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines():
    made = []

    def make(model_dir, extra=None, *, specs=None, num_blocks=64, **kw):
        vc = make_vllm_config(model_dir, {"host_capacity": "64MiB", **(extra or {})}, **kw)
        eng = Engine(vc, num_blocks=num_blocks, specs=specs(vc) if specs else None)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


@pytest.fixture
def pool(tmp_path):
    """A node pool server in this process (the shared store of TP ranks)."""
    shm = f"/dev/shm/cascade-test-mla-{uuid.uuid4().hex[:12]}"
    sock = str(tmp_path / "pool.sock")
    cfg = _core.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = 64 << 20
    cfg.shm_path = shm
    server = _core.PoolServer(cfg, sock)
    yield sock
    server.close()
    if os.path.exists(shm):
        os.unlink(shm)


def mla_specs(vc):
    return {name: mla_spec(vc) for name in LAYERS}


def mla_ids(eng, prompt):
    c = eng.connector
    ns = c.namespace.with_tenant(c.config.namespace_tenant(None))
    return prefix_block_ids(prompt[: len(prompt) // BS * BS], ns)


def test_mla_layout_and_ids(engines, deepseek_dir):
    eng = engines(deepseek_dir, specs=mla_specs)
    assert eng.vc.model_config.use_mla
    spec = eng.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert type(spec) is MLAAttentionSpec and spec.head_size == MLA_HEAD_SIZE
    t = eng.kv_caches[LAYERS[0]]
    assert tuple(t.shape[1:]) == (1, BS, MLA_HEAD_SIZE)  # vLLM's view: [blocks, 1, tokens, latent]
    assert eng.connector.kind == "mla" and eng.worker.kind == "mla"
    kv = eng.worker.worker.kv
    assert kv.kind == "mla" and kv.layout == "flat_bytes"
    assert kv.stored_block_bytes == NUM_LAYERS * BS * MLA_HEAD_SIZE * t.element_size()
    ns = eng.connector.namespace
    assert (ns.layout, ns.tp_rank, ns.tp_world) == ("mla", 0, 1)
    expected = KvNamespace(ns.model, "bfloat16", "mla", BS, 0, 1, None)
    assert ns.digest == expected.digest


@pytest.mark.parametrize(
    "layout,dtype,layerwise",
    [("LBNHC", "bfloat16", False), ("BLHNC", "float16", False), ("LBHNC", "bfloat16", True)],
)
def test_mla_save_then_load_byte_exact(engines, deepseek_dir, layout, dtype, layerwise):
    eng = engines(
        deepseek_dir, {"use_layerwise": layerwise}, specs=mla_specs, layout=layout, dtype=dtype
    )
    a = eng.add("a", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(a, 0) == (0, False)
    eng.run()
    ids = mla_ids(eng, PROMPT)
    assert eng.worker.worker.prefix_length(ids) == 3
    stored = eng.worker.worker.store.get(ids[0])
    assert stored is not None and len(stored) == eng.worker.worker.kv.stored_block_bytes

    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    out, kv_out = eng.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS and not kv_out.invalid_block_ids
    table = eng.block_table("b")
    for i in range(3):
        assert eng.page_is_computed("b", i, PROMPT)
    # Block 0's stored bytes: layer 0's 16 latent rows, then layer 1's.
    rows = [eng.kv_caches[name][table[0], 0].contiguous().view(torch.uint8) for name in LAYERS]
    assert bytes(torch.cat([r.flatten() for r in rows]).numpy()) == bytes(stored)
    eng.run()
    assert list(b.output_token_ids) == [SAMPLED_TOKEN] * 2
    assert eng.worker.metrics.totals["load_blocks"] == 3


def test_mla_tensor_parallel_stores_once(pool, engines, deepseek_dir):
    """TP 2 over one node pool: both ranks use the same ids, rank 0 alone saves,
    rank 1 (its own process) loads rank 0's blocks byte for byte."""
    eng = engines(
        deepseek_dir,
        {"pool_socket": pool, "lookup_timeout_ms": 30000},
        specs=mla_specs,
        tp=2,
    )
    shards = eng.connector.shards
    assert shards.namespaces[0] is shards.namespaces[1] and shards.savers == frozenset({0})
    eng.add("a", PROMPT)
    eng.run()
    for r in eng.ranks:
        assert r.wait_all_saves()
    ids = mla_ids(eng, PROMPT)
    assert eng.ranks[0].prefix_length(ids) == 3 and eng.ranks[1].prefix_length(ids) == 3
    assert eng.ranks[0].counters()["save_blocks"] == 3
    assert eng.ranks[1].counters().get("save_blocks", 0) == 0  # stored once, by rank 0

    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    out, kv_out = eng.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS and not kv_out.invalid_block_ids
    for rank in (0, 1):
        for i in range(3):
            assert eng.page_is_computed("b", i, PROMPT, rank=rank)
    eng.run()
    assert eng.ranks[1].counters()["load_blocks"] == 3
    assert eng.ranks[1].counters().get("save_blocks", 0) == 0


def test_mla_tensor_parallel_without_shared_store_is_refused(deepseek_dir):
    vc = make_vllm_config(deepseek_dir, {"host_capacity": "64MiB"}, tp=2)
    with pytest.raises(Exception, match="MLA model.*pool_socket"):
        Engine(vc, specs=mla_specs(vc))


def sliding_and_full(vc):
    """Gemma-2-style alternation: layer 0 a 32-token sliding window, layer 1 full attention."""
    common = dict(
        block_size=vc.cache_config.block_size,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=vc.model_config.dtype,
    )
    return {
        LAYERS[0]: SlidingWindowSpec(sliding_window=32, **common),
        LAYERS[1]: FullAttentionSpec(**common),
    }


def test_sliding_window_and_full_attention_one_group_byte_exact(engines, llama_dir):
    """With a connector that does not declare HMA support, vLLM turns its hybrid
    KV cache manager off: the sliding-window layer gets full-attention pages in
    one group, so every page of every layer is stored and loaded whole."""
    eng = engines(llama_dir, specs=sliding_and_full)
    assert eng.vc.scheduler_config.disable_hybrid_kv_cache_manager
    groups = eng.kv_cache_config.kv_cache_groups
    assert len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
    assert groups[0].kv_cache_spec.sliding_window == 32
    prompt = list(range(500, 600))  # 6 full blocks: beyond the window
    eng.add("a", prompt)
    eng.run()
    b = eng.add("b", prompt)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (6 * BS, False)
    out, kv_out = eng.step()
    assert not kv_out.invalid_block_ids
    for i in range(6):
        assert eng.page_is_computed("b", i, prompt)
    eng.run()


def test_several_kv_cache_groups_are_refused(llama_dir):
    """With the hybrid manager forced on, the sliding-window layer gets a group of its
    own: vLLM's connector factory refuses a connector without HMA support, and the
    connector refuses the groups itself when built directly."""
    vc = make_vllm_config(llama_dir, {"host_capacity": "64MiB"})
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    groups = get_kv_cache_groups(vc, sliding_and_full(vc))
    assert len(groups) == 2
    kv_cache_config = get_kv_cache_config_from_groups(vc, groups, 1 << 20)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(NotImplementedError, match="one KV cache group.*has 2.*hybrid-kv-cache"):
            CascadeConnector(vc, role, kv_cache_config)
    with pytest.raises(ValueError, match="does not support HMA"):
        Engine(vc, specs=sliding_and_full(vc))


def test_sliding_window_only_is_refused(llama_dir):
    vc = make_vllm_config(llama_dir, {"host_capacity": "64MiB"})
    common = dict(
        block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=vc.model_config.dtype
    )
    specs = {name: SlidingWindowSpec(sliding_window=32, **common) for name in LAYERS}
    with pytest.raises(NotImplementedError, match="SlidingWindowSpec layers.*out of the window"):
        Engine(vc, specs=specs)


def test_mamba_state_is_refused(llama_dir):
    vc = make_vllm_config(llama_dir, {"host_capacity": "64MiB"})
    specs = {
        name: MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,)) for name in LAYERS
    }
    with pytest.raises(NotImplementedError, match="MambaSpec layers.*Mamba"):
        Engine(vc, specs=specs)
