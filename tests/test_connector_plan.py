"""Load or compute in the vLLM connector's scheduler (no vLLM here): the
plan over the tiers the workers' real stores report, refusing a slow tier
and loading a fast one, learning tier rates from the workers' load times and
the prefill time from the engine's steps, the plan and its outcome in the
trace, load_policy "all", and the locate request of the lookup socket (with
a service that predates it)."""

import json
import socket

import pytest

torch = pytest.importorskip("torch")

from cascade.integrations import connector_lookup as lk  # noqa: E402
from cascade.integrations import lookup_wire as wire  # noqa: E402
from cascade.integrations.connector_config import (  # noqa: E402
    ConnectorConfig,
    parse_connector_config,
)
from cascade.integrations.connector_core import (  # noqa: E402
    KvTransferWorker,
    ScheduledRequest,
    SchedulerPlanner,
    TraceRecorder,
)
from connector_helpers import (  # noqa: E402
    BS,
    L,
    engine_key,
    make_layers,
    namespace,
    open_store,
    schedule_prefill,
)

# One rank's KV of one token in the helpers' layout: K and V, H heads of D bf16, L layers.
BYTES_PER_TOKEN = 2 * 2 * 8 * 2 * L
PROMPT = list(range(2000, 2000 + 12 * BS + 3))  # 12 full blocks and 3 tokens


class FileRank:
    """One worker whose blocks sit in the file tier only: saved through a
    store over a directory, then served by a fresh store over it (empty
    host tier)."""

    def __init__(self, key, tmp_path):
        self.key = key
        self.tmp_path = tmp_path
        self.layers = make_layers("packed_kv", seed=7)
        self.worker = self._worker()

    def _worker(self):
        w = KvTransferWorker(ConnectorConfig(), open_store(self.tmp_path), rank=0, world=1)
        w.register(self.layers, block_size=BS, layout="packed_kv")
        lk.register_worker(self.key, 0, w.prefix_length, w.locate)
        return w

    def save(self, plan):
        self.worker.submit_saves(plan)
        self.worker.wait_all_saves()

    def reopen(self):
        lk.unregister_worker(self.key, 0)
        self.worker.close()  # flushes every block to the files
        self.worker = self._worker()

    def close(self):
        lk.unregister_worker(self.key, 0)
        self.worker.close()


@pytest.fixture
def file_rank(tmp_path):
    made = []

    def make():
        r = FileRank(engine_key(), tmp_path / f"files{len(made)}")
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def planned(key, trace=None, **options):
    config = ConnectorConfig(store_pipeline="host|file", storage_path="/unused", **options)
    return SchedulerPlanner(
        config,
        namespace(1),
        lk.PrefixLookup(key, 1, mode="off"),
        traces=trace,
        kv_bytes_per_token=BYTES_PER_TOKEN,
        num_layers=L,
        chunk_tokens=16 * BS,
    )


def saved_in_files(rank, key):
    first = planned(key, load_policy="all")
    _, plan = schedule_prefill(first, "seed", PROMPT, list(range(13)))
    rank.save(plan)
    rank.reopen()
    ids = first.ids_of(first.track("seed", PROMPT))
    assert lk.PrefixLookup(key, 1, mode="off").locate(ids) == [1] * 12  # all in "file"


