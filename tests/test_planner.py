"""cascade.planner: the cost model (rates from loads, the prefill fit) and
the plan it gives: compute, load a prefix, or compute the front while the
back loads; every plan's prediction and its alternatives."""

import threading

import pytest

from cascade.planner import LoadPlanner, PrefillModel

BPT = 128 << 10  # KV bytes per token
BS = 256


def planner(**kw):
    p = LoadPlanner(["host", "file"], BPT, 32, **kw)
    return p


def test_prefill_model_fits_linear_and_quadratic_terms():
    m = PrefillModel(default_tokens_per_s=1000.0)
    assert m.predict(500) == pytest.approx(0.5)  # the default before any step
    c0, c1, c2 = 0.002, 1e-4, 2e-9
    for mm, pp in [(1024, 0), (4096, 0), (16384, 0), (1, 16383), (2048, 8192), (512, 512)]:
        m.observe(mm, pp, c0 + c1 * mm + c2 * mm * (pp + mm / 2))
    for mm, pp in [(8192, 0), (100, 30000), (3000, 3000)]:
        want = c0 + c1 * mm + c2 * mm * (pp + mm / 2)
        assert m.predict(mm, pp) == pytest.approx(want, rel=1e-6)


def test_few_shapes_give_a_rate_per_token_and_bad_samples_are_ignored():
    m = PrefillModel()
    m.observe(1000, 0, 0.5)
    m.observe(1000, 0, float("nan"))
    m.observe(0, 0, 1.0)
    m.observe(10, 0, -1.0)
    assert len(m.obs) == 1
    assert m.predict(2000) == pytest.approx(1.0)


def test_a_shape_seen_before_is_predicted_by_what_it_measured():
    # Steps that no three-term curve fits: the fit misses the shapes it saw,
    # the model does not, and a shape's repeats are averaged.
    m = PrefillModel()
    for mm, pp, t in [(4096, 0, 0.129), (16384, 0, 0.60), (32768, 0, 2.1), (1, 16383, 0.020)]:
        m.observe(mm, pp, t)
    assert m.predict(4096) == pytest.approx(0.129)
    assert m.predict(1, 16383) == pytest.approx(0.020)
    m.observe(4096, 0, 0.131)
    assert m.predict(4096) == pytest.approx(0.130)
    assert m.predict(8192) > 0  # other shapes from the fit
    # The plan uses it: a 4K prompt whose split looked cheaper by the fit is
    # computed when its measured full prefill is the better choice.
    p = planner(rates={"host": 50.0, "file": 1.0}, default_tokens_per_s=1e9)
    for mm, pp, t in [(4096, 0, 0.129), (16384, 0, 0.60), (32768, 0, 2.1), (8192, 0, 0.27)]:
        p.observe_prefill(mm, pp, t)
    plan = p.plan(4096, BS, [1] * 15)
    assert plan.predicted["total"] <= 0.129 + 1e-9
    assert plan.alternatives["compute"] == pytest.approx(0.129)


def test_outcomes_correct_the_next_predictions_of_their_kind():
    # A split from the file tier that keeps taking 60 ms more than predicted
    # (the loader and the forward pass slow each other down) is predicted so,
    # and then loses to computing everything; other kinds and tiers keep
    # their own corrections.
    p = planner(rates={"host": 50.0, "file": 1.0}, default_tokens_per_s=1e9)
    for mm, pp, t in [(8192, 0, 0.256), (4096, 0, 0.125), (16384, 0, 0.60), (1, 8191, 0.02)]:
        p.observe_prefill(mm, pp, t)
    where = [1] * 31
    first = p.plan(8192, BS, where)
    assert first.kind == "front_back" and first.predicted["correction"] == 0.0
    assert first.predicted["learned"] is False  # the model alone: the planner tries it
    base = first.predicted["total"]
    assert base < 0.256 < base + 0.06
    for _ in range(20):
        p.record(first, base + 0.06)
    key = "front_back from file @8192"  # the kind, its slowest tier, the prompt's length
    assert p.correction[key] == pytest.approx(0.06, rel=0.01)
    assert set(p.correction) == {key}
    after = p.plan(8192, BS, where)
    assert after.kind == "compute"
    assert after.alternatives["front_back"] == pytest.approx(base + 0.06, rel=0.01)
    assert p.stats()["correction"][key] == p.correction[key]
    # An outcome of a corrected plan moves the correction by what the model
    # alone missed, and two prompts together count per prompt.
    corrected = p.plan(8192, BS, where)
    assert corrected.predicted["correction"] == 0.0  # compute: nothing learned for it
    assert corrected.predicted["learned"] is False
    # A kind with an outcome at this length is predicted from it.
    assert p.plan(8192, BS, where).predicted["learned"] is False
    tried = p.plan(8192, BS, where)
    p.record(tried, tried.predicted["total"])
    assert p.plan(8192, BS, where).predicted["learned"] is True
    two = p.plan(8192, BS, where, rows=2)
    assert two.alternatives["front_back"] == pytest.approx(2 * base + 2 * 0.06, rel=0.01)
    # The host tier's layered loads keep their own, and a correction never
    # takes a prediction below half the model's.
    layered = planner(layer_overlap=True, rates={"host": 50.0}, default_tokens_per_s=1e3)
    lp = layered.plan(4096, BS, [0] * 15)
    assert lp.layer_overlap
    for _ in range(30):
        layered.record(lp, 0.0001)
    assert set(layered.correction) == {"load_prefix layered from host @4096"}
    again = layered.plan(4096, BS, [0] * 15)
    assert again.predicted["total"] >= 0.5 * lp.predicted["total"] - 1e-12


