"""The engine-independent half of the vLLM connector (no vLLM here): block ids
per rank and salt, lookups over every rank's real store, load and save plans,
lite mode, hit_ratio, persist_token_threshold, load errors, and byte-exact
save/load through real CascadeStores with CPU tensors in the packed_kv and
split_kv layouts. tests/vllm/ drives the same code through vLLM's own
scheduler; tests/test_connector_config.py covers the options and
tests/test_connector_metrics.py the counters and traces."""

import itertools
import multiprocessing
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from cascade.integrations import connector_lookup as lk  # noqa: E402
from cascade.integrations.connector_config import (  # noqa: E402
    ConnectorConfig,
)
from cascade.integrations.connector_core import (  # noqa: E402
    ConnectorMetrics,
    KvTransferWorker,
    LiteCache,
    ScheduledRequest,
    SchedulerPlanner,
    StepPlan,
    TransferJob,
    split_layout,
)
from cascade.integrations.ids import prefix_block_ids  # noqa: E402
from connector_helpers import (  # noqa: E402
    BS,
    CUDA,
    NB,
    PROMPT,
    engine_key,
    gpu_test_store,
    make_layers,
    namespace,
    open_store,
    page,
    planner_for,
    schedule_prefill,
)

# ---------------------------------------------------------------------------
# Ids and lookups


def test_ids_differ_per_rank_salt_tenant_and_are_deterministic(ranks):
    key, _ = ranks(world=1)
    p = planner_for(key, world=2)
    t = p.track("a", PROMPT)
    ids = p.ids_of(t)
    assert len(ids) == 2 and len(ids[0]) == 5 and len(set(ids[0]) & set(ids[1])) == 0
    assert ids[0] == prefix_block_ids(PROMPT[: 5 * BS], namespace(2))
    assert ids[1] == prefix_block_ids(PROMPT[: 5 * BS], namespace(2).for_rank(1))
    salted = p.ids_of(p.track("b", PROMPT, salt="s1"))
    assert not set(salted[0]) & set(ids[0])
    assert p.ids_of(p.track("c", PROMPT, salt="s1")) == salted  # same salt, same ids
    tenant = planner_for(key, world=2, config=ConnectorConfig(tenant="acme"))
    assert not set(tenant.ids_of(tenant.track("a", PROMPT))[0]) & set(ids[0])
    other_model = SchedulerPlanner(
        ConnectorConfig(), namespace(2, model="other"), lk.PrefixLookup(key, 2)
    )
    assert not set(other_model.ids_of(other_model.track("a", PROMPT))[0]) & set(ids[0])


@pytest.mark.parametrize("layout", ["packed_kv", "split_kv", "blocks_kv"])
def test_save_then_load_byte_exact_over_two_ranks(ranks, layout):
    key, (r0, r1) = ranks(world=2, layout=layout)
    p = planner_for(key, world=2)
    table_a = [3, 9, 4, 11, 7, 20]
    n, plan = schedule_prefill(p, "a", PROMPT, table_a)
    assert n == 0 and not plan.loads
    assert [(j.first_block, j.engine_blocks) for j in plan.saves] == [(0, table_a[:5])]
    for r in (r0, r1):
        r.step(plan)
    assert all(r.worker.wait_all_saves(timeout=10) for r in (r0, r1))
    assert p.request_finished("a") is True  # saves were planned: pages held until reported
    assert r0.worker.finished_saving({"a"}) == {"a"} and r0.worker.finished_saving(set()) == set()

    # A second engine's pages (other request, other blocks) get the same bytes back.
    dst = {r: make_layers(layout) for r in (0, 1)}
    for r, rank in ((0, r0), (1, r1)):
        rank.layers = dst[r]
        rank.worker.register(dst[r], block_size=BS, layout=layout)
    table_b = [1, 2, 5, 6, 8, 10]
    n, plan = schedule_prefill(p, "b", PROMPT, table_b)
    assert n == 5 * BS  # 5 full blocks; the 2-token tail is computed by the engine
    assert [(j.first_block, j.engine_blocks) for j in plan.loads] == [(0, table_b[:5])]
    assert not plan.saves  # every rank holds every block already
    for r in (r0, r1):
        r.step(plan)
        assert r.worker.take_load_errors() == set()
    src = {0: make_layers(layout, 100), 1: make_layers(layout, 101)}
    for r in (0, 1):
        for a, b in zip(table_a[:5], table_b[:5]):
            assert torch.equal(page(src[r], layout, a), page(dst[r], layout, b))
        assert not page(dst[r], layout, table_b[5]).any()  # the tail block was not touched
    assert p.request_finished("b") is False


