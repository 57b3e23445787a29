"""The vLLM connector's counters (per step, merged, per tier, Prometheus) and
its JSON-lines traces, over real stores (no vLLM here)."""

import json

import pytest

torch = pytest.importorskip("torch")

import cascade  # noqa: E402
from cascade.integrations.connector_config import (  # noqa: E402
    ConnectorConfig,
)
from cascade.integrations.connector_core import (  # noqa: E402
    ConnectorMetrics,
    KvTransferWorker,
    PrometheusCounters,
    StepPlan,
    TraceRecorder,
    TransferJob,
    merge_counters,
)
from connector_helpers import (  # noqa: E402
    BS,
    NB,
    PROMPT,
    conn_shm_path,
    make_layers,
    planner_for,
    schedule_prefill,
)

# ---------------------------------------------------------------------------
# Traces and metrics


def test_traces_are_json_lines(ranks, tmp_path):
    path = tmp_path / "trace.jsonl"
    key, (r0,) = ranks(traces=TraceRecorder(str(path), "rank0"))
    p = planner_for(key, traces=TraceRecorder(str(path), "scheduler"))
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    _, plan = schedule_prefill(p, "b", PROMPT, list(range(6, 12)))
    r0.step(plan)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    ops = [(x["role"], x["op"], x["request_id"]) for x in lines]
    assert ops == [
        ("scheduler", "lookup", "a"),
        ("rank0", "save", "a"),
        ("scheduler", "lookup", "b"),
        ("rank0", "load", "b"),
    ]
    save, load = lines[1], lines[3]
    bb = r0.worker.kv.stored_block_bytes
    assert (save["blocks"], save["bytes"], save["errors"]) == (5, 5 * bb, 0)
    assert (load["blocks"], load["bytes"], load["errors"]) == (5, 5 * bb, 0)
    assert lines[2]["hit_tokens"] == 5 * BS and all(x["ms"] >= 0 for x in lines)


def test_metrics_deltas_and_merge():
    m = ConnectorMetrics()
    m.add("hit_tokens", 16)
    m.add_tier("hits", "host", 3)
    m.add("load_errors", 0)
    assert m.take() == {"hit_tokens": 16, "tier_hits:host": 3}
    assert m.take() == {}
    assert m.totals["hit_tokens"] == 16
    assert merge_counters({"a": 1, "b": 2}, {"b": 3, "c": 4}) == {"a": 1, "b": 5, "c": 4}


def test_tier_hits_of_loads(ranks):
    key, (r0,) = ranks()
    metrics = ConnectorMetrics()
    r0.worker.metrics = metrics
    p = planner_for(key)
    _, plan = schedule_prefill(p, "a", PROMPT, list(range(6)))
    r0.step(plan)
    r0.worker.wait_all_saves()
    metrics.take()
    _, plan = schedule_prefill(p, "b", PROMPT, list(range(6, 12)))
    r0.step(plan)
    assert metrics.take().get("tier_hits:host", 0) >= 5


def test_tier_counts_of_loads_from_the_file_tier(tmp_path):
    store = cascade.CascadeStore(
        cascade.config_from_dict(
            {
                "pipeline": "host|file",
                "shm_path": conn_shm_path(),
                "shm_capacity_bytes": 64 << 10,
                "lustre_path": str(tmp_path),
                "num_io_threads": 2,
            }
        )
    )
    metrics = ConnectorMetrics()
    worker = KvTransferWorker(ConnectorConfig(), store, rank=0, world=1, metrics=metrics)
    try:
        worker.register(make_layers("packed_kv", 7), block_size=BS, layout="packed_kv")
        ids = [f"{i:032x}" for i in range(1, NB)]
        worker.submit_saves(StepPlan(saves=[TransferJob("a", 0, list(range(1, NB)), [ids])]))
        assert worker.wait_all_saves(timeout=10)
        assert store.get_stats()["tiers"]["file"]["blocks"] > 0  # the small host tier spilled
        metrics.take()
        worker.start_load(
            StepPlan(loads=[TransferJob("b", 0, [0, 1, 2], [ids[:3]])])
        )  # the oldest: on disk
        assert worker.take_load_errors() == set()
        m = metrics.take()
        # Promoted first (read from file), then read from host.
        assert m["tier_hits:file"] == 3 and m["tier_hits:host"] == 3 and m["load_blocks"] == 3
    finally:
        worker.close()


def test_prometheus_counters():
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()

    def counter(**kw):
        return prom.Counter(registry=registry, **kw)

    pc = PrometheusCounters(counter, ["engine"], prefix="cascade_test_")
    pc.observe(
        {
            "hit_tokens": 32,
            "load_bytes": 4096,
            "tier_hits:file": 2,
            "tier_misses:host": 2,
            "unknown": 1,
        },
        ["0"],
    )
    pc.observe({"hit_tokens": 16}, ["0"])
    assert registry.get_sample_value("cascade_test_hit_tokens_total", {"engine": "0"}) == 48
    assert registry.get_sample_value("cascade_test_load_bytes_total", {"engine": "0"}) == 4096
    assert (
        registry.get_sample_value("cascade_test_tier_hits_total", {"engine": "0", "tier": "file"})
        == 2
    )
    assert (
        registry.get_sample_value("cascade_test_tier_misses_total", {"engine": "0", "tier": "host"})
        == 2
    )