def trace_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_slow_tier_is_computed_fast_tier_loaded(file_rank, tmp_path):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    path = str(tmp_path / "trace.jsonl")
    # 1 KB/s from the files, 1000 tokens/s of prefill: 51 tokens of 96 B
    # take 5 s to read and 51 ms to compute.
    slow = planned(
        rank.key,
        TraceRecorder(path, "scheduler"),
        tier_rates={"file": 1e-6},
        prefill_tokens_per_s=1000.0,
    )
    n, plan = schedule_prefill(slow, "a", PROMPT, list(range(13)))
    assert n == 0 and not plan.loads
    assert slow.metrics.totals["plan_skipped_tokens"] == 12 * BS
    # Blocks every rank holds are not saved again.
    assert not plan.saves
    lines = [x for x in trace_lines(path) if x["op"] == "plan"]
    assert lines[-1]["kind"] == "compute" and lines[-1]["loaded_tokens"] == 0
    assert lines[-1]["hit_tokens"] == 12 * BS
    assert "computed; predicted" in lines[-1]["why"]
    assert lines[-1]["alternatives_ms"]["load_prefix"] > lines[-1]["alternatives_ms"]["compute"]
    # The same blocks, a tier as fast as memory and a slow prefill: all loaded.
    fast = planned(rank.key, tier_rates={"file": 50.0}, prefill_tokens_per_s=10.0)
    n, plan = schedule_prefill(fast, "b", PROMPT, list(range(13)))
    assert n == 12 * BS and plan.loads[0].engine_blocks == list(range(12))
    assert fast.metrics.totals["plan_skipped_tokens"] == 0
    # load_policy "all": every hit, whatever the rates.
    every = planned(rank.key, load_policy="all", tier_rates={"file": 1e-6})
    assert every.load_planner is None
    assert schedule_prefill(every, "c", PROMPT, list(range(13)))[0] == 12 * BS


def test_local_hit_is_neither_loaded_nor_planned_as_a_cost(file_rank):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    p = planned(rank.key, tier_rates={"file": 50.0}, prefill_tokens_per_s=10.0)
    n = p.matched_tokens("a", PROMPT, None, 4 * BS)
    assert n == 8 * BS  # blocks 4..11, after vLLM's own 4
    t = p.track("a", PROMPT)
    assert t.plan.held_tokens == 4 * BS and t.plan.load_first == 4 and t.plan.load_end == 12
    assert t.plan.loaded_tokens == 8 * BS


def test_rates_and_prefill_learned_from_the_engine(file_rank, tmp_path):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    path = str(tmp_path / "trace.jsonl")
    # Starts believing the files fast and the prefill slow: it loads.
    p = planned(
        rank.key,
        TraceRecorder(path, "scheduler"),
        tier_rates={"file": 50.0},
        prefill_tokens_per_s=10.0,
    )
    n, _plan = schedule_prefill(p, "a", PROMPT, list(range(13)))
    assert n == 12 * BS
    blocks_bytes = 12 * BS * BYTES_PER_TOKEN
    # The workers report the step's load: 2 s for its bytes (tiny, below the
    # size rates are learned from: ignored).
    p.step_output({"load_seconds": 2.0, "load_bytes": blocks_bytes})
    p.step_done(now=p.clock._steps[0].built + 2.5)
    assert p.load_planner.rates["file"].samples == 0
    lines = [x for x in trace_lines(path) if x["op"] == "plan_outcome"]
    # The engine's first step (one-time costs) teaches neither the prefill
    # model nor the corrections; its outcome is traced.
    assert len(lines) == 1 and lines[0]["request_id"] == "a" and lines[0]["alone"] is False
    assert not p.load_planner.prefill.obs and p.load_planner.correction == {}
    assert lines[0]["measured_ms"] == pytest.approx(2500, rel=1e-6)
    assert "measured 2500 ms" in lines[0]["why"]
    # A step of one request computing 64 tokens after 0 in 50 ms: the prefill model learns.
    p.build_plan([ScheduledRequest("x", 0, 16 * BS, block_ids=[], prompt=list(range(64)))])
    # It starts when the step before it ended (2.5 s after that one's build).
    p.step_done(now=max(p.clock._steps[0].built, p.clock._last_end) + 0.05)
    assert p.load_planner.prefill.predict(16 * BS, 0) == pytest.approx(0.05)
    # A large load reported slow teaches the file tier's rate.
    p.MIN_RATE_BYTES = 1
    p.build_plan([])
    p.clock._steps[-1].load_bytes["file"] = 1_000_000
    p.step_output({"load_seconds": 1.0, "load_bytes": 1_000_000})
    p.step_done()
    assert p.load_planner.rates["file"].gbps == pytest.approx(0.001)
    assert p.load_planner.rates["file"].source == "measured"


