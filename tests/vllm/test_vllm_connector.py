"""CascadeConnector under real vLLM (0.33) on CPU: vLLM's config, request,
scheduler, scheduler-output and connector-factory objects, KV tensors in
vLLM's real layouts, the worker hooks called as vLLM's model runner calls
them (tests/vllm/vllm_harness.py). Run by `make test-vllm`, which installs
vLLM into .venv-vllm; skipped where vLLM is not installed."""

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm",
)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm_harness import SAMPLED_TOKEN, Engine, make_vllm_config, write_tiny_llama  # noqa: E402

from cascade.integrations.ids import prefix_block_ids  # noqa: E402
from cascade.integrations.vllm import CascadeConnector, CascadeConnectorStats, CascadePromMetrics  # noqa: E402

BS = 16
PROMPT = list(range(200, 250))  # 3 full blocks and 2 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines(model_dir):
    made = []

    def make(extra=None, num_blocks=64, **kw):
        eng = Engine(
            make_vllm_config(model_dir, {"host_capacity": "64MiB", **(extra or {})}, **kw),
            num_blocks=num_blocks,
        )
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def store_ids(eng, prompt, salt=None, rank=0):
    ns = eng.connector.namespace.with_tenant(eng.connector.config.namespace_tenant(salt)).for_rank(
        rank
    )
    return prefix_block_ids(prompt[: len(prompt) // BS * BS], ns)


def test_vllm_builds_both_halves(engines):
    eng = engines()
    assert (
        isinstance(eng.connector, CascadeConnector)
        and eng.connector.role == KVConnectorRole.SCHEDULER
    )
    assert isinstance(eng.worker, CascadeConnector) and eng.worker.role == KVConnectorRole.WORKER
    assert eng.worker.worker.kv.num_layers == 2 and eng.worker.worker.kv.block_size == BS
    assert eng.connector.namespace.dtype == "bfloat16" and eng.connector.namespace.tp_world == 1


@pytest.mark.parametrize(
    "layout,dtype,layerwise",
    [
        ("LBNHC", "bfloat16", False),
        ("LBHNC", "float32", False),
        ("BLHNC", "bfloat16", False),
        ("LBNHC", "float16", True),
    ],
)
def test_save_then_load_byte_exact(engines, layout, dtype, layerwise):
    eng = engines({"use_layerwise": layerwise}, layout=layout, dtype=dtype)
    a = eng.add("a", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(a, 0) == (0, False)
    eng.run()
    # "a" finished with its saves queued: vLLM kept its pages until the worker reported them.
    assert any("a" in (kv.finished_sending or ()) for _, kv in eng.outputs)
    assert eng.worker.worker.prefix_length(store_ids(eng, PROMPT)) == 3

    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)  # never the last token
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)  # no side effects
    out, kv_out = eng.step()
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens["b"]) == ("b", 3 * BS, 2)
    assert out.has_sync_kv_loads and not kv_out.invalid_block_ids
    # The forward pass wrote only tokens 48 and 49; the three loaded pages hold exactly the KV of
    # "a".
    for i in range(3):
        assert eng.page_is_computed("b", i, PROMPT)
    assert (
        eng.page_is_computed("b", 3, PROMPT + [0] * 14) is False
    )  # partial block: computed, not loaded
    eng.run()
    assert list(b.output_token_ids) == [SAMPLED_TOKEN] * 2
    # The worker's counters reached vLLM through KVConnectorOutput.kv_connector_stats, step by step.
    reported = CascadeConnectorStats(data={})
    for _, kv in eng.outputs:
        reported.aggregate(kv.kv_connector_stats or CascadeConnectorStats(data={}))
    assert reported.data["load_blocks"] == 3 and reported.data["save_blocks"] == 3
    assert reported.data["load_bytes"] == 3 * eng.worker.worker.kv.stored_block_bytes
    for key in ("load_blocks", "load_bytes", "save_blocks", "save_bytes"):
        assert reported.data[key] == eng.worker.metrics.totals[key]


def test_block_lost_between_lookup_and_load_is_recomputed(engines):
    eng = engines()
    eng.add("a", PROMPT)
    eng.run()
    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    ids = store_ids(eng, PROMPT)
    out = eng.scheduler.schedule()  # the scheduler claims the hit...
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS
    assert eng.worker.worker.store.remove(
        ids[1]
    )  # ...and block 1 is evicted before the worker loads it
    table = eng.block_table("b")
    # Run the step the scheduler just planned, as the model runner would.
    _, kv_out = eng.execute(out)
    assert kv_out.invalid_block_ids == {table[1]}
    assert (
        eng.scheduler.requests["b"].num_computed_tokens == BS
    )  # rolled back to the first bad block
    assert not b.output_token_ids  # the step's output for "b" was dropped
    out, kv_out = eng.step()
    assert out.num_scheduled_tokens["b"] == len(PROMPT) - BS and not kv_out.invalid_block_ids
    for i in range(3):
        assert eng.page_is_computed("b", i, PROMPT)
    eng.run()
    assert list(b.output_token_ids) == [SAMPLED_TOKEN] * 2


