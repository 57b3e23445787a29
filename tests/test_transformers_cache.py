"""cascade.integrations.transformers: a tiny random Llama on CPU, prompts
sharing prefixes, outputs compared with full compute (logits and greedy
tokens), blocks missing or damaged between lookup and load, namespaces."""

import copy
import os
import shutil
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cascade  # noqa: E402
from cascade.integrations.transformers import (  # noqa: E402
    PrefixCache,
    forward_chunked,
    kv_from_past,
    kv_geometry,
    past_from_kv,
)

BS = 16
VOCAB = 512


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture
def kv_store(make_config):
    with cascade.CascadeStore(make_config(capacity=64 << 20)) as s:
        yield s


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def full_logits(model, ids):
    return model(ids if ids.dim() == 2 else ids[None]).logits[:, -1]


def assert_matches_full(model, ids, logits):
    ref = full_logits(model, ids)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def greedy_from_scratch(model, ids, n):
    seq, out = ids[None], []
    for _ in range(n):
        t = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(t))
        seq = torch.cat([seq, t], 1)
    return out


@torch.no_grad()
def greedy_from_cache(model, logits, past, n):
    tok, out = logits.argmax(-1, keepdim=True), []
    for _ in range(n):
        out.append(int(tok))
        o = model(tok, past_key_values=past)
        past = o.past_key_values
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
    return out