def test_outcome_of_a_request_that_shared_its_steps_teaches_no_correction(file_rank):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    p = planned(rank.key, tier_rates={"file": 50.0}, prefill_tokens_per_s=10.0)
    n = p.matched_tokens("a", PROMPT, None, 0)
    p.after_alloc("a", PROMPT, None, list(range(13)), n)
    p.build_plan(
        [
            ScheduledRequest("a", n, len(PROMPT) - n, block_ids=list(range(13))),
            ScheduledRequest("other", 0, 8, block_ids=[20, 21], prompt=list(range(8))),
        ]
    )
    p.step_done()
    assert p.load_planner.trace[-1]["kind"] == "load_prefix"
    assert p.load_planner.correction == {}


def test_file_read_cap_is_the_first_rate_of_the_file_tier():
    cfg = parse_connector_config(
        {
            "store_pipeline": "host|file",
            "storage_path": "/unused",
            "store": {"file_read_bytes_per_s": "2MB"},
        }
    )
    p = SchedulerPlanner(
        cfg,
        namespace(1),
        lk.PrefixLookup("none", 1, mode="off"),
        kv_bytes_per_token=BYTES_PER_TOKEN,
        num_layers=L,
    )
    assert p.load_planner.rates["file"].gbps == pytest.approx(0.002)
    assert p.load_planner.tiers == ["host", "file"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"load_policy": "some"}, "load_policy"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s"),
        ({"tier_rates": {"tape": 1.0}}, "unknown tier 'tape'"),
        ({"tier_rates": {"host": -1}}, "GB/s > 0"),
        ({"tier_rates": {"file": 1.0}}, "not in the workers' pipeline"),
        ({"tier_rates": [1.0]}, "mapping"),
    ],
)
def test_plan_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        parse_connector_config(options)


def test_plan_option_defaults():
    cfg = parse_connector_config({"tier_rates": {"shm": 30}})
    assert cfg.load_policy == "auto" and cfg.prefill_tokens_per_s == 8000.0
    assert cfg.tier_rates == {"host": 30.0}


# ---------------------------------------------------------------------------
# The locate request of the lookup socket


def _tiers_fn(ids):
    return [i % 3 for i in range(len(ids) - 1)] + [-1]


def test_locate_over_the_socket(tmp_path):
    key = engine_key()
    ids = [f"{i:032x}" for i in range(6)]
    svc = lk.LookupService(
        key, 0, lambda q: len(q) - 1, locate_fn=_tiers_fn, socket_dir=str(tmp_path)
    )
    try:
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=str(tmp_path))
        assert look.locate([ids]) == [0, 1, 2, 0, 1]
        assert look.prefix_length([ids]) == 5  # both kinds on one connection
        look.close()
    finally:
        svc.close()


def test_locate_takes_the_slowest_tier_over_ranks():
    key = engine_key()
    ids = [f"{i:032x}" for i in range(4)]
    lk.register_worker(key, 0, lambda q: 4, lambda q: [0, 0, 1, 0])
    lk.register_worker(key, 1, lambda q: 3, lambda q: [1, 0, 0, -1])
    try:
        assert lk.PrefixLookup(key, 2, mode="off").locate([ids, ids]) == [1, 0, 1]
    finally:
        lk.unregister_worker(key, 0)
        lk.unregister_worker(key, 1)


def test_service_without_locate_is_asked_prefixes(tmp_path, monkeypatch):
    real = wire.recv_query

    def predates_locate(sock, timeout_s):
        got = real(sock, timeout_s)
        if got is not None and got[0] != wire.PREFIX:
            raise wire.BadMessage(f"unexpected request kind {got[0]}")
        return got

    monkeypatch.setattr(wire, "recv_query", predates_locate)
    key = engine_key()
    ids = [f"{i:032x}" for i in range(6)]
    svc = lk.LookupService(key, 0, lambda q: 4, socket_dir=str(tmp_path))
    try:
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=str(tmp_path))
        assert look.locate([ids]) == []  # the first try is refused: a miss
        assert look.locate([ids]) == [0, 0, 0, 0]  # then prefixes, as the top tier's
        look.close()
    finally:
        svc.close()


