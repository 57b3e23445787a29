"""vLLM KV connector: Cascade as vLLM's prefix cache beyond GPU memory.

Enable it with (docs/vllm.md lists every option):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CascadeConnector",
        "kv_connector_module_path": "cascade.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store_pipeline": "host|file",
                                      "storage_path": "/mnt/nvme/kv"}}'

This class only adapts vLLM's v1 connector API (vllm 0.32 and 0.33,
``KVConnectorBase_V1``) to ``cascade.integrations.connector_core``, which
does the work and is tested without vLLM:

- scheduler process: ``SchedulerPlanner`` (lookups, load and save plans);
- each worker: ``KvTransferWorker`` over the worker's own CascadeStore, and
  a lookup answer for the scheduler (same process: a direct call; another
  process: a Unix socket, ``connector_lookup``).

Loads are synchronous (before the forward pass, or layer by layer with
``use_layerwise``); saves are asynchronous: a request whose saves are queued
keeps its pages until the workers report them done (``request_finished`` /
``get_finished``). A block that fails to load is reported through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy:
"recompute"`` vLLM recomputes it, with vLLM's default ("fail") the request
fails. Never a silent hit.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

import cascade
from cascade.integrations.connector_config import (
    parse_connector_config,
    reclaim_stale_arenas,
    worker_store_config,
)
from cascade.integrations.connector_core import (
    ConnectorMetrics,
    KvTransferWorker,
    PrometheusCounters,
    RankShards,
    ScheduledRequest,
    SchedulerPlanner,
    StepPlan,
    TraceRecorder,
    merge_counters,
    split_layout,
)
from cascade.integrations.connector_lookup import (
    LookupService,
    PrefixLookup,
    register_worker,
    unregister_worker,
)
from cascade.integrations.ids import KvNamespace, config_fingerprint, salt_of
from cascade.integrations.kv import kv_layout_of
from cascade.integrations.lookup_wire import remove_stale_service_dirs

try:  # vLLM >= 0.30 names the tier of external hits
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("cascade.integrations.connector")

# The stored block format family of this connector's ids (the stored bytes
# do not depend on the engine's layout: docs/formats.md, "Stored KV block").
NAMESPACE_LAYOUT = "packed_kv"
# Multi-head latent attention: one latent vector per token and layer, the same
# on every tensor-parallel rank, stored once per pipeline stage.
MLA_NAMESPACE_LAYOUT = "mla"

# Why a KV cache spec type other than full attention or MLA is refused.
_REFUSED_SPECS = {
    "SlidingWindowSpec": "every attention layer uses a sliding window, and vLLM frees the "
    "pages that fall out of the window while a request runs, so they cannot be saved or "
    "loaded whole",
    "SlidingWindowMLASpec": "sliding-window MLA layers lose the pages outside the window",
    "ChunkedLocalAttentionSpec": "every layer uses chunked local attention, whose pages "
    "outside the chunk are freed while a request runs",
    "MambaSpec": "Mamba / linear-attention state is one state per request, not per token block; "
    "it is not stored",
}


def _cache_kind(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """``"mla"`` or ``"kv"`` (K and V per head), from vLLM's KV cache spec; raises
    NotImplementedError with the reason for anything this connector cannot store exactly."""
    parallel = vllm_config.parallel_config
    for attr, what in (
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        n = int(getattr(parallel, attr, 1) or 1)
        if n > 1:
            raise NotImplementedError(
                f"CascadeConnector does not support {what} ({attr}={n}): it spreads the tokens "
                "of a block over ranks; run with it set to 1"
            )
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    if kv_cache_config is None:
        return "mla" if use_mla else "kv"
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise NotImplementedError(
            "CascadeConnector supports models with one KV cache group; this model has "
            f"{len(groups)} ({kinds}). vLLM puts sliding-window and full-attention layers in "
            "one group when its hybrid KV cache manager is off, as it turns it off by default "
            "for this connector: do not pass --no-disable-hybrid-kv-cache-manager (or pass "
            "--disable-hybrid-kv-cache-manager). Models with Mamba or linear-attention state "
            "layers are not supported"
        )
    if not groups:
        raise NotImplementedError(
            "CascadeConnector: this model has no KV cache (attention-free): nothing to store"
        )
    from vllm.v1 import kv_cache_interface as kvi

    spec = groups[0].kv_cache_spec
    uniform = getattr(kvi, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        specs = list(spec.kv_cache_specs.values())
        if any(s != specs[0] for s in specs[1:]):
            raise NotImplementedError(
                "CascadeConnector: the layers of this model have KV caches of different shapes "
                "(one group of several specs); a stored block needs every layer's pages to be "
                "alike"
            )
        spec = specs[0]
    name = type(spec).__name__
    if type(spec) is getattr(kvi, "MLAAttentionSpec", None):
        kind = "mla"
    elif type(spec) is kvi.FullAttentionSpec:
        kind = "kv"
    else:
        why = _REFUSED_SPECS.get(name, "a KV cache this connector has no stored format for")
        raise NotImplementedError(f"CascadeConnector does not support {name} layers: {why}")
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        raise NotImplementedError(
            f"CascadeConnector: this model stores one KV state per {tokens_per_state} tokens "
            "(compressed attention); only one state per token is supported"
        )
    return kind


# The workers' counters the scheduler's load-or-compute plan reads.
PLAN_COUNTERS = ("load_seconds", "load_bytes")


@dataclass
class CascadeConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    plan: StepPlan


@dataclass
class CascadeConnectorStats(KVConnectorStats):
    """Counter deltas (``connector_core.COUNTERS`` keys, ``tier_hits:<tier>``,
    ``tier_misses:<tier>``), summed over workers."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and not other.is_empty():
            self.data = merge_counters(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: v for k, v in sorted(self.data.items())}
        looked = self.data.get("lookup_tokens", 0)
        if looked:
            out["hit_rate"] = round(self.data.get("hit_tokens", 0) / looked, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CascadePromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus registry (``vllm:cascade_*``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = PrometheusCounters(self._counter_cls, labelnames, prefix="vllm:cascade_")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues.get(engine_idx, []) if self._labelnames else []
        self._counters.observe(transfer_stats_data, labels)


def _model_name(vllm_config: VllmConfig) -> str:
    mc = vllm_config.model_config
    name = str(mc.model)
    if getattr(mc, "revision", None):
        name += f"@{mc.revision}"
    if getattr(mc, "quantization", None):
        name += f"#{mc.quantization}"
    return name


def _kv_shape_tag(vllm_config: VllmConfig) -> str:
    """What a block's bytes depend on besides the model's name: the model's
    configuration as its overrides left it (a digest), and this engine's KV
    geometry. Added to the name, also to a configured model_name: two engines
    whose KV differs never share ids, whatever they are called."""
    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    parts = []
    to_dict = getattr(getattr(mc, "hf_config", None), "to_dict", None)
    if callable(to_dict):
        parts.append(f"config={config_fingerprint(to_dict())}")
    for name, ask in (
        ("kv_heads", lambda: mc.get_num_kv_heads(parallel)),
        ("head_size", lambda: mc.get_head_size()),
        ("layers", lambda: mc.get_num_layers(parallel)),
    ):
        try:
            parts.append(f"{name}={int(ask())}")
        except (AttributeError, TypeError, ValueError, NotImplementedError):
            continue  # a model config that cannot say: the digest covers it
    return "".join("|" + p for p in parts)


def _kv_dtype(vllm_config: VllmConfig) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).replace("torch.", "")


def request_salt(request: Request) -> str | None:
    """What, besides its tokens, makes a request's KV differ: vLLM's
    ``cache_salt``, a LoRA adapter, multimodal inputs (by content hash and place)."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("cache_salt", str(salt)))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(("lora", str(lora.lora_name)))
        parts.append(("lora_path", str(getattr(lora, "lora_path", "") or "")))
    features = getattr(request, "mm_features", None) or []
    if features:
        h = hashlib.sha256()
        for f in features:
            pos = getattr(f, "mm_position", None)
            offset, length = getattr(pos, "offset", ""), getattr(pos, "length", "")
            h.update(salt_of(("id", str(f.identifier)), ("at", f"{offset}+{length}")).encode())
            h.update(b"\x00")
        parts.append(("mm", h.hexdigest()[:32]))
    return salt_of(*parts) if parts else None


class CascadeConnector(KVConnectorBase_V1):
    """Cascade behind vLLM's v1 KV connector API (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = parse_connector_config(ktc.kv_connector_extra_config)
        self.kind = _cache_kind(vllm_config, kv_cache_config)
        self.block_size = self._manager_block_size(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        self.world = int(parallel.world_size)
        dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
        self.dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0) if dp_size > 1 else None
        self.engine_key = f"{ktc.engine_id}/dp{self.dp_rank or 0}"
        model = (self.config.model_name or _model_name(vllm_config)) + _kv_shape_tag(vllm_config)
        dtype = _kv_dtype(vllm_config)
        if dtype.startswith("fp8") and getattr(
            vllm_config.cache_config, "calculate_kv_scales", False
        ):
            # The scales come from this engine's first batches: another engine,
            # or this one restarted, quantizes the same tokens with others.
            model += f"|kv_scales=computed:{ktc.engine_id}"
            logger.warning(
                "CascadeConnector: calculate_kv_scales is on, so the fp8 KV cache's scales are "
                "this engine's own: its blocks are kept apart from every other engine's and from "
                "its next start's (scales from the checkpoint are shared)"
            )
        if self.kind == "mla":
            tp = int(parallel.tensor_parallel_size)
            if tp > 1 and not self.config.pool_socket and not self.config.use_lite:
                raise NotImplementedError(
                    "CascadeConnector: an MLA model's KV cache is the same on every "
                    "tensor-parallel rank, so it is stored once, by TP rank 0, and every rank "
                    f"loads it; with tensor_parallel_size {tp} the workers must share one store: "
                    "set pool_socket (a node pool server, `cascade serve`; docs/vllm.md)"
                )
            self.shards = RankShards.replicated_tp(
                model=model,
                dtype=dtype,
                layout=split_layout(
                    MLA_NAMESPACE_LAYOUT,
                    int(parallel.pipeline_parallel_size),
                    os.environ.get("VLLM_PP_LAYER_PARTITION", ""),
                    stages_named=True,
                ),
                block_size=self.block_size,
                tp_size=tp,
                pp_size=int(parallel.pipeline_parallel_size),
                tenant=self.config.tenant,
            )
            if self.shards.world != self.world:
                raise ValueError(
                    f"CascadeConnector: tensor {tp} x pipeline {parallel.pipeline_parallel_size} "
                    f"parallel ranks, but a world of {self.world}"
                )
        else:
            self.shards = RankShards.per_rank(
                KvNamespace(
                    model,
                    dtype,
                    split_layout(
                        NAMESPACE_LAYOUT,
                        int(parallel.pipeline_parallel_size),
                        os.environ.get("VLLM_PP_LAYER_PARTITION", ""),
                    ),
                    self.block_size,
                    0,
                    self.world,
                    None,
                )
            )
        self.namespace = self.shards.namespaces[0].with_tenant(self.config.tenant)
        if CacheHitSource is not None:
            top = self.config.store_pipeline.split("|")[0].strip()
            self._cache_hit_source = {
                "gpu": CacheHitSource.DEVICE,
                "hbm": CacheHitSource.DEVICE,
                "file": CacheHitSource.DISK,
                "lustre": CacheHitSource.DISK,
                "posix": CacheHitSource.DISK,
            }.get(top, CacheHitSource.HOST)
        self.metrics = ConnectorMetrics()
        self.planner: SchedulerPlanner | None = None
        self.worker: KvTransferWorker | None = None
        self._lookup: PrefixLookup | None = None
        self._service: LookupService | None = None
        self._rank = 0
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)
        else:
            self._init_worker(vllm_config)

    @staticmethod
    def _manager_block_size(vllm_config, kv_cache_config) -> int:
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        bs = vllm_config.cache_config.block_size
        if not bs:
            raise ValueError("CascadeConnector: the KV block size is not resolved yet")
        return int(bs)

    def _traces(self, role: str) -> TraceRecorder:
        return TraceRecorder(
            self.config.trace_path if self.config.enable_record_traces else None, role
        )

    # ------------------------------------------------------------------
    # Scheduler side

    def _init_scheduler(self, vllm_config, kv_cache_config) -> None:
        ktc = self._kv_transfer_config
        lite_blocks = None
        if self.config.use_lite and kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            group = kv_cache_config.kv_cache_groups[0]
            # One worker's block (the spec is per worker: its share of the heads), every layer.
            block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            capacity = self.config.host_capacity + (
                self.config.file_capacity if self.config.storage_path else 0
            )
            lite_blocks = max(1, capacity // max(1, block_bytes))
        self._lookup = PrefixLookup(
            self.engine_key,
            self.world,
            mode=self.config.lookup,
            socket_dir=self.config.lookup_socket_dir,
            timeout_ms=self.config.lookup_timeout_ms,
        )
        bytes_per_token = layers = None
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            group = kv_cache_config.kv_cache_groups[0]
            layers = len(group.layer_names)
            # One worker's KV of a token in every layer: what a stored block holds per token.
            bytes_per_token = group.kv_cache_spec.page_size_bytes * layers // self.block_size
        sched = getattr(vllm_config, "scheduler_config", None)
        chunk = getattr(sched, "max_num_batched_tokens", None) if sched is not None else None
        self.planner = SchedulerPlanner(
            self.config,
            self.namespace,
            self._lookup,
            can_load=ktc.is_kv_consumer,
            can_save=ktc.is_kv_producer,
            metrics=self.metrics,
            traces=self._traces("scheduler"),
            lite_capacity_blocks=lite_blocks,
            shards=self.shards,
            kv_bytes_per_token=bytes_per_token,
            num_layers=layers,
            chunk_tokens=int(chunk) if chunk else None,
        )

    def _scheduler(self) -> SchedulerPlanner:
        """The planner; vLLM calls the scheduler hooks only in the scheduler role."""
        if self.planner is None:
            raise RuntimeError("CascadeConnector: a scheduler hook called on a worker")
        return self.planner

    def on_new_request(self, request: Request) -> None:
        self._scheduler().track(request.request_id, request.prompt_token_ids, request_salt(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n = self._scheduler().matched_tokens(
            request.request_id, request.prompt_token_ids, request_salt(request), num_computed_tokens
        )
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        table = blocks.get_block_ids()
        self._scheduler().after_alloc(
            request.request_id,
            request.prompt_token_ids,
            request_salt(request),
            table[0] if table else [],
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        num_sched = scheduler_output.num_scheduled_tokens
        scheduled = []
        for r in scheduler_output.scheduled_new_reqs:
            scheduled.append(
                ScheduledRequest(
                    r.req_id,
                    r.num_computed_tokens,
                    num_sched.get(r.req_id, 0),
                    block_ids=list(r.block_ids[0]) if r.block_ids else [],
                    replace_blocks=True,
                    prompt=r.prompt_token_ids,
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    cached.num_computed_tokens[i],
                    num_sched.get(req_id, 0),
                    block_ids=list(new_blocks[0]) if new_blocks else None,
                    replace_blocks=req_id in cached.resumed_req_ids,
                )
            )
        plan = self._scheduler().build_plan(scheduled, scheduler_output.preempted_req_ids or ())
        return CascadeConnectorMetadata(plan)

    def update_connector_output(self, connector_output) -> None:
        """A step's output from the workers: their load times teach the plan."""
        super().update_connector_output(connector_output)
        if self.planner is None:
            return
        stats = getattr(connector_output, "kv_connector_stats", None)
        self.planner.step_output(getattr(stats, "data", None))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request.request_id), None

    def reset_cache(self) -> bool | None:
        """vLLM resets its prefix cache (e.g. after a weight update): nothing saved before is
        served."""
        if self.planner is None:
            return None
        self.planner.reset()
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # ------------------------------------------------------------------
    # Worker side

    def _init_worker(self, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        self._rank = int(parallel.rank)
        if not 0 <= self._rank < self.world:
            raise ValueError(
                f"CascadeConnector: worker rank {self._rank} outside world size {self.world}"
            )
        if self.config.use_lite:
            return  # lite mode: the scheduler counts, the workers move nothing
        if not self.config.pool_socket:
            for path in reclaim_stale_arenas(self.config.shm_dir):
                logger.warning(
                    "CascadeConnector: removed the host arena of a stopped worker: %s", path
                )
        gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
        store_cfg = worker_store_config(
            self.config,
            engine_key=self.engine_key,
            rank=self._rank,
            world=self.world,
            dp_rank=self.dp_rank,
            gpu_device=gpu,
        )
        store = cascade.CascadeStore(store_cfg)
        self.worker = KvTransferWorker(
            self.config,
            store,
            rank=self._rank,
            world=self.world,
            metrics=self.metrics,
            traces=self._traces(f"rank{self._rank}"),
            stores_blocks=self._rank in self.shards.savers,
        )
        if self.config.lookup != "socket":
            try:
                register_worker(
                    self.engine_key, self._rank, self.worker.prefix_length, self.worker.locate
                )
            except BaseException:
                self.worker.close()  # and its store
                self.worker = None
                raise
        backend = getattr(parallel, "distributed_executor_backend", None)
        if self.config.lookup == "socket" or (self.config.lookup == "auto" and backend != "uni"):
            stale = remove_stale_service_dirs(
                self.config.lookup_socket_dir, keep_engine_key=self.engine_key
            )
            for path in stale:
                logger.info(
                    "CascadeConnector: removed the lookup directory of a stopped worker: %s", path
                )
            self._service = LookupService(
                self.engine_key,
                self._rank,
                self.worker.prefix_length,
                locate_fn=self.worker.locate,
                socket_dir=self.config.lookup_socket_dir,
            )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.worker is None:
            return
        first = next(iter(kv_caches.values()))
        if self.kind == "mla":
            layout = "mla"
            tokens = first.shape[1] if first.dim() == 3 else first.shape[2]
        else:
            layout = kv_layout_of(first)
            tokens = first.shape[2]
        if tokens != self.block_size:
            raise NotImplementedError(
                f"CascadeConnector: the attention kernel splits each {self.block_size}-token block "
                f"into blocks of {tokens} tokens; run vLLM with --block-size {tokens}"
            )
        self.worker.register(kv_caches, block_size=self.block_size, layout=layout)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if self.worker is not None and isinstance(kv_connector_metadata, CascadeConnectorMetadata):
            self.worker.flush(kv_connector_metadata.plan.flush_req_ids)

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, CascadeConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if self.worker is not None and plan is not None:
            self.worker.start_load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        # Blocks are stored whole (every layer), after the forward pass: wait_for_save.
        return

    def wait_for_save(self):
        plan = self._plan()
        if self.worker is None or plan is None:
            return
        self.worker.finish_loads()
        self.worker.submit_saves(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        done = self.worker.finished_saving(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        return self.worker.take_load_errors()

    # ------------------------------------------------------------------
    # Both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.planner is not None:
            # vLLM's scheduler asks for its connector's counters once per step,
            # when it has processed the step's output (after
            # update_connector_output): the end of the step for the plan's clock.
            self.planner.step_done()
        data = self.metrics.take()
        if not self.config.enable_metrics:
            if self.worker is None or self.config.load_policy != "auto":
                return None
            # The scheduler's plan learns the tier rates from these.
            data = {k: v for k, v in data.items() if k in PLAN_COUNTERS}
        return CascadeConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return CascadeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return CascadePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        try:
            return parse_connector_config(extra_config).use_layerwise
        except Exception:
            return False  # the constructor reports the bad option

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any layout: the stored bytes do not depend on it

    def shutdown(self):
        if self._service is not None:
            self._service.close()
            self._service = None
        if self.worker is not None:
            unregister_worker(self.engine_key, self._rank, self.worker.prefix_length)
            self.worker.close()
            self.worker = None
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None
        if self.planner is not None:
            self.planner.traces.close()