def test_corrections_are_kept_per_prompt_length_and_a_first_outcome_counts_whole():
    # What a kind of plan missed by at 4K is not what it misses by at 16K
    # (a layered load's fixed costs weigh more in a short prompt): each length
    # keeps its own correction, and a length with none is predicted by the
    # model alone, so each kind of plan is tried there.
    p = planner(
        layer_overlap=True, rates={"host": 50.0}, default_tokens_per_s=30000.0, front_back=False
    )
    short = p.plan(4096, BS, [0] * 16)
    p.record(short, short.predicted["total"] + 0.010)
    key = "load_prefix layered from host"
    assert p.correction == {f"{key} @4096": pytest.approx(0.010)}  # taken whole, not smoothed
    long = p.plan(16384, BS, [0] * 64)
    assert long.layer_overlap and long.predicted["correction"] == 0.0  # nothing at 16K yet
    p.record(long, long.predicted["total"] + 0.002)
    assert p.correction[f"{key} @16384"] == pytest.approx(0.002)
    assert p.plan(16384, BS, [0] * 64).predicted["correction"] == pytest.approx(0.002)
    assert p.plan(4096, BS, [0] * 16).predicted["correction"] == pytest.approx(0.010)
    # Lengths within a factor of about 1.4 share a bucket.
    assert p.plan(5000, BS, [0] * 19).predicted["correction"] == pytest.approx(0.010)


def test_a_layered_load_that_proves_slower_gives_way_to_one_load_before_the_forward():
    # Where the engine carries out either (overlap_optional), a memory-tier
    # load is weighed layer by layer and whole; the layered one is tried
    # first (its model is faster) and, once its outcomes show fixed costs
    # that make it slower, the whole load wins.
    p = planner(
        layer_overlap=True,
        overlap_optional=True,
        rates={"host": 50.0},
        default_tokens_per_s=30000.0,
        front_back=False,
    )
    where = [0] * 16
    first = p.plan(4096, BS, where)
    assert first.kind == "load_prefix" and first.layer_overlap
    whole_model = first.alternatives["load_prefix"]
    p.record(first, first.predicted["total"] + 0.030)  # 30 ms of fixed costs
    second = p.plan(4096, BS, where)
    assert second.kind == "load_prefix" and not second.layer_overlap
    assert second.predicted["correction_key"] == "load_prefix from host"
    assert whole_model <= second.predicted["total"] < first.predicted["total"] + 0.030
    # Without overlap_optional every memory load stays layered (an engine
    # that always loads layer by layer), corrected as such.
    q = planner(
        layer_overlap=True, rates={"host": 50.0}, default_tokens_per_s=30000.0, front_back=False
    )
    a = q.plan(4096, BS, where)
    q.record(a, a.predicted["total"] + 0.030)
    assert q.plan(4096, BS, where).layer_overlap