def test_locate_answers_are_checked():
    with pytest.raises(ValueError):
        wire.send_tiers(None, [0, 255], wire.Deadline(1.0))
    a, b = socket.socketpair()
    try:
        wire._send(a, wire.ST_TIERS, 3, bytes([0, 1, 2]), wire.Deadline(1.0))
        status, n = wire.recv_answer(b, wire.Deadline(1.0))
        assert status == wire.ST_TIERS
        with pytest.raises(wire.WireError, match="to a locate of 2"):
            wire.recv_tiers(b, n, 2, wire.Deadline(1.0))
    finally:
        a.close()
        b.close()


def test_a_tier_outside_the_planners_pipeline_ends_the_hits(caplog):
    # A worker whose pipeline is longer than the scheduler's names tier 2 of
    # a host|file planner: those blocks are misses, not a crash.
    key = engine_key()
    lk.register_worker(key, 0, lambda ids: len(ids), lambda ids: [0, 0, 1, 2] + [0] * 8)
    try:
        p = planned(key, tier_rates={"file": 50.0}, prefill_tokens_per_s=10.0)
        with caplog.at_level("WARNING", logger="cascade.integrations.connector"):
            p.matched_tokens("a", PROMPT, None, 0)
            p.matched_tokens("b", PROMPT, None, 0)
        assert p.track("a", PROMPT).lookup_present == 3
        assert sum("outside this scheduler's pipeline" in r.message for r in caplog.records) == 1
    finally:
        lk.unregister_worker(key, 0)


def test_hits_in_memory_tiers_are_loaded_without_a_plan(ranks):
    key, (r0,) = ranks()
    p = SchedulerPlanner(
        ConnectorConfig(tier_rates={"host": 1e-9}),  # a model that would refuse them
        namespace(1),
        lk.PrefixLookup(key, 1, mode="off"),
        kv_bytes_per_token=BYTES_PER_TOKEN,
        num_layers=L,
    )
    assert p.load_planner is not None
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(13)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    n, plan = schedule_prefill(p, "b", PROMPT, list(range(13)))
    assert n == 12 * BS and p.track("b", PROMPT).plan is None


def test_outcome_of_a_request_finished_in_its_last_step(file_rank):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    p = planned(rank.key, tier_rates={"file": 50.0}, prefill_tokens_per_s=10.0)
    schedule_prefill(p, "a", PROMPT, list(range(13)))
    # vLLM frees a request that ends in this step before the step's end is seen.
    assert p.request_finished("a") is False
    p.step_done()
    assert p.load_planner.trace[-1]["kind"] == "load_prefix"
    assert not p._finishing


def test_a_load_barely_faster_than_computing_is_not_planned(file_rank):
    rank = file_rank()
    saved_in_files(rank, rank.key)
    # 12 blocks of 768 B from files at 0.53 MB/s, then 3 tokens computed: 18.5 ms;
    # computing all 51 tokens at 2,600 tokens/s: 19.6 ms. Loading is 6% faster:
    # within the margin.
    p = planned(rank.key, tier_rates={"file": 0.00053}, prefill_tokens_per_s=2600.0)
    n = p.matched_tokens("a", PROMPT, None, 0)
    t = p.track("a", PROMPT)
    assert n == 0 and t.plan.kind == "compute"
    assert t.plan.alternatives["load_prefix"] < t.plan.alternatives["compute"]
    # At 2 MB/s loading is three times as fast: planned.
    p = planned(rank.key, tier_rates={"file": 0.002}, prefill_tokens_per_s=2600.0)
    assert p.matched_tokens("b", PROMPT, None, 0) == 12 * BS