def test_namespace_separation(engines, model_dir, tmp_path):
    storage = {
        "store_pipeline": "host|file",
        "storage_path": str(tmp_path / "kv"),
        "store": {"write_policy": "write_through"},
    }
    eng = engines({**storage, "model_name": "model-one"})
    eng.add("a", PROMPT)
    eng.run()
    other_salt = eng.add("b", PROMPT, cache_salt="tenant-2")
    assert eng.connector.get_num_new_matched_tokens(other_salt, 0) == (0, False)
    eng.run()
    eng.close()
    # A restart finds the blocks in the file tier; another model name does not.
    other = engines({**storage, "model_name": "model-two"})
    assert other.connector.get_num_new_matched_tokens(other.add("c", PROMPT), 0) == (0, False)
    other.run()
    other.close()
    same = engines({**storage, "model_name": "model-one"})
    d = same.add("d", PROMPT)
    assert same.connector.get_num_new_matched_tokens(d, 0) == (3 * BS, False)
    same.step()
    for i in range(3):
        assert same.page_is_computed("d", i, PROMPT)
    same.run()
    salted = same.add("e", PROMPT, cache_salt="tenant-2")  # saved by "b" before the restart
    assert same.connector.get_num_new_matched_tokens(salted, 0) == (3 * BS, False)
    same.run()


def test_a_model_configured_otherwise_under_one_name_does_not_share_blocks(engines):
    """One model_name, another RoPE base in the model's configuration (an
    override): the K differs, so the ids do, as they do for another KV
    geometry. An fp8 cache whose scales the engine computes keeps its blocks
    to itself."""
    eng = engines({"model_name": "shared-name"})
    model = eng.connector.namespace.model
    assert "|config=" in model and "|kv_heads=" in model and "|head_size=" in model
    eng.add("a", PROMPT)
    eng.run()
    cfg = eng.vc
    cfg.model_config.hf_config.rope_theta = (
        getattr(cfg.model_config.hf_config, "rope_theta", 1e4) * 4
    )
    other = CascadeConnector(cfg, KVConnectorRole.SCHEDULER)
    try:
        assert other.namespace.model != model
        assert other.namespace.digest != eng.connector.namespace.digest
    finally:
        other.shutdown()
    cfg.cache_config.cache_dtype = "fp8"
    cfg.cache_config.calculate_kv_scales = True
    scaled = CascadeConnector(cfg, KVConnectorRole.SCHEDULER)
    try:
        engine = cfg.kv_transfer_config.engine_id
        assert f"|kv_scales=computed:{engine}" in scaled.namespace.model
    finally:
        scaled.shutdown()


def test_prefix_cache_reset_drops_earlier_blocks(engines):
    eng = engines()
    eng.add("a", PROMPT)
    eng.run()
    assert eng.scheduler.reset_prefix_cache(reset_connector=True)  # e.g. after a weight update
    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (0, False)
    eng.run()
    c = eng.add("c", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(c, 0) == (3 * BS, False)  # "b" saved them anew
    eng.run()


def test_lookup_over_the_worker_socket(engines):
    eng = engines({"lookup": "socket", "lookup_timeout_ms": 5000})
    assert eng.worker._service is not None
    eng.add("a", PROMPT)
    eng.run()
    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    eng.step()
    assert eng.page_is_computed("b", 2, PROMPT)
    eng.run()


def test_lite_mode_counts_hits_and_moves_nothing(engines):
    eng = engines({"use_lite": True})
    assert eng.worker.worker is None  # no store, no data path
    spec = eng.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert eng.connector.planner.lite.capacity_blocks == (64 << 20) // (
        spec.page_size_bytes * 2
    )  # host_capacity
    eng.add("a", PROMPT)
    eng.run()
    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (0, False)
    eng.run()
    stats = eng.connector.metrics.totals  # the scheduler's counters (vLLM collects them each step)
    assert stats["lookup_tokens"] == 2 * len(PROMPT) and stats["hit_tokens"] == 3 * BS
    assert not eng.worker.metrics.totals


def test_hit_ratio_and_threshold(engines):
    eng = engines({"hit_ratio": 0.5, "persist_token_threshold": 40})
    eng.add("short", PROMPT[:33])  # below the threshold: neither saved nor looked up
    eng.add("a", PROMPT)
    eng.run()
    assert (
        eng.worker.worker.prefix_length(store_ids(eng, PROMPT[:33])) == 2
    )  # "a" saved the shared blocks
    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (
        BS,
        False,
    )  # 0.5 * 50 tokens -> 1 block
    eng.run()


def test_roles(engines):
    producer = engines(kv_role="kv_producer")
    producer.add("a", PROMPT)
    producer.run()
    assert producer.worker.worker.prefix_length(store_ids(producer, PROMPT)) == 3
    assert producer.connector.get_num_new_matched_tokens(producer.add("b", PROMPT), 0) == (0, False)
    producer.run()