def test_fast_tier_loads_the_whole_prefix_layer_by_layer():
    p = planner(
        rates={"host": 50.0}, default_tokens_per_s=30000.0, layer_overlap=True, front_back=False
    )
    tokens = 16384
    plan = p.plan(tokens, BS, [0] * (tokens // BS))
    assert plan.kind == "load_prefix"
    # Most of the prefix; the last token is always computed, and a few
    # blocks more may be computed while the loads run.
    assert 0.9 * (tokens // BS) <= plan.load_end <= tokens // BS
    assert plan.layer_overlap
    assert plan.predicted["total"] == pytest.approx(min(plan.alternatives.values()))
    load = plan.loaded_blocks * BS * BPT / 50e9
    assert plan.predicted["load"] == pytest.approx(load)
    assert plan.predicted["total"] < plan.alternatives["compute"]
    assert plan.bytes_by_tier == {"host": plan.loaded_tokens * BPT}
    assert "from host at 50.0 GB/s" in plan.describe(0.05)
    assert "measured 50 ms" in plan.describe(0.05)


def test_without_overlap_a_fast_tier_loads_all_then_computes_the_rest():
    p = planner(rates={"host": 50.0}, default_tokens_per_s=30000.0, front_back=False)
    plan = p.plan(16384, BS, [0] * 64)
    assert plan.kind == "load_prefix" and plan.load_end == 64 and not plan.layer_overlap
    assert plan.loaded_tokens == 16383 and plan.tail_tokens == 1
    assert plan.predicted["total"] == pytest.approx(
        plan.predicted["load"] + plan.predicted["compute"]
    )


def test_a_tier_slower_than_compute_is_not_read_whole():
    # Compute makes KV at 30k tokens/s * 128 KiB = 3.9 GB/s; the disk reads 1.5 GB/s.
    p = planner(rates={"host": 50.0, "file": 1.5}, default_tokens_per_s=30000.0)
    tokens = 16384
    plan = p.plan(tokens, BS, [1] * (tokens // BS))
    full = plan.alternatives["compute"]
    assert plan.kind == "front_back"
    assert plan.predicted["total"] < full / 1.2  # both run at once
    assert plan.predicted["total"] <= min(plan.alternatives.values()) + 1e-12
    # The split balances the two sides within a block.
    front = plan.front_tokens / 30000.0
    assert abs(front - plan.predicted["load"]) < 2 * BS * BPT / 1.5e9
    assert not plan.layer_overlap


def test_without_front_back_a_slow_tier_means_compute():
    p = planner(rates={"file": 1.0}, default_tokens_per_s=30000.0, front_back=False)
    plan = p.plan(8192, BS, [1] * 32)
    assert plan.kind == "compute"
    assert plan.loaded_blocks == 0 and plan.computed_tokens == 8192


def test_only_leading_hits_are_loaded():
    p = planner(rates={"host": 50.0}, default_tokens_per_s=1000.0)
    plan = p.plan(4096, BS, [0, 0, 0, -1, 0, 0])
    assert plan.load_end == 3


def test_rates_follow_measured_loads_and_queued_loads_delay_the_plan():
    p = planner(rates={"host": 50.0}, default_tokens_per_s=10.0)
    p.observe_load("host", 10 << 30, 1.0)  # 10.7 GB/s measured
    assert p.rates["host"].gbps == pytest.approx((10 << 30) / 1e9)
    p.observe_load("host", 20 << 30, 1.0)
    assert (10 << 30) / 1e9 < p.rates["host"].gbps < (20 << 30) / 1e9
    before = p.plan(4096, BS, [0] * 16).predicted["load"]
    with p.loading("host", 8 << 30):
        during = p.plan(4096, BS, [0] * 16).predicted["load"]
    after = p.plan(4096, BS, [0] * 16).predicted["load"]
    assert during > before + 0.5 and after == pytest.approx(before)


def test_record_keeps_a_trace_and_the_prediction_error():
    p = planner(rates={"host": 50.0}, default_tokens_per_s=30000.0, front_back=False)
    plan = p.plan(4096, BS, [0] * 16)
    e = p.record(plan, plan.predicted["total"] * 1.1, load=0.01)
    assert e["kind"] == plan.kind and "predicted" in e["why"]
    s = p.stats()
    assert s["mean_abs_error"] == pytest.approx(0.1 / 1.1)
    assert s["plans"] == {"load_prefix": 1}
    assert s["rates"]["host"]["source"] == "probe"


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError):
        LoadPlanner(["host"], 0, 32)
    with pytest.raises(ValueError):
        planner().plan(0, BS, [])
    with pytest.raises(ValueError):
        planner().set_rate("host", 0)
    with pytest.raises(ValueError):
        PrefillModel(default_tokens_per_s=0)


def test_concurrent_use_is_safe():
    p = planner(rates={"host": 50.0, "file": 1.5})

    def work(k):
        for i in range(200):
            p.observe_load("file", 1 << 20, 0.001 * (1 + k))
            p.observe_prefill(100 + i, i, 0.01)
            p.record(p.plan(2048, BS, [1] * 8), 0.01)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(p.stats()["plans"].values()) == 800


def test_a_tiers_latency_is_paid_once_per_load():
    p = planner(default_tokens_per_s=10.0, front_back=False)
    p.set_rate("host", 50.0, latency_s=0.25)
    p.set_rate("file", 1.0, latency_s=0.5)
    host_only = p.plan(4096, BS, [0] * 16)
    assert host_only.predicted["load"] == pytest.approx(0.25 + 16 * BS * BPT / 50e9)
    mixed = p.plan(4096, BS, [0] * 8 + [1] * 8)
    want = 0.5 + 8 * BS * BPT / 50e9 + 8 * BS * BPT / 1e9
    assert mixed.predicted["load"] == pytest.approx(want)
    q = planner(default_tokens_per_s=1000.0)
    q.set_rate("file", 1.0, latency_s=0.5)
    back = q.plan(8192, BS, [1] * 32)
    assert back.kind == "front_back"
    assert back.predicted["load"] == pytest.approx(0.5 + back.loaded_blocks * BS * BPT / 1e9)


def test_slow_rates_read_in_mb_per_s():
    p = LoadPlanner(["host", "file"], 1024, 4, rates={"file": 0.002}, default_tokens_per_s=10.0)
    plan = p.plan(64 * 16 + 1, 16, [1] * 64)
    assert plan.kind == "load_prefix" and "from file at 2.0 MB/s" in plan.describe()