def test_shared_prefix_is_loaded_and_output_matches_full_compute(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(100, 1)
    r1 = pc.prefill(a)
    assert (r1.cached_tokens, r1.computed_tokens, r1.saved_blocks) == (0, 100, 100 // BS)
    assert not r1.load_errors and not r1.save_errors
    assert_matches_full(model, a, r1.logits)

    b = torch.cat([a[:85], tokens(30, 2)])  # shares 85 tokens: 5 whole blocks
    assert pc.lookup(b).usable_blocks == 5
    r2 = pc.prefill(b)
    assert (r2.cached_tokens, r2.computed_tokens, r2.loaded_blocks) == (80, 35, 5)
    assert r2.saved_blocks == len(b) // BS - 5
    assert_matches_full(model, b, r2.logits)
    # The returned cache holds every prompt token: decoding goes on from it.
    assert r2.past_key_values.get_seq_length() == len(b)
    assert greedy_from_cache(model, r2.logits, r2.past_key_values, 6) == greedy_from_scratch(
        model, b, 6
    )


def test_partial_block_prefixes(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(64, 3)  # exactly 4 blocks
    pc.prefill(a)
    # 40 shared tokens = 2.5 blocks: only the 2 whole blocks are used.
    b = torch.cat([a[:40], tokens(23, 4)])
    r = pc.prefill(b)
    assert (r.cached_tokens, r.computed_tokens) == (32, 31)
    assert_matches_full(model, b, r.logits)
    # The whole prompt cached: all 4 blocks load, the last token is still computed.
    r = pc.prefill(a)
    assert (r.cached_tokens, r.computed_tokens, r.loaded_blocks, r.saved_blocks) == (63, 1, 4, 0)
    assert_matches_full(model, a, r.logits)
    # A prefix of a cached prompt that ends inside a block.
    r = pc.prefill(a[:50])
    assert (r.cached_tokens, r.computed_tokens) == (48, 2)
    assert_matches_full(model, a[:50], r.logits)
    # Shorter than a block: nothing to look up or store.
    r = pc.prefill(a[: BS - 1])
    assert (r.cached_tokens, r.saved_blocks) == (0, 0)
    assert_matches_full(model, a[: BS - 1], r.logits)


def test_batch_uses_the_common_cached_prefix(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a, b = tokens(80, 5), tokens(80, 6)
    pc.prefill(a[:64])  # a: 4 blocks cached
    pc.prefill(b[:32])  # b: 2 blocks cached
    x = torch.stack([a, b])
    plan = pc.lookup(x)
    assert plan.present_blocks == [4, 2] and plan.usable_blocks == 2
    r = pc.prefill(x, plan=plan)
    assert (r.cached_tokens, r.computed_tokens) == (32, 48)
    assert_matches_full(model, x, r.logits)
    assert r.saved_blocks == (5 - 4) + (5 - 2)  # each row's missing full blocks
    r = pc.prefill(x, chunk_tokens=8)  # every block cached now; chunking changes nothing
    assert r.cached_tokens == 79
    assert_matches_full(model, x, r.logits)


def test_block_removed_between_lookup_and_load_is_recomputed(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(96, 7)
    pc.prefill(a)
    b = torch.cat([a, tokens(10, 8)])
    plan = pc.lookup(b)
    assert plan.usable_blocks == 6
    assert kv_store.remove(plan.ids[0][2])  # evicted after the lookup
    r = pc.prefill(b, plan=plan)
    assert [(row, blk) for row, blk, _ in r.load_errors] == [(0, 2)]
    assert "not" in r.load_errors[0][2]
    assert (r.cached_tokens, r.loaded_blocks) == (32, 2)  # the prefix before the missing block
    assert_matches_full(model, b, r.logits)
    assert kv_store.contains(plan.ids[0][2])  # stored again from the recomputed KV
    r = pc.prefill(b)
    assert r.cached_tokens == 96 and not r.load_errors
    assert_matches_full(model, b, r.logits)


def test_block_of_the_wrong_size_is_an_error_not_data(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(48, 9)
    pc.prefill(a[:BS])  # block 0 stored for real
    ids = pc.block_ids(a)[0]
    kv_store.put(ids[1], np.ones(pc.block_bytes // 2, dtype=np.uint8))  # block 1: the wrong size
    plan = pc.lookup(a)
    assert plan.usable_blocks == 2
    r = pc.prefill(a, plan=plan, save=False)
    assert [blk for _, blk, _ in r.load_errors] == [1]
    assert "bytes" in r.load_errors[0][2]
    assert r.cached_tokens == BS
    assert_matches_full(model, a, r.logits)


def test_namespaces_do_not_share_blocks(model, kv_store):
    a = tokens(64, 10)
    PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS).prefill(a)
    same = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    assert same.lookup(a).usable_blocks == 4
    others = [
        PrefixCache(model, kv_store, model_name="another-model", block_size=BS),
        PrefixCache(
            model, kv_store, model_name="tiny-llama-test", block_size=BS, tenant="tenant-b"
        ),
        PrefixCache(
            copy.deepcopy(model).to(torch.float64),
            kv_store,
            model_name="tiny-llama-test",
            block_size=BS,
        ),
        PrefixCache(
            model, kv_store, model_name="tiny-llama-test", block_size=BS, tp_rank=1, tp_world=2
        ),
        PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=2 * BS),
    ]
    for pc in others:
        assert pc.lookup(a).usable_blocks == 0, pc.namespace
        r = pc.prefill(a, save=False)
        assert r.cached_tokens == 0
    tenant_a = PrefixCache(
        model, kv_store, model_name="tiny-llama-test", block_size=BS, tenant="tenant-a"
    )
    tenant_a.prefill(a)
    assert tenant_a.lookup(a).usable_blocks == 4
    assert others[1].lookup(a).usable_blocks == 0


def test_a_model_configured_otherwise_under_one_name_does_not_share_blocks(model, kv_store):
    """One name, one KV shape, but another RoPE base (as an override for a
    longer context gives): its K differs, so its ids do. A field that cannot
    change K and V (the attention implementation) keeps them."""
    a = tokens(64, 11)
    PrefixCache(model, kv_store, model_name="tiny-llama-cfg", block_size=BS).prefill(a)
    other = copy.deepcopy(model)
    rope = getattr(other.config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        other.config.rope_parameters = dict(rope, rope_theta=rope["rope_theta"] * 4)
    else:
        other.config.rope_theta = getattr(other.config, "rope_theta", 10000.0) * 4
    pc = PrefixCache(other, kv_store, model_name="tiny-llama-cfg", block_size=BS)
    assert pc.lookup(a).usable_blocks == 0
    assert pc.prefill(a, save=False).cached_tokens == 0
    same = copy.deepcopy(model)
    same.config._attn_implementation = "eager"
    same.config.use_cache = not same.config.use_cache
    pc = PrefixCache(same, kv_store, model_name="tiny-llama-cfg", block_size=BS)
    assert pc.lookup(a).usable_blocks == 4


def test_hit_ratio_limits_the_loaded_prefix(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(160, 11)
    pc.prefill(a)
    r = pc.prefill(a, hit_ratio=0.8, save=False)  # 128 tokens = 8 blocks
    assert (r.cached_tokens, r.computed_tokens) == (128, 32)
    assert_matches_full(model, a, r.logits)
    limited = PrefixCache(
        model, kv_store, model_name="tiny-llama-test", block_size=BS, hit_ratio=0.5
    )
    assert limited.lookup(a).usable_blocks == 5


def test_cold_file_tier_in_a_new_store(model, shm_path):
    d = tempfile.mkdtemp(prefix="cascade-tf-test-")
    try:

        def cfg(path):
            c = cascade.CascadeConfig()
            c.pipeline, c.shm_path, c.shm_capacity_bytes = "host|file", path, 64 << 20
            c.lustre_path, c.io_direct, c.num_io_threads = d, True, 2
            c.write_policy = cascade.WritePolicy.WRITE_THROUGH
            return c

        a = tokens(120, 12)
        with cascade.CascadeStore(cfg(shm_path)) as s:
            assert (
                PrefixCache(model, s, model_name="tiny-llama-test", block_size=BS)
                .prefill(a)
                .saved_blocks
                == 7
            )
            s.flush()
        # A new store on the same directory: empty host tier, blocks only in the files.
        with cascade.CascadeStore(cfg(shm_path + "-b")) as s:
            r = PrefixCache(model, s, model_name="tiny-llama-test", block_size=BS).prefill(
                a, save=False
            )
            assert (r.cached_tokens, r.loaded_blocks) == (112, 7) and not r.load_errors
            assert_matches_full(model, a, r.logits)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(shm_path + "-b"):
            os.unlink(shm_path + "-b")


@pytest.mark.parametrize("host_blocks", [64, 3])
def test_blocks_a_plan_leaves_in_the_files_are_promoted_into_free_room(
    model, shm_path, host_blocks
):
    """A plan that computes rather than read a slow tier queues the promotion
    of the cached blocks it left there, as many as the host tier has free
    room for (a block already there is never evicted for them); the next
    prompt with that prefix loads them from memory."""
    from cascade.planner import LoadPlanner

    d = tempfile.mkdtemp(prefix="cascade-tf-test-")
    g = kv_geometry(model)
    block_bytes = BS * g.bytes_per_token
    try:

        def cfg(path, capacity):
            c = cascade.CascadeConfig()
            c.pipeline, c.shm_path, c.shm_capacity_bytes = "host|file", path, capacity
            c.lustre_path, c.io_direct, c.num_io_threads = d, True, 2
            c.write_policy = cascade.WritePolicy.WRITE_THROUGH
            return c

        a = tokens(120, 31)
        with cascade.CascadeStore(cfg(shm_path, 64 << 20)) as s:
            PrefixCache(model, s, model_name="tiny-llama-test", block_size=BS).prefill(a)
            s.flush()
        # A new store on the files: an empty host tier holding `host_blocks` blocks,
        # one of them taken by an unrelated block.
        with cascade.CascadeStore(cfg(shm_path + "-b", host_blocks * block_bytes)) as s:
            s.put("ab" * 16, b"z" * block_bytes)
            slow = LoadPlanner(
                list(s.pipeline),
                g.bytes_per_token,
                g.num_layers,
                rates={"host": 50.0, "file": 1e-9},
                default_tokens_per_s=1e9,
            )
            pc = PrefixCache(model, s, model_name="tiny-llama-test", block_size=BS, planner=slow)
            ids = pc.block_ids(a)[0]
            assert s.locate_batch(ids) == [1] * 7
            r = pc.prefill(a, save=False)
            assert r.plan.kind == "compute" and r.cached_tokens == 0
            room = host_blocks - 1
            assert r.promoting_blocks == min(7, room)
            pc.wait_promotion()
            where = s.locate_batch(ids)
            assert where[: r.promoting_blocks] == [0] * r.promoting_blocks
            assert s.contains("ab" * 16)  # nothing evicted for the promotion
            if host_blocks == 64:
                fast = LoadPlanner(
                    list(s.pipeline),
                    g.bytes_per_token,
                    g.num_layers,
                    rates={"host": 50.0, "file": 1e-9},
                    default_tokens_per_s=10.0,
                )
                pc2 = PrefixCache(
                    model, s, model_name="tiny-llama-test", block_size=BS, planner=fast
                )
                r2 = pc2.prefill(a, save=False)
                assert r2.plan.kind == "load_prefix" and r2.cached_tokens == 112
                assert set(r2.plan.bytes_by_tier) == {"host"}
                assert_matches_full(model, a, r2.logits)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(shm_path + "-b"):
            os.unlink(shm_path + "-b")


def test_cache_helpers_round_trip(model):
    ids = tokens(40, 13)[None]
    logits, past = forward_chunked(model, ids, None, chunk_tokens=7)  # 6 forwards
    assert_matches_full(model, ids, logits)
    pairs = kv_from_past(past)
    g = kv_geometry(model)
    assert len(pairs) == g.num_layers and pairs[0][0].shape == (1, g.num_kv_heads, 40, g.head_dim)
    cut = past_from_kv(model, [(k[..., :30, :], v[..., :30, :]) for k, v in pairs])
    assert cut.get_seq_length() == 30
    logits2, _ = forward_chunked(model, ids[:, 30:], cut)
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_clear_error(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    with pytest.raises(ValueError, match="input_ids"):
        pc.prefill(torch.zeros((1, 2, 3), dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        pc.prefill(torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        pc.prefill(torch.zeros(20))
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(model, kv_store, model_name="m", block_size=0)
    with pytest.raises(ValueError, match="hit_ratio"):
        PrefixCache(model, kv_store, model_name="m", hit_ratio=1.5)
    with pytest.raises(ValueError, match="model_name"):
        PrefixCache(model, kv_store)  # a model built from a config has no name
    plan = pc.lookup(tokens(40, 14))
    with pytest.raises(ValueError, match="plan"):
        pc.prefill(tokens(41, 14), plan=plan)
    with pytest.raises(ValueError, match="ids are not the block ids"):
        pc.save(tokens(40, 14), None, ids=pc.block_ids(tokens(40, 15)))


def test_a_plan_of_other_tokens_is_refused_and_stores_nothing(model, kv_store):
    """A plan made for another prompt of the same length, for the same rows
    in another order, or by a cache of another namespace, would load that
    prompt's blocks as this one's prefix and save this one's under its ids:
    refused, before anything is loaded or stored."""
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    x, y = tokens(100, 31), tokens(100, 32)
    pc.prefill(x)  # x's blocks stored
    for plan, ids in (
        (pc.lookup(x), y),
        (pc.lookup(torch.stack([x, y])), torch.stack([y, x])),
        (
            PrefixCache(model, kv_store, model_name="tiny-llama-other", block_size=BS).lookup(x),
            x,
        ),
    ):
        with pytest.raises(ValueError, match="plan was made for other input_ids"):
            pc.prefill(ids, plan=plan)
    assert not any(kv_store.contains(b) for b in pc.block_ids(y)[0])
    r = pc.prefill(x)  # x's blocks as they were
    assert r.cached_tokens == 96
    assert_matches_full(model, x, r.logits)


def test_layers_without_a_full_per_token_cache_are_refused():
    from transformers import LlamaForCausalLM

    for extra in (
        {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
        {"layer_types": ["sliding_attention"] * 3},
        {"attention_chunk_size": 64},
    ):
        cfg = tiny_llama_config()
        for k, v in extra.items():
            setattr(cfg, k, v)
        with pytest.raises(NotImplementedError, match="full attention only"):
            kv_geometry(LlamaForCausalLM(cfg))


def test_hit_ratio_zero_loads_nothing_even_with_a_planner(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(64, 41)
    pc.prefill(a)
    zero = PrefixCache(
        model, kv_store, model_name="tiny-llama-test", block_size=BS, hit_ratio=0.0, planner=True
    )
    r = zero.prefill(a, save=False)
    assert r.cached_tokens == 0
    assert_matches_full(model, a, r.logits)


def test_a_block_rows_share_is_stored_and_counted_once(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(64, 51)
    r = pc.prefill(torch.stack([a, a]))
    assert r.saved_blocks == 64 // BS
    with pytest.raises(ValueError, match="cache"):
        pc.save(tokens(40, 14), [(torch.zeros(1, 3, 40, 32), torch.zeros(1, 3, 40, 32))] * 3)


# (layer, 0 for K or 1 for V, damage): None for every layer.
PAST_DAMAGE = {
    "V of layer 0 with one head": (0, 1, lambda t: t[:, :1]),
    "K of layer 1 with one head": (1, 0, lambda t: t[:, :1]),
    "V of layer 2 of head_dim 1": (2, 1, lambda t: t[..., :1]),
    "V of layer 1 with one token": (1, 1, lambda t: t[:, :, :1]),
    "V of every layer in float64": (None, 1, lambda t: t.double()),
}


@pytest.mark.parametrize("damage", list(PAST_DAMAGE))
def test_a_past_whose_layers_differ_from_layer_0_is_refused(model, kv_store, damage):
    """Every layer's K and V is checked, not only layer 0's K. Before, a
    dimension of 1 elsewhere was broadcast by the copy into the save buffer:
    wrong KV stored as the prompt's blocks, and loaded by the next prefill."""
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
    a = tokens(64, 61)
    with torch.no_grad():
        past = model(a[None], use_cache=True).past_key_values
    pairs = [(k.clone(), v.clone()) for k, v in kv_from_past(past)]
    which, kv, change = PAST_DAMAGE[damage]
    bad = [list(p) for p in pairs]
    for layer, p in enumerate(bad):
        if which is None or layer == which:
            p[kv] = change(p[kv])
    with pytest.raises(ValueError, match="cache [KV] of layer"):
        pc.save(a, [tuple(p) for p in bad])
    assert pc.lookup(a).present_blocks == [0]
    assert pc.save(a, pairs)[0] == 64 // BS  # the intact past is stored


GPU = bool(cascade.HAVE_CUDA) and cascade.gpu_usable(0) and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no usable CUDA GPU (or a build without CUDA)")
@pytest.mark.parametrize("pipeline", ["host", "gpu|host"])
def test_gpu_model_loads_and_saves_through_the_device_path(model, shm_path, pipeline):
    cfg = cascade.CascadeConfig()
    cfg.pipeline, cfg.shm_path, cfg.shm_capacity_bytes = pipeline, shm_path, 64 << 20
    cfg.use_gpu, cfg.gpu_capacity_bytes, cfg.num_io_threads = "gpu" in pipeline, 64 << 20, 2
    dev = torch.device("cuda", 0)
    with cascade.CascadeStore(cfg) as s:
        # float32: the cached output equals full compute.
        m32 = copy.deepcopy(model).to(dev)
        pc = PrefixCache(m32, s, model_name="tiny-llama-test-gpu", block_size=BS)
        a = tokens(100, 20).to(dev)
        assert pc.prefill(a).saved_blocks == 6
        b = torch.cat([a[:85], tokens(30, 21).to(dev)])
        r = pc.prefill(b)
        assert (r.cached_tokens, r.loaded_blocks) == (80, 5) and not r.load_errors
        assert r.logits.device == dev
        assert_matches_full(m32, b, r.logits)
        assert greedy_from_cache(m32, r.logits, r.past_key_values, 4) == greedy_from_scratch(
            m32, b, 4
        )
        # bfloat16: the loaded KV gives bit-identical logits to the KV that never left the device.
        m16 = copy.deepcopy(model).to(dev, torch.bfloat16)
        pc16 = PrefixCache(m16, s, model_name="tiny-llama-test-gpu", block_size=BS)
        full, past = forward_chunked(m16, a[None], None)
        pc16.save(a[None], past)
        cut = past_from_kv(m16, [(k[..., :96, :], v[..., :96, :]) for k, v in kv_from_past(past)])
        resident, _ = forward_chunked(m16, a[None, 96:], cut)
        r = pc16.prefill(a, save=False)
        assert r.cached_tokens == 96 and not r.load_errors
        assert torch.equal(r.logits, resident)
        torch.testing.assert_close(r.logits.float(), full.float(), atol=0.05, rtol=0.05)


def test_two_caches_on_one_node_pool_share_prefixes(model, tmp_path):
    """Two PrefixCaches on two client stores of one pool server, as two
    processes of a node would have: the second loads what the first saved,
    with the output of full compute."""
    from cascade import _core

    cfg = _core.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = 64 << 20
    cfg.shm_path = f"/dev/shm/cascade-test-tf-pool-{os.getpid()}"
    sock = str(tmp_path / "pool.sock")
    server = _core.PoolServer(cfg, sock)
    try:

        def client():
            return cascade.CascadeStore(
                cascade.config_from_dict(
                    {"pool_socket": sock, "pool_namespace": "tf", "use_gpu": False}
                )
            )

        with client() as s1, client() as s2:
            a = tokens(100, 11)
            r1 = PrefixCache(model, s1, model_name="tiny-llama-test", block_size=BS).prefill(a)
            assert r1.saved_blocks == 100 // BS
            b = torch.cat([a[:90], tokens(20, 12)])
            r2 = PrefixCache(model, s2, model_name="tiny-llama-test", block_size=BS).prefill(b)
            assert (r2.cached_tokens, r2.loaded_blocks) == (80, 5)
            assert not r2.load_errors
            assert_matches_full(model, b, r2.logits)
            assert greedy_from_cache(
                model, r2.logits, r2.past_key_values, 4
            ) == greedy_from_scratch(model, b, 4)
    finally:
        server.close()


def test_a_cache_on_another_node_loads_what_this_one_saved(model):
    """Two PrefixCaches on two node servers of one cluster: the second loads
    the prefix the first saved (fetched from its owner), with the output of
    full compute."""
    from cascade import _core

    if not _core.HAVE_UCX:
        pytest.skip("built without a transport (UCX)")
    from cluster_helpers import in_process_cluster

    def client(sock):
        return cascade.CascadeStore(
            cascade.config_from_dict(
                {"pool_socket": sock, "pool_namespace": "tf", "use_gpu": False}
            )
        )

    with in_process_cluster(3) as (socks, servers):
        a = tokens(160, 21)
        with client(socks[0]) as s1:
            r1 = PrefixCache(model, s1, model_name="tiny-llama-test", block_size=BS).prefill(a)
            assert r1.saved_blocks == 160 // BS
        assert servers[0].cluster_drain(5000)
        b = torch.cat([a[:150], tokens(20, 22)])
        with client(socks[2]) as s2:
            r2 = PrefixCache(model, s2, model_name="tiny-llama-test", block_size=BS).prefill(b)
            assert (r2.cached_tokens, r2.loaded_blocks) == (144, 144 // BS)
            assert not r2.load_errors
            assert_matches_full(model, b, r2.logits)
        assert servers[2].cluster_stats()["fetched"] > 0


@pytest.mark.parametrize(
    "rates, tokens_per_s, kind",
    [
        ({"host": 50.0}, 1e9, "compute"),  # compute looks free: nothing is loaded
        ({"host": 50.0}, 10.0, "load_prefix"),  # compute looks slow: the whole prefix
        ({"host": 0.0015}, 1000.0, "front_back"),  # as slow as compute: both at once
    ],
)
def test_planned_prefill_follows_the_plan_and_matches_full_compute(
    model, kv_store, rates, tokens_per_s, kind
):
    from cascade.planner import LoadPlanner

    g = kv_geometry(model)
    a = tokens(200, 21)
    assert (
        PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS)
        .prefill(a)
        .saved_blocks
        == 12
    )
    planner = LoadPlanner(
        list(kv_store.pipeline),
        g.bytes_per_token,
        g.num_layers,
        rates=rates,
        default_tokens_per_s=tokens_per_s,
    )
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS, planner=planner)
    r = pc.prefill(a, save=False)
    assert r.plan.kind == kind
    assert_matches_full(model, a, r.logits)
    assert r.cached_tokens == r.plan.loaded_tokens and not r.load_errors
    assert r.cached_tokens + r.computed_tokens == 200
    assert kv_from_past(r.past_key_values)[0][0].shape[2] == 200
    if kind == "front_back":
        assert 0 < r.plan.front_tokens and r.plan.load_end == 12
    assert "predicted" in r.why and "measured" in r.why
    assert len(planner.trace) == 1
    # The prefix cache's next generation step works from the returned cache.
    want = greedy_from_scratch(model, a, 3)
    assert greedy_from_cache(model, r.logits, r.past_key_values, 3) == want


def test_planned_prefill_recomputes_a_block_that_fails_to_load(model, kv_store):
    from cascade.planner import LoadPlanner

    g = kv_geometry(model)
    a = tokens(100, 22)
    PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS).prefill(a)
    planner = LoadPlanner(
        list(kv_store.pipeline), g.bytes_per_token, g.num_layers, default_tokens_per_s=10.0
    )
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS, planner=planner)
    ids = pc.block_ids(a)[0]
    # Block 3 is replaced by one of the wrong size after the plan sees it.
    orig = planner.plan

    def plan_then_damage(*args):
        p = orig(*args)
        kv_store.remove(ids[3])
        kv_store.put(ids[3], b"x" * 10)
        return p

    planner.plan = plan_then_damage
    r = pc.prefill(a, save=False)
    assert r.plan.kind == "load_prefix" and r.plan.load_end == 6
    assert r.cached_tokens == 3 * BS and r.load_errors
    assert_matches_full(model, a, r.logits)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no usable CUDA GPU (or a build without CUDA)")
@pytest.mark.parametrize("damage", [False, True])
def test_layer_overlapped_prefill_on_a_gpu_matches_full_compute(model, shm_path, damage):
    """The layer-ordered load (the forward pass waits on the GPU for each
    layer's copies) gives full compute's output; a block damaged after the
    plan is recomputed from there."""
    from cascade.planner import LoadPlanner

    cfg = cascade.CascadeConfig()
    cfg.pipeline, cfg.shm_path, cfg.shm_capacity_bytes = "host", shm_path, 64 << 20
    cfg.use_gpu, cfg.num_io_threads = False, 2
    dev = torch.device("cuda", 0)
    with cascade.CascadeStore(cfg) as s:
        m32 = copy.deepcopy(model).to(dev)
        g = kv_geometry(m32)
        a = tokens(200, 24).to(dev)
        assert (
            PrefixCache(m32, s, model_name="tiny-gpu-layered", block_size=BS)
            .prefill(a)
            .saved_blocks
            == 12
        )
        planner = LoadPlanner(
            list(s.pipeline),
            g.bytes_per_token,
            g.num_layers,
            rates={"host": 50.0},
            default_tokens_per_s=10.0,
            layer_overlap=True,
        )
        pc = PrefixCache(m32, s, model_name="tiny-gpu-layered", block_size=BS, planner=planner)
        if damage:
            ids = pc.block_ids(a)[0]
            orig = planner.plan

            def plan_then_damage(*args):
                p = orig(*args)
                s.remove(ids[4])
                s.put(ids[4], b"x" * 10)
                return p

            planner.plan = plan_then_damage
        r = pc.prefill(a, save=False)
        assert r.plan.kind == "load_prefix" and r.plan.layer_overlap
        if damage:
            assert r.cached_tokens == 4 * BS and r.load_errors
        else:
            assert r.cached_tokens == 12 * BS and not r.load_errors
        assert_matches_full(m32, a, r.logits)
        assert greedy_from_cache(m32, r.logits, r.past_key_values, 3) == greedy_from_scratch(
            m32, a, 3
        )
        assert s.get_stats()["tiers"]["host"]["leased_blocks"] == 0


def test_planner_true_makes_one_from_the_store(model, kv_store):
    pc = PrefixCache(model, kv_store, model_name="tiny-llama-test", block_size=BS, planner=True)
    assert pc.planner.tiers == list(kv_store.pipeline)
    r = pc.prefill(tokens(64, 23))
    assert r.plan.kind == "compute" and r.saved_blocks == 4
    with pytest.raises(ValueError, match="needs a store"):
        PrefixCache(model, None, model_name="x", block_size=BS, planner=True)
