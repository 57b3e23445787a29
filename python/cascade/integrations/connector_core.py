"""The engine-independent half of the vLLM KV connector.

``cascade.integrations.vllm.CascadeConnector`` is a thin adapter over what is
here, so this module is tested without vLLM (tests/test_connector_core.py).

Scheduler side (``SchedulerPlanner``), one per engine:
- ``matched_tokens``: how many prompt tokens beyond those already computed
  can be loaded: the longest run of full blocks every rank's store holds,
  never the prompt's last token (the engine must compute at least one),
  capped by ``hit_ratio``; no side effects besides memoising the request's
  block ids;
- ``after_alloc``: which engine blocks receive which store blocks;
- ``build_plan``: the step's work (a ``StepPlan``): loads, saves of the full
  prompt blocks completed by this step, and the preempted requests whose
  pending saves must finish before their pages are reused;
- ``request_finished``: whether the request's pages must stay allocated
  until the workers report its saves done.

Worker side (``KvTransferWorker``), one per rank: loads the plan's blocks
into the engine's pages before the forward pass (all at once, or layer by
layer in a thread), saves new blocks after it in a background thread,
reports requests whose saves are done and engine blocks that failed to load.

The code: ``connector_plan`` (scheduler side and the step's plan),
``connector_worker`` (worker side), ``connector_metrics`` (counters,
Prometheus, trace); this module gathers their public names.

Every store block holds one engine block of every layer (docs/formats.md,
"Stored KV block"); its id is the prefix-chained id of its tokens in the
rank's namespace (``cascade.integrations.ids``). ``RankShards`` says which
namespace each rank uses and which ranks store: every rank its own (K/V
heads split over ranks), or one per pipeline stage stored by the stage's
first rank (multi-head latent attention, the same on every tensor-parallel
rank).
"""

from cascade.integrations.connector_metrics import (
    COUNTERS,
    TIER_COUNTERS,
    ConnectorMetrics,
    PrometheusCounters,
    TraceRecorder,
    merge_counters,
)
from cascade.integrations.connector_plan import (
    LiteCache,
    RankShards,
    ScheduledRequest,
    SchedulerPlanner,
    StepPlan,
    TransferJob,
    split_layout,
)
from cascade.integrations.connector_worker import KvTransferWorker

__all__ = [
    "COUNTERS",
    "TIER_COUNTERS",
    "ConnectorMetrics",
    "KvTransferWorker",
    "LiteCache",
    "PrometheusCounters",
    "RankShards",
    "ScheduledRequest",
    "SchedulerPlanner",
    "StepPlan",
    "TraceRecorder",
    "TransferJob",
    "merge_counters",
    "split_layout",
]