def test_bad_options_fail_at_startup(model_dir):
    with pytest.raises(ValueError, match="unknown Cascade connector option"):
        Engine(make_vllm_config(model_dir, {"storage_backends": "/mnt"}))


def test_stats_and_prometheus(engines):
    prom = pytest.importorskip("prometheus_client")
    a = CascadeConnectorStats(data={"hit_tokens": 16, "lookup_tokens": 64})
    a.aggregate(CascadeConnectorStats(data={"hit_tokens": 16, "tier_hits:host": 2}))
    assert a.reduce()["hit_rate"] == 0.5 and not a.is_empty()
    registry = prom.CollectorRegistry()

    def counter(**kw):
        return prom.Counter(registry=registry, **kw)

    types = {prom.Counter: counter, prom.Gauge: prom.Gauge, prom.Histogram: prom.Histogram}
    eng = engines()
    metrics = CascadeConnector.build_prom_metrics(
        eng.vc, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    assert isinstance(metrics, CascadePromMetrics)
    metrics.observe(a.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:cascade_hit_tokens_total", labels) == 32
    assert (
        registry.get_sample_value("vllm:cascade_tier_hits_total", {**labels, "tier": "host"}) == 2
    )
    assert CascadeConnector.build_kv_connector_stats({"load_blocks": 1}).data == {"load_blocks": 1}
    assert CascadeConnector.requires_piecewise_for_cudagraph({"use_layerwise": True}) is True


def test_preempted_request_flushes_its_saves_and_resumes_from_the_cache(engines):
    eng = engines(
        num_blocks=9
    )  # 8 usable pages: two requests growing to 5 pages each cannot both stay
    a = eng.add("a", PROMPT, max_tokens=24)
    b = eng.add("b", [t + 1000 for t in PROMPT], max_tokens=24)
    eng.run()
    preempted = [
        (out, out.kv_connector_metadata.plan) for out, _ in eng.outputs if out.preempted_req_ids
    ]
    assert preempted, "the pool was meant to force a preemption"
    out, plan = preempted[0]
    assert plan.flush_req_ids == out.preempted_req_ids  # their queued saves finished before reuse
    victim = next(iter(out.preempted_req_ids))
    # The victim came back through the scheduler's lookup and loaded its own saved prompt blocks.
    resumed = [
        o
        for o, _ in eng.outputs
        if victim in o.scheduled_cached_reqs.resumed_req_ids
        or any(r.req_id == victim for r in o.scheduled_new_reqs)
    ]
    assert any(o.kv_connector_metadata.plan.loads for o in resumed)
    assert not any(kv.invalid_block_ids for _, kv in eng.outputs)
    assert len(a.output_token_ids) == 24 and len(b.output_token_ids) == 24


def test_plans_cross_process_boundaries(engines):
    """The multiprocess executor pickles each step's scheduler output to the workers."""
    import pickle

    eng = engines()
    eng.add("a", PROMPT)
    out, _ = eng.step()
    plan = pickle.loads(pickle.dumps(out.kv_connector_metadata)).plan
    assert plan == out.kv_connector_metadata.plan and plan.saves
    eng.run()


def test_tensor_parallel_workers_in_their_own_processes(engines):
    """TP=2 under the multiprocess executor: rank 1 runs in another process with its own store;
    the scheduler asks it over its lookup socket, and a hit needs both ranks."""
    eng = engines({"lookup_timeout_ms": 30000}, tp=2)
    assert eng.connector.namespace.tp_world == 2 and eng.ranks[1].rank == 1
    eng.add("a", PROMPT)
    eng.run()
    ids = [store_ids(eng, PROMPT, rank=r) for r in (0, 1)]
    assert not set(ids[0]) & set(ids[1])  # each rank saves its own shard under its own ids
    assert eng.ranks[0].prefix_length(ids[0]) == 3 and eng.ranks[1].prefix_length(ids[1]) == 3
    assert eng.ranks[1].prefix_length(ids[0]) == 0

    b = eng.add("b", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    eng.step()
    for rank in (0, 1):  # each rank loaded its own bytes
        assert all(eng.page_is_computed("b", i, PROMPT, rank=rank) for i in range(3))
    eng.run()

    assert eng.ranks[1].remove(ids[1][1])  # only rank 1 lost block 1: no hit from there on
    c = eng.add("c", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(c, 0) == (BS, False)
    eng.run()
    assert eng.ranks[1].prefix_length(ids[1]) == 3  # saved again by "c"

    d = eng.add("d", PROMPT)
    assert eng.connector.get_num_new_matched_tokens(d, 0) == (3 * BS, False)
    out = eng.scheduler.schedule()
    assert eng.ranks[1].remove(ids[1][2])  # lost on rank 1 between lookup and load
    table = eng.block_table("d")
    _, kv_out = eng.execute(out)
    assert kv_out.invalid_block_ids == {table[2]}
    assert eng.scheduler.requests["d"].num_computed_tokens == 2 * BS
    eng.run()
    assert len(d.output_token_ids) == 2