def test_hit_needs_every_rank(ranks):
    key, (r0, r1) = ranks(world=2)
    p = planner_for(key, world=2)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    for r in (r0, r1):
        r.step(plan)
        r.worker.wait_all_saves()
    ids = p.ids_of(p.track("a", PROMPT))
    assert p.lookup.prefix_length(ids) == 5
    r1.worker.store.remove(ids[1][2])  # rank 1 lost block 2
    assert p.matched_tokens("b", PROMPT, None, 0) == 2 * BS
    r0.worker.store.remove(ids[0][0])
    assert p.matched_tokens("c", PROMPT, None, 0) == 0


def test_never_the_last_token_and_local_hits(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    exact = PROMPT[: 4 * BS]  # 4 full blocks, no tail
    _, plan = schedule_prefill(p, "a", exact, list(range(4)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    assert p.matched_tokens("b", exact, None, 0) == 3 * BS  # the last block holds the last token
    assert p.matched_tokens("c", exact + [1], None, 0) == 4 * BS
    assert p.matched_tokens("d", exact + [1], None, 2 * BS) == 2 * BS  # beyond vLLM's own hit
    assert p.matched_tokens("e", exact + [1], None, 4 * BS) == 0


def test_reset_makes_earlier_blocks_unreachable(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    assert p.matched_tokens("b", PROMPT, None, 0) == 5 * BS
    p.reset()  # new weights: the old KV must never be served
    assert p.matched_tokens("b", PROMPT, None, 0) == 0
    p.after_alloc("b", PROMPT, None, list(range(6, 12)), 0)
    plan = p.build_plan(
        [ScheduledRequest("b", 0, len(PROMPT), block_ids=list(range(6, 12)), replace_blocks=True)]
    )
    assert len(plan.saves) == 1 and plan.saves[0].engine_blocks == list(range(6, 11))
    r0.step(plan)
    r0.worker.wait_all_saves()
    assert p.matched_tokens("c", PROMPT, None, 0) == 5 * BS  # saved again under the new epoch


def test_engines_that_reset_as_often_share_no_ids(ranks):
    """Two engines on one store each reset once, after loading other
    weights: the epoch in their ids is their own, not a count they share."""
    key, _ = ranks()
    a, b = planner_for(key), planner_for(key)
    assert a.ids_of(a.track("x", PROMPT)) == b.ids_of(b.track("x", PROMPT))
    a.reset()
    b.reset()
    assert set(a.ids_of(a.track("x", PROMPT))[0]).isdisjoint(b.ids_of(b.track("x", PROMPT))[0])


def test_ranks_split_over_pipeline_stages_store_under_other_ids_than_tensor_ranks():
    """A world of 2 as tensor x pipeline 2 x 1 and 1 x 2 holds other shares
    of the KV in blocks of one size: their layouts differ, and so does a
    layer partition; a single stage keeps the layout it had."""
    assert split_layout("packed_kv", 1) == "packed_kv"
    assert split_layout("packed_kv", 1, "4,4") == "packed_kv"
    names = {
        split_layout("packed_kv", 1),
        split_layout("packed_kv", 2),
        split_layout("packed_kv", 2, "10,22"),
        split_layout("packed_kv", 2, "16,16"),
        split_layout("packed_kv", 4),
    }
    assert len(names) == 5
    assert split_layout("mla", 2, stages_named=True) == "mla"
    assert split_layout("mla", 2, "10,22", stages_named=True) != "mla"


def test_hit_ratio_caps_the_served_fraction(ranks):
    key, (r0,) = ranks()
    seed = planner_for(key)
    _, plan = schedule_prefill(seed, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    capped = planner_for(key, config=ConnectorConfig(hit_ratio=0.5))
    assert capped.matched_tokens("b", PROMPT, None, 0) == 2 * BS  # 0.5 * 22 = 11 tokens -> 2 blocks
    assert (
        planner_for(key, config=ConnectorConfig(hit_ratio=0.0)).matched_tokens("c", PROMPT, None, 0)
        == 0
    )


def test_persist_threshold_skips_short_prompts(ranks):
    key, (r0,) = ranks()
    p = planner_for(key, config=ConnectorConfig(persist_token_threshold=len(PROMPT) + 1))
    n, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    assert n == 0 and plan.is_empty()
    assert p.request_finished("a") is False
    long_prompt = PROMPT * 2
    _, plan = schedule_prefill(p, "b", long_prompt, list(range(11)))
    assert len(plan.saves) == 1


def test_chunked_prefill_saves_each_completed_block_once(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    table = [5, 6, 7, 8, 9, 10]
    assert p.matched_tokens("a", PROMPT, None, 0) == 0
    p.after_alloc("a", PROMPT, None, table[:2], 0)
    plan = p.build_plan([ScheduledRequest("a", 0, 6, block_ids=table[:2], replace_blocks=True)])
    assert [(j.first_block, j.engine_blocks) for j in plan.saves] == [(0, [5])]
    plan = p.build_plan([ScheduledRequest("a", 6, 10, block_ids=table[2:4])])
    assert [(j.first_block, j.engine_blocks) for j in plan.saves] == [(1, [6, 7, 8])]
    plan = p.build_plan([ScheduledRequest("a", 16, 6, block_ids=table[4:])])
    assert [(j.first_block, j.engine_blocks) for j in plan.saves] == [(4, [9])]
    plan = p.build_plan([ScheduledRequest("a", 22, 1)])  # decode: no new prompt block
    assert not plan.saves
    # Preempted, then resumed with a new block table: nothing saved twice.
    plan = p.build_plan([], preempted={"a"})
    assert plan.flush_req_ids == {"a"}
    plan = p.build_plan(
        [ScheduledRequest("a", 0, 22, block_ids=[1, 2, 3, 4, 11, 12], replace_blocks=True)]
    )
    assert not plan.saves


def test_lite_mode_counts_and_moves_nothing(ranks):
    key, (r0,) = ranks()
    metrics = ConnectorMetrics()
    p = planner_for(
        key, config=ConnectorConfig(use_lite=True), metrics=metrics, lite_capacity_blocks=8
    )
    n, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    assert n == 0 and plan.is_empty()
    assert len(p.lite) == 5 and r0.worker.prefix_length(p.ids_of(p.track("a", PROMPT))[0]) == 0
    n, plan = schedule_prefill(p, "b", PROMPT, list(range(6)))
    assert n == 0 and plan.is_empty()  # vLLM is told nothing: lite mode only counts
    totals = metrics.take()
    assert totals["lookup_tokens"] == 2 * len(PROMPT) and totals["hit_tokens"] == 5 * BS
    assert totals["miss_tokens"] == 2 * len(PROMPT) - 5 * BS
    assert p.request_finished("b") is False
    lru = LiteCache(3)
    lru.add(["a", "b", "c"])
    assert lru.prefix_length([["a"]]) == 1  # touches "a"
    lru.add(["d"])
    assert lru.prefix_length([["b"]]) == 0 and lru.prefix_length([["a", "c", "d"]]) == 3


# ---------------------------------------------------------------------------
# Worker: failures, layer by layer, async saves


def test_block_removed_between_lookup_and_load_is_a_load_error(ranks):
    key, (r0,) = ranks()
    metrics = ConnectorMetrics()
    r0.worker.metrics = metrics
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    n, plan = schedule_prefill(p, "b", PROMPT, [20, 21, 22, 23, 24, 25])
    assert n == 5 * BS
    ids = p.ids_of(p.track("b", PROMPT))[0]
    assert r0.worker.store.remove(ids[3])  # evicted after the scheduler counted it
    before = page(r0.layers, "packed_kv", 23).clone()
    r0.step(plan)
    assert r0.worker.take_load_errors() == {23}
    assert r0.worker.take_load_errors() == set()  # reported once
    assert torch.equal(page(r0.layers, "packed_kv", 23), before)
    assert torch.equal(page(r0.layers, "packed_kv", 22), page(r0.layers, "packed_kv", 2))
    m = metrics.take()
    assert (m["load_blocks"], m["load_errors"]) == (4, 1)
    assert m["load_bytes"] == 4 * r0.worker.kv.stored_block_bytes


def test_a_replacing_save_whose_removes_miss_a_cluster_member_warns_once(
    ranks, monkeypatch, caplog
):
    """A save that replaces what a failed step stored removes the ids first;
    a remove a pool server could not carry to every cluster member raises
    UnavailableError. The save goes on, with one warning for the job."""
    import logging

    import cascade

    key, (r0,) = ranks()
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    assert r0.worker.wait_all_saves(timeout=10)

    def missed(self, block_id):
        raise cascade.UnavailableError("removed from the pool server, but not every member ...")

    monkeypatch.setattr(cascade.CascadeStore, "remove", missed)
    caplog.set_level(logging.WARNING, logger="cascade.integrations.connector")
    plan = p.build_plan([ScheduledRequest("a", 1 * BS, len(PROMPT) - BS)])
    assert [(j.first_block, j.replace) for j in plan.saves] == [(1, True)]
    r0.step(plan)
    assert r0.worker.wait_all_saves(timeout=10)
    warned = [r for r in caplog.records if "could not be removed everywhere" in r.getMessage()]
    assert len(warned) == 1 and "4 of 4 blocks" in warned[0].getMessage()


def test_a_step_whose_load_failed_saves_nothing_of_that_request_and_the_recompute_replaces(ranks):
    """Blocks 0-2 are found, block 1 fails to load, and the step computes
    blocks 3-5 from the pages that failed: they are not saved. When the
    engine computes again from block 1, the blocks are saved then, replacing
    whatever another rank may have stored under their ids."""
    key, (r0,) = ranks()
    metrics = ConnectorMetrics()
    r0.worker.metrics = metrics
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT[: 3 * BS + 1], list(range(4)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    longer = PROMPT[: 3 * BS] + list(range(7000, 7000 + 3 * BS + 1))
    table = list(range(20, 27))
    n = p.matched_tokens("b", longer, None, 0)
    assert n == 3 * BS
    ids = p.ids_of(p.track("b", longer))[0]
    assert r0.worker.store.remove(ids[1])  # evicted between the lookup and the load
    p.after_alloc("b", longer, None, table, n)
    plan = p.build_plan(
        [ScheduledRequest("b", n, len(longer) - n, block_ids=table, replace_blocks=True)]
    )
    assert [j.engine_blocks for j in plan.saves] == [table[3:6]]
    r0.step(plan)
    r0.worker.wait_all_saves()
    assert r0.worker.take_load_errors() == {21}
    assert not any(r0.worker.store.contains(i) for i in ids[3:6]), (
        "blocks computed from a failed load"
    )
    assert metrics.take()["save_dropped_blocks"] == 3
    # Another rank's shard, computed from the same wrong step, stored anyway.
    wrong = torch.zeros_like(page(r0.layers, "packed_kv", 24))
    r0.worker.store.put(ids[4], wrong.view(torch.uint8).numpy())
    # The engine rolls the request back to block 1 and computes it again.
    plan = p.build_plan([ScheduledRequest("b", 1 * BS, len(longer) - BS)])
    assert [(j.first_block, j.replace) for j in plan.saves] == [(1, True)]
    r0.step(plan)
    r0.worker.wait_all_saves()
    for j in range(1, 6):
        got = torch.empty_like(page(r0.layers, "packed_kv", table[j]))
        found, _ = r0.worker.store.get(ids[j], got.view(torch.uint8).numpy())
        assert found and torch.equal(got, page(r0.layers, "packed_kv", table[j])), j
    # A later step of the request plans no replacing save.
    plan = p.build_plan([ScheduledRequest("b", len(longer), 1)])
    assert plan.saves == []


def test_wrong_size_block_is_a_load_error(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    ids = p.ids_of(p.track("a", PROMPT))[0]
    r0.worker.store.put(ids[0], b"\0" * 100)  # same id, other shape: refused, never loaded
    plan = StepPlan(loads=[TransferJob("a", 0, [7], [[ids[0]]])])
    r0.step(plan)
    assert r0.worker.take_load_errors() == {7}


def test_plan_for_another_world_size_is_refused(ranks):
    key, (r0,) = ranks()
    plan = StepPlan(loads=[TransferJob("a", 0, [1], [["0" * 32], ["1" * 32]])])
    with pytest.raises(ValueError, match="ids for 2 ranks"):
        r0.worker.start_load(plan)


def test_layer_by_layer_load(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    src = make_layers("packed_kv", 100)
    dst = make_layers("packed_kv")
    r0.worker.register(dst, block_size=BS, layout="packed_kv")  # a fresh engine over the same store
    r0.worker.config = ConnectorConfig(use_layerwise=True)
    n, plan = schedule_prefill(p, "b", PROMPT, [10, 11, 12, 13, 14, 15])
    assert n == 5 * BS
    r0.worker.start_load(plan)
    for name in dst:
        r0.worker.wait_layer(name)  # this layer is in place once waited for
        assert torch.equal(dst[name][10:15], src[name][0:5])
    assert r0.worker.take_load_errors() == set()
    assert not dst[next(iter(dst))][15].any()


def test_a_layer_by_layer_load_takes_every_layer_of_a_block_from_one_version(ranks, monkeypatch):
    """Another engine of the namespace removes the blocks and stores them
    again with other bytes once layer 0 is in: every block the load reports
    loaded has all its layers from the version it began with. Before, each
    layer was a load of its own, the later layers came from the new version,
    and the blocks were reported loaded."""
    import types

    from cascade.integrations import connector_worker
    from cascade.integrations.kv import PagedKv, save_paged

    key, (r0,) = ranks()
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    ids = p.ids_of(p.track("a", PROMPT))[0][:5]
    old = make_layers("packed_kv", 100)  # what r0 saved
    other = PagedKv.from_layers(make_layers("packed_kv", 200), block_size=BS)
    store = r0.worker.store

    class RestoredAfterLayer0(threading.Event):
        fired = False

        def set(self):
            if not RestoredAfterLayer0.fired:
                RestoredAfterLayer0.fired = True
                for i in ids:
                    assert store.remove(i)
                assert save_paged(store, other, list(range(5)), ids) == [None] * 5
            super().set()

    monkeypatch.setattr(
        connector_worker,
        "threading",
        types.SimpleNamespace(Event=RestoredAfterLayer0, Thread=threading.Thread),
    )
    dst = make_layers("packed_kv")
    r0.worker.register(dst, block_size=BS, layout="packed_kv")
    r0.worker.config = ConnectorConfig(use_layerwise=True)
    n, plan = schedule_prefill(p, "b", PROMPT, [10, 11, 12, 13, 14, 15])
    assert n == 5 * BS
    r0.worker.start_load(plan)
    for name in dst:
        r0.worker.wait_layer(name)
    errors = r0.worker.take_load_errors()
    assert RestoredAfterLayer0.fired
    for b in range(5):
        if 10 + b in errors:
            continue
        whole = [torch.equal(dst[name][10 + b], old[name][b]) for name in dst]
        assert all(whole), f"block {b}: layers of the old version {whole}"


def test_saves_are_async_and_hold_pages_until_done(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    worker = r0.worker
    gate = threading.Event()
    real_save = worker._save_batch

    def slow_save(jobs, stream):
        gate.wait(10)
        real_save(jobs, stream)

    worker._save_batch = slow_save
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    t0 = time.perf_counter()
    r0.step(plan)
    assert time.perf_counter() - t0 < 5  # submit_saves returned with the save still queued
    assert p.request_finished("a") is True
    assert worker.finished_saving({"a"}) == set()  # not done: the engine must keep the pages
    flusher = threading.Thread(target=worker.flush, args=({"a"},))
    flusher.start()
    flusher.join(0.2)
    assert flusher.is_alive()  # a preemption waits for the pending save
    gate.set()
    flusher.join(10)
    assert not flusher.is_alive()
    assert worker.finished_saving(set()) == {"a"}  # reported once its save is done
    assert worker.prefix_length(p.ids_of(p.track("a", PROMPT))[0]) == 5


def test_failed_save_is_counted_and_never_blocks(ranks):
    key, (r0,) = ranks()
    metrics = ConnectorMetrics()
    r0.worker.metrics = metrics
    plan = StepPlan(
        saves=[TransferJob("a", 0, [NB + 5], [["ab" * 16]])]
    )  # engine block out of range
    r0.step(plan)
    assert r0.worker.wait_all_saves(timeout=10)
    assert metrics.take()["save_errors"] == 1
    assert r0.worker.finished_saving({"a"}) == {"a"}


# ---------------------------------------------------------------------------
# Lookups across processes


def _serve_ranks(key, world, ids, ready, stop):
    """A separate process: one store per rank holding `ids`, each served over its socket."""
    services, stores = [], []
    for r in range(world):
        store = open_store(tag=f"-child{r}")
        for i in ids[r]:
            store.put(i, b"kv" * 8)
        stores.append(store)
        services.append(
            lk.LookupService(
                key, r, lambda x, s=store: sum(1 for _ in itertools.takewhile(s.contains, x))
            )
        )
    ready.set()
    stop.wait(60)
    for s in services:
        s.close()
    for s in stores:
        s.close()


def test_lookup_service_across_processes():
    key = engine_key()
    ns = namespace(2)
    ids = [prefix_block_ids(PROMPT[: 5 * BS], ns.for_rank(r)) for r in range(2)]
    held = [ids[0][:4], ids[1][:3]]  # rank 1 holds fewer
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve_ranks, args=(key, 2, held, ready, stop))
    child.start()
    try:
        assert ready.wait(60)
        look = lk.PrefixLookup(key, 2, mode="socket", timeout_ms=5000)
        assert look.prefix_length(ids) == 3
        assert look.prefix_length([ids[0][:2], ids[1][:2]]) == 2
        wrong = lk.PrefixLookup(key + "-other", 2, mode="socket", timeout_ms=500)
        t0 = time.perf_counter()
        assert wrong.prefix_length(ids) == 0  # no such service: a miss, at once
        assert time.perf_counter() - t0 < 2
        look.close()
        wrong.close()
    finally:
        stop.set()
        child.join(30)
    assert child.exitcode == 0
    assert not os.path.exists(lk.service_dir("", key, 0))


def test_lookup_modes_in_one_process(ranks):
    key, (r0,) = ranks()
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    ids = p.ids_of(p.track("a", PROMPT))
    assert lk.PrefixLookup(key, 1, mode="auto").prefix_length(ids) == 5
    assert lk.PrefixLookup(key, 1, mode="off").prefix_length(ids) == 5
    assert lk.PrefixLookup(key + "x", 1, mode="off").prefix_length(ids) == 0
    service = lk.LookupService(key, 0, r0.worker.prefix_length)
    try:
        sock = lk.PrefixLookup(key, 1, mode="socket", timeout_ms=5000)
        assert sock.prefix_length(ids) == 5
        assert oct(os.stat(service.address).st_mode & 0o777) == "0o600"
        sock.close()
    finally:
        service.close()
    with pytest.raises(ValueError, match="ids for 2 ranks"):
        lk.PrefixLookup(key, 1).prefix_length([[], []])


# ---------------------------------------------------------------------------
# CUDA pages (skipped where no GPU is usable)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no usable CUDA GPU (or a build without CUDA)")
@pytest.mark.parametrize("pipeline", ["host", "gpu|host"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_cuda_pages_save_then_load(pipeline, layerwise):
    """The worker's CUDA path: saves on a side stream after the forward's
    work, loads (whole or layer by layer) ordered before the next forward."""
    store = gpu_test_store(pipeline)
    key = engine_key()
    worker = KvTransferWorker(ConnectorConfig(use_layerwise=layerwise), store, rank=0, world=1)
    try:
        src = {k: v.cuda() for k, v in make_layers("packed_kv", 7).items()}
        worker.register(src, block_size=BS, layout="packed_kv")
        lk.register_worker(key, 0, worker.prefix_length)
        p = planner_for(key)
        _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
        worker.flush(plan.flush_req_ids)
        worker.start_load(plan)
        worker.finish_loads()
        worker.submit_saves(plan)
        assert worker.wait_all_saves(timeout=30)

        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        worker.register(dst, block_size=BS, layout="packed_kv")
        n, plan = schedule_prefill(p, "b", PROMPT, [10, 11, 12, 13, 14, 15])
        assert n == 5 * BS
        worker.start_load(plan)
        for name in dst:
            if layerwise:
                worker.wait_layer(name)
        worker.finish_loads()
        torch.cuda.synchronize()
        assert worker.take_load_errors() == set()
        for name in dst:
            assert torch.equal(dst[name][10:15].cpu(), src[name][0:5].cpu()), name
            assert not dst[name][15].any()
    finally:
        lk.unregister_worker(key, 0)
        worker.close()
        store.close()
