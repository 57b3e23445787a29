"""The scheduler side of the connector (``SchedulerPlanner``) and the plan of
one engine step it hands the workers (``StepPlan``: plain, picklable data).
Overview: ``cascade.integrations.connector_core``."""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cascade.integrations.connector_config import (
    ConnectorConfig,
    file_read_cap_gbps,
    planner_tiers,
)
from cascade.integrations.connector_metrics import ConnectorMetrics, TraceRecorder
from cascade.integrations.ids import KvNamespace, prefix_block_ids, salt_of
from cascade.planner import MEMORY_TIERS, LoadPlanner, Plan

logger = logging.getLogger("cascade.integrations.connector")

# ---------------------------------------------------------------------------
# The plan of one engine step (scheduler -> workers; plain, picklable data)


@dataclass
class TransferJob:
    """Blocks of one request to move: engine block ``engine_blocks[i]`` is the
    request's block ``first_block + i``, stored under ``ids[rank][i]`` on each rank."""

    req_id: str
    first_block: int
    engine_blocks: list
    ids: list  # list (one per rank) of lists of 32-hex ids
    # A save whose ids may hold bytes a failed step computed: they are
    # removed and stored again, not skipped as present.
    replace: bool = False


@dataclass
class StepPlan:
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    # Preempted requests: their pages go back to the engine this step, so
    # their pending saves must finish before anything else writes them.
    flush_req_ids: set = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.flush_req_ids)


@dataclass(frozen=True)
class RankShards:
    """Which namespace each worker rank's blocks are stored under, and which
    ranks store them.

    ``per_rank``: every rank holds its own shard of the KV (heads split over
    tensor parallelism, layers over pipeline stages), stored by that rank in
    its own namespace (rank r of the world). ``replicated_tp``: the KV of a
    pipeline stage is the same on every tensor-parallel rank (multi-head
    latent attention), so the ranks of a stage share one namespace (tp rank 0
    of 1; the stage in the layout name) and only the stage's first rank
    stores; every rank loads. Ranks are numbered as vLLM numbers them within
    an engine: ``rank = pp_rank * tp_size + tp_rank``.
    """

    namespaces: tuple  # per rank: the KvNamespace of its blocks (tenant unset)
    savers: frozenset  # ranks that store the blocks of their namespace

    @property
    def world(self) -> int:
        return len(self.namespaces)

    @classmethod
    def per_rank(cls, base: KvNamespace) -> RankShards:
        world = base.tp_world
        return cls(tuple(base.for_rank(r) for r in range(world)), frozenset(range(world)))

    @classmethod
    def replicated_tp(
        cls,
        *,
        model: str,
        dtype: str,
        layout: str,
        block_size: int,
        tp_size: int,
        pp_size: int,
        tenant: str | None = None,
    ) -> RankShards:
        if tp_size <= 0 or pp_size <= 0:
            raise ValueError(f"tp_size {tp_size} and pp_size {pp_size} must be positive")
        stages = [
            KvNamespace(
                model,
                dtype,
                layout if pp_size == 1 else f"{layout}/pp={p}of{pp_size}",
                block_size,
                0,
                1,
                tenant,
            )
            for p in range(pp_size)
        ]
        namespaces = tuple(stages[r // tp_size] for r in range(tp_size * pp_size))
        return cls(namespaces, frozenset(p * tp_size for p in range(pp_size)))


def split_layout(layout: str, pp_size: int, partition: str = "", stages_named: bool = False) -> str:
    """The layout name of a rank's blocks with how an engine's ranks split
    the KV where the rank and world size alone do not say it: a world of
    tensor x pipeline ranks holds heads and layers in other shares than one
    of tensor ranks alone (equal in bytes per block), and a layer partition
    (vLLM's ``VLLM_PP_LAYER_PARTITION``) moves layers between the stages.
    ``stages_named``: the layout names each stage already (MLA). A single
    stage keeps the layout as it is."""
    if pp_size <= 1:
        return layout
    partition = partition.replace(" ", "")
    name = layout if stages_named else f"{layout}/pp={pp_size}"
    return f"{name}/layers={partition}" if partition else name


def _slices(ids_by_rank: list, first: int, end: int) -> list:
    """``ids[first:end]`` of every rank; ranks sharing one list share the slice."""
    memo: dict = {}
    out = []
    for ids in ids_by_rank:
        part = memo.get(id(ids))
        if part is None:
            part = memo[id(ids)] = ids[first:end]
        out.append(part)
    return out


@dataclass
class ScheduledRequest:
    """One request of a scheduler step, as the planner needs it.

    ``block_ids``: the request's whole block table when ``replace_blocks``
    (a new or resumed request), else blocks appended this step.
    ``prompt``/``salt`` are only needed for a request the planner has not seen.
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list | None = None
    replace_blocks: bool = False
    prompt: Sequence[int] | None = None
    salt: str | None = None


# ---------------------------------------------------------------------------
# Scheduler side


class LiteCache:
    """The cache of lite mode: ids only, no data, least recently used dropped
    beyond ``capacity_blocks`` (None: unbounded). Tells what hit rate a real
    cache of that size would give, without moving a byte."""

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"lite cache capacity must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._ids: OrderedDict[str, None] = OrderedDict()

    def prefix_length(self, ids_by_rank: Sequence[Sequence[str]]) -> int:
        n = 0
        for i in ids_by_rank[0]:
            if i not in self._ids:
                break
            self._ids.move_to_end(i)
            n += 1
        return n

    def add(self, ids: Iterable[str]) -> None:
        for i in ids:
            self._ids[i] = None
            self._ids.move_to_end(i)
        if self.capacity_blocks is not None:
            while len(self._ids) > self.capacity_blocks:
                self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class _Tracked:
    req_id: str
    prompt: list
    salt: str | None
    eligible: bool
    ids: list | None = None  # per rank: ids of the prompt's full blocks
    lookup_computed: int = 0  # num_computed_tokens given to the last lookup
    lookup_present: int = 0  # leading blocks every rank held at the last lookup
    lookup_hit_tokens: int = 0  # tokens the last lookup found loadable (before the local hit)
    block_table: list = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks stored or with a save planned
    pending_load: tuple | None = None  # (first block, end block) to load in the next plan
    has_saves: bool = False  # a save was ever planned (pages held at finish)
    plan: Plan | None = None  # the load-or-compute plan of its prompt, until its outcome
    plan_t0: float | None = None  # when its first step started
    plan_solo: bool = True  # every step of its prefill ran it alone
    # Tokens computed once its last planned step ran (None: no step since
    # it was first seen or preempted); a later step that starts before it
    # was rolled back (a failed load: the engine computes those tokens again).
    stepped_end: int | None = None
    replace_until: int = 0  # blocks below this are saved with `replace`


@dataclass
class _Step:
    """A step handed to the engine, until its output comes back."""

    built: float  # when its plan was built (perf_counter)
    shapes: list  # (request id, tokens scheduled, tokens computed before)
    load_bytes: dict  # tier -> bytes its loads were planned to read (per rank)


class StepClock:
    """The engine's steps as the scheduler sees them: each step's plan is
    built (``begin``), the engine runs it, and its output comes back
    (``end``), in the order the steps were built. A step's time runs from
    the later of its build and the previous step's end to its own end: the
    engine runs one step at a time, so with steps queued ahead (asynchronous
    scheduling) a step starts when the one before it ends."""

    def __init__(self):
        self._steps: collections.deque[_Step] = collections.deque()
        self._last_end: float | None = None

    def begin(self, step: _Step) -> None:
        self._steps.append(step)

    def end(self, now: float) -> tuple[_Step, float, float] | None:
        """The oldest step in flight, when it started and how long it took."""
        if not self._steps:
            return None
        step = self._steps.popleft()
        start = step.built if self._last_end is None else max(step.built, self._last_end)
        self._last_end = now
        return step, start, max(0.0, now - start)

    @property
    def in_flight(self) -> int:
        return len(self._steps)


class SchedulerPlanner:
    """Scheduler-side bookkeeping of the connector (see the module docstring).

    Not thread-safe: vLLM's scheduler calls it from one thread.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        namespace: KvNamespace,
        lookup,
        *,
        can_load: bool = True,
        can_save: bool = True,
        metrics: ConnectorMetrics | None = None,
        traces: TraceRecorder | None = None,
        lite_capacity_blocks: int | None = None,
        shards: RankShards | None = None,
        kv_bytes_per_token: int | None = None,
        num_layers: int | None = None,
        chunk_tokens: int | None = None,
    ):
        """``lookup``: a PrefixLookup over the workers' stores (ignored in lite
        mode, where a LiteCache of ``lite_capacity_blocks`` ids stands in).
        ``shards``: each rank's namespace (default: ``RankShards.per_rank(namespace)``).

        ``kv_bytes_per_token`` (one rank's KV of one token, every layer),
        ``num_layers`` and ``chunk_tokens`` (the engine's most tokens per
        step) describe the engine to the load-or-compute plan; with
        ``load_policy: auto`` and both of the first two given, hits are
        loaded only as far as loading pays (``load_planner``)."""
        self.config = config
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.shards = shards if shards is not None else RankShards.per_rank(namespace)
        if any(ns.block_size != self.block_size for ns in self.shards.namespaces):
            raise ValueError("every rank's namespace must have the planner's block size")
        self.world = self.shards.world
        self.lite = LiteCache(lite_capacity_blocks) if config.use_lite else None
        self.lookup = self.lite if self.lite is not None else lookup
        if self.lite is None and getattr(lookup, "world", self.world) != self.world:
            raise ValueError(f"lookup over {lookup.world} ranks, namespace of {self.world}")
        # Lite mode keeps the bookkeeping and moves no data.
        self.can_load = can_load and self.lite is None
        self.can_save = can_save and self.lite is None
        self._lite_save = can_save and self.lite is not None
        # Bumped by reset(): blocks saved before are never found again.
        self.epoch = 0
        self.epoch_tag = ""
        self.metrics = metrics or ConnectorMetrics()
        self.traces = traces or TraceRecorder(None, "scheduler")
        self._reqs: dict[str, _Tracked] = {}
        self.load_planner: LoadPlanner | None = None
        # Which tier holds each hit block (PrefixLookup.locate); None: unknown.
        self._locate = None if self.lite is not None else getattr(lookup, "locate", None)
        self._warned_unknown_tier = False
        if (
            self.can_load
            and config.load_policy == "auto"
            and kv_bytes_per_token
            and num_layers
            and self._locate is not None
        ):
            self.load_planner = self._make_load_planner(
                kv_bytes_per_token, num_layers, chunk_tokens
            )
        self.clock = StepClock()
        self._ran_a_step = False  # a step with tokens has ended
        # Requests finished before the end of their last step was seen (vLLM
        # frees a request while it processes the step's output, then ends
        # the step): kept for that step's outcome, then dropped.
        self._finishing: dict[str, _Tracked] = {}
        self._out_load_s = 0.0  # workers' load seconds reported since the last step ended
        self._out_load_bytes = 0.0

    # Loads smaller than this teach the tier rates nothing: their fixed costs
    # would pass for a slow tier.
    MIN_RATE_BYTES = 1 << 20
    # A load from a slow tier is planned only when it is predicted this much
    # faster than computing: a smaller gain is within the predictions' error,
    # and the tier's bandwidth may be shared.
    LOAD_MARGIN = 0.1

    def _make_load_planner(self, bytes_per_token: int, layers: int, chunk: int | None):
        tiers = planner_tiers(self.config)
        rates = dict(self.config.tier_rates)
        cap = file_read_cap_gbps(self.config)
        if cap is not None and "file" in tiers:
            rates["file"] = min(rates.get("file", cap), cap)
        return LoadPlanner(
            tiers,
            bytes_per_token,
            layers,
            layer_overlap=self.config.use_layerwise,
            # vLLM takes an external hit as a prefix after its own: blocks
            # cannot be computed before loaded ones.
            front_back=False,
            default_tokens_per_s=self.config.prefill_tokens_per_s,
            rates=rates,
            chunk_tokens=chunk,
        )

    # -- requests ----------------------------------------------------------
    def track(self, req_id: str, prompt: Sequence[int] | None, salt: str | None = None) -> _Tracked:
        """The request's state, created on first sight (memoisation, no visible effect)."""
        t = self._reqs.get(req_id)
        if t is None:
            tokens = list(prompt) if prompt is not None else []
            eligible = (
                prompt is not None
                and len(tokens) >= self.block_size
                and len(tokens) >= self.config.persist_token_threshold
            )
            t = _Tracked(req_id, tokens, salt, eligible)
            self._reqs[req_id] = t
        return t

    def ids_of(self, t: _Tracked) -> list:
        if t.ids is None:
            tenant = self.config.namespace_tenant(t.salt)
            if self.epoch:
                parts = [] if tenant is None else [("salt", tenant)]
                tenant = salt_of(*parts, ("epoch", self.epoch_tag))
            full = len(t.prompt) // self.block_size * self.block_size
            by_ns: dict = {}
            t.ids = []
            for ns in self.shards.namespaces:
                ns = ns.with_tenant(tenant)
                ids = by_ns.get(ns.digest)
                if ids is None:
                    ids = by_ns[ns.digest] = prefix_block_ids(t.prompt[:full], ns)
                t.ids.append(ids)
        return t.ids

    def matched_tokens(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        salt: str | None,
        num_computed_tokens: int,
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (block aligned) that can be loaded."""
        t = self.track(req_id, prompt, salt)
        t.lookup_computed, t.lookup_present, t.lookup_hit_tokens = num_computed_tokens, 0, 0
        if not t.eligible:
            return 0
        start = time.perf_counter()
        ids = self.ids_of(t)
        planner = self.load_planner
        tiers: list[int] = []
        if planner is not None and self._locate is not None:
            tiers = list(self._locate(ids))
            # A worker whose pipeline is not the planner's can name a tier
            # the planner has not got: its blocks from there on are misses.
            known = next(
                (k for k, w in enumerate(tiers) if not 0 <= w < len(planner.tiers)), len(tiers)
            )
            if known < len(tiers):
                if not self._warned_unknown_tier:
                    logger.warning(
                        "Cascade lookup: a worker holds blocks in tier %d, outside this "
                        "scheduler's pipeline %s: counted as misses",
                        tiers[known],
                        "|".join(planner.tiers),
                    )
                    self._warned_unknown_tier = True
                tiers = tiers[:known]
            present = len(tiers)
        else:
            present = self.lookup.prefix_length(ids)
        # The engine computes at least the prompt's last token itself.
        hit_blocks = min(present, (len(t.prompt) - 1) // self.block_size)
        if self.config.hit_ratio is not None:
            cap_tokens = int(self.config.hit_ratio * len(t.prompt))
            hit_blocks = min(hit_blocks, cap_tokens // self.block_size)
        hit_tokens = hit_blocks * self.block_size
        t.lookup_present = present
        found = max(0, hit_tokens - num_computed_tokens)
        t.plan = None
        # Hits wholly in memory tiers are loaded without a plan: a copy from
        # memory beats recomputing on any engine, and a model still learning
        # must not refuse one.
        slow = planner is not None and any(
            planner.tiers[w] not in MEMORY_TIERS
            for w in tiers[num_computed_tokens // self.block_size : hit_blocks]
        )
        if planner is not None and slow and found and num_computed_tokens % self.block_size == 0:
            t.plan = planner.plan(
                len(t.prompt),
                self.block_size,
                tiers[:hit_blocks],
                computed_tokens=num_computed_tokens,
            )
            compute_s = t.plan.alternatives.get("compute", 0.0)
            if t.plan.kind == "load_prefix" and (
                t.plan.predicted.get("total", 0.0) > (1 - self.LOAD_MARGIN) * compute_s
            ):
                # Not enough faster to be worth it: the plan computes.
                alternatives = t.plan.alternatives
                t.plan = planner.plan(
                    len(t.prompt), self.block_size, [], computed_tokens=num_computed_tokens
                )
                t.plan.alternatives = alternatives
            if t.plan.kind == "load_prefix":
                hit_tokens = t.plan.load_end * self.block_size
            else:
                hit_tokens = num_computed_tokens
            t.plan_t0, t.plan_solo = None, True
        t.lookup_hit_tokens = hit_tokens
        self.traces.record(
            "lookup",
            req_id,
            blocks=present,
            ms=(time.perf_counter() - start) * 1e3,
            prompt_tokens=len(t.prompt),
            computed_tokens=num_computed_tokens,
            hit_tokens=found,
        )
        if t.plan is not None:
            self._trace_plan(t, found)
        if not self.can_load:
            return 0
        return max(0, hit_tokens - num_computed_tokens)

    def _trace_plan(self, t: _Tracked, found: int) -> None:
        plan = t.plan
        if plan is None:
            return
        skipped = found - plan.loaded_tokens if plan.kind == "load_prefix" else found
        self.metrics.add("plan_skipped_tokens", max(0, skipped))
        self.traces.record(
            "plan",
            t.req_id,
            blocks=plan.loaded_blocks,
            bytes=sum(plan.bytes_by_tier.values()),
            kind=plan.kind,
            hit_tokens=found,
            loaded_tokens=plan.loaded_tokens,
            computed_tokens=plan.computed_tokens,
            predicted_ms=round(plan.predicted.get("total", 0.0) * 1e3, 3),
            alternatives_ms={k: round(v * 1e3, 3) for k, v in plan.alternatives.items()},
            rates_gbps={k: round(v, 4) for k, v in plan.rates.items()},
            why=plan.describe(),
        )

    def after_alloc(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        salt: str | None,
        block_table: Sequence[int],
        num_external_tokens: int,
    ) -> None:
        """The engine allocated ``block_table`` for the request and will count
        ``num_external_tokens`` (after its own ``lookup_computed`` tokens) as loaded."""
        t = self.track(req_id, prompt, salt)
        t.block_table = list(block_table)
        if t.eligible:
            queried = max(0, len(t.prompt) - t.lookup_computed)
            found = (
                num_external_tokens
                if self.can_load
                else max(0, t.lookup_hit_tokens - t.lookup_computed)
            )
            self.metrics.add("lookup_requests")
            self.metrics.add("lookup_tokens", queried)
            self.metrics.add("hit_tokens", found)
            self.metrics.add("miss_tokens", max(0, queried - found))
            # Blocks every rank already holds need no save.
            t.saved_blocks = max(t.saved_blocks, t.lookup_present)
        if num_external_tokens <= 0 or not self.can_load:
            t.pending_load = None
            return
        bs = self.block_size
        if t.lookup_computed % bs:
            raise ValueError(
                f"request {req_id}: computed tokens {t.lookup_computed} not block aligned"
            )
        first = t.lookup_computed // bs
        end = -(-(t.lookup_computed + num_external_tokens) // bs)
        if end * bs > t.lookup_hit_tokens or end > len(t.block_table):
            raise ValueError(
                f"request {req_id}: {num_external_tokens} external tokens after "
                f"{t.lookup_computed} exceed the {t.lookup_hit_tokens} found loadable "
                f"or the {len(t.block_table)} blocks allocated"
            )
        t.pending_load = (first, end)

    def build_plan(
        self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()
    ) -> StepPlan:
        plan = StepPlan()
        bs = self.block_size
        scheduled = list(scheduled)
        step = _Step(
            time.perf_counter(),
            [(s.req_id, s.num_scheduled_tokens, s.num_computed_tokens) for s in scheduled],
            collections.Counter(),
        )
        if self.load_planner is not None:
            self.clock.begin(step)
        busy = sum(1 for s in scheduled if s.num_scheduled_tokens > 0)
        for s in scheduled:
            t = self._reqs.get(s.req_id)
            if t is None:
                if s.prompt is None:
                    continue  # never seen and nothing to key it by: nothing to do
                t = self.track(s.req_id, s.prompt, s.salt)
            if t.plan is not None and busy > 1:
                t.plan_solo = False
            if s.replace_blocks:
                t.block_table = list(s.block_ids or [])
            elif s.block_ids:
                t.block_table.extend(s.block_ids)
            if t.pending_load is not None:
                first, end = t.pending_load
                t.pending_load = None
                if t.plan is not None:
                    for tier, nbytes in t.plan.bytes_by_tier.items():
                        step.load_bytes[tier] += nbytes
                ids = self.ids_of(t)
                plan.loads.append(
                    TransferJob(t.req_id, first, t.block_table[first:end], _slices(ids, first, end))
                )
            rolled_back = t.stepped_end is not None and s.num_computed_tokens < t.stepped_end
            t.stepped_end = s.num_computed_tokens + s.num_scheduled_tokens
            if not ((self.can_save or self._lite_save) and t.eligible):
                continue
            if rolled_back and s.num_computed_tokens // bs < t.saved_blocks:
                # A rank's load failed in an earlier step, which computed the
                # blocks after it from wrong pages: a rank that knew dropped
                # their saves, others may have stored them. The engine
                # computes them again: they are saved again, replacing.
                t.replace_until = max(t.replace_until, t.saved_blocks)
                t.saved_blocks = s.num_computed_tokens // bs
            done = min(s.num_computed_tokens + s.num_scheduled_tokens, len(t.prompt)) // bs
            done = min(done, len(t.block_table))
            if done > t.saved_blocks:
                ids = self.ids_of(t)
                first = t.saved_blocks
                t.saved_blocks = done
                if self.lite is not None:
                    self.lite.add(ids[0][first:done])
                    continue
                plan.saves.append(
                    TransferJob(
                        t.req_id,
                        first,
                        t.block_table[first:done],
                        _slices(ids, first, done),
                        replace=first < t.replace_until,
                    )
                )
                t.has_saves = True
        for req_id in preempted:
            t = self._reqs.get(req_id)
            if t is not None and t.has_saves:
                plan.flush_req_ids.add(req_id)
            if t is not None:
                t.pending_load = None
                t.plan = None  # its prefill starts over: no outcome to learn from
                t.stepped_end = None  # it starts over: not a rollback
        return plan

    # -- what the plan learns from the engine -------------------------------
    def step_output(self, stats: Mapping[str, float] | None) -> None:
        """The workers' counters of a step's output (summed over ranks): its
        loads' seconds and bytes (``load_seconds``, ``load_bytes``)."""
        if self.load_planner is None or not stats:
            return
        self._out_load_s += float(stats.get("load_seconds", 0.0)) / self.world
        self._out_load_bytes += float(stats.get("load_bytes", 0.0)) / self.world

    def step_done(self, now: float | None = None) -> None:
        """The engine has returned the output of the oldest step in flight.

        Teaches the plan: the tier rates from the step's loads (seconds the
        workers measured, bytes by tier the plan sent them to read; the
        slowest tier takes the time the others' rates do not explain), the
        prefill time from a step that ran one request (its time less its
        loads), and each request whose prefill this step completed, its
        plan's outcome (traced, and a correction when it ran alone)."""
        planner = self.load_planner
        if planner is None:
            return
        now = time.perf_counter() if now is None else now
        ended = self.clock.end(now)
        load_s, load_bytes = self._out_load_s, self._out_load_bytes
        self._out_load_s = self._out_load_bytes = 0.0
        if ended is None:
            self._finishing.clear()
            return
        step, start, seconds = ended
        if step.load_bytes and load_s > 0 and load_bytes > 0:
            self._learn_rates(step.load_bytes, load_s)
        busy = [(r, m, p) for r, m, p in step.shapes if m > 0]
        # A layer-by-layer load runs beside the forward pass: such a step's
        # time is not its compute time plus its load's.
        overlapped = self.config.use_layerwise and load_s > 0
        # The engine's first step carries one-time costs (first calls of its
        # kernels, allocations): it would teach a prefill rate far too slow,
        # and its requests' outcomes corrections far too large.
        first = busy and not self._ran_a_step
        self._ran_a_step = self._ran_a_step or bool(busy)
        if len(busy) == 1 and seconds > load_s and not overlapped and not first:
            _, m, p = busy[0]
            planner.observe_prefill(m, p, seconds - load_s)
        for req_id, m, p in busy:
            t = self._reqs.get(req_id) or self._finishing.get(req_id)
            if t is None or t.plan is None:
                continue
            if first:  # nor does its outcome teach the corrections
                t.plan_solo = False
            if t.plan_t0 is None:
                t.plan_t0 = start
            if p + m >= len(t.prompt):
                plan, t.plan = t.plan, None
                measured = now - t.plan_t0
                entry = planner.record(plan, measured, learn=t.plan_solo)
                self.traces.record(
                    "plan_outcome",
                    req_id,
                    blocks=plan.loaded_blocks,
                    bytes=sum(plan.bytes_by_tier.values()),
                    ms=measured * 1e3,
                    kind=plan.kind,
                    loaded_tokens=plan.loaded_tokens,
                    computed_tokens=plan.computed_tokens,
                    predicted_ms=round(entry["predicted_s"] * 1e3, 3),
                    measured_ms=round(measured * 1e3, 3),
                    alone=t.plan_solo,
                    why=entry["why"],
                )
        self._finishing.clear()

    def _learn_rates(self, by_tier: Mapping[str, int], seconds: float) -> None:
        planner = self.load_planner
        assert planner is not None
        tiers = planner.tiers
        slowest = max(by_tier, key=lambda t: tiers.index(t) if t in tiers else -1)
        others = sum(planner.rates[t].seconds(b) for t, b in by_tier.items() if t != slowest)
        nbytes = by_tier[slowest]
        left = seconds - others
        if nbytes >= self.MIN_RATE_BYTES and left > 0:
            planner.observe_load(slowest, nbytes, left)

    def reset(self) -> None:
        """Makes every block saved so far unreachable (the engine's weights changed).

        The ids of later blocks carry a new epoch in their namespace, a
        random one, so no worker has to be reached and nothing is deleted: old
        blocks age out of the store as it evicts, and no other engine sharing
        the store (which may have reset as often with other weights) shares
        the new ids. A restart (with the weights loaded afresh) starts again
        from epoch 0.
        """
        self.epoch += 1
        # Random, not the count: another engine on the same store may have
        # reset as often with other weights, and must not share these ids.
        self.epoch_tag = secrets.token_hex(16)
        for t in self._reqs.values():
            t.ids = None
        if self.lite is not None:
            self.lite = LiteCache(self.lite.capacity_blocks)
            self.lookup = self.lite
        self.traces.record("reset", "", blocks=0, epoch=self.epoch)

    def request_finished(self, req_id: str) -> bool:
        """Forgets the request; True when its pages must stay until its saves are reported done."""
        t = self._reqs.pop(req_id, None)
        if t is not None and t.plan is not None and self.load_planner is not None:
            self._finishing[req_id] = t
        return bool(t is not None and t.has_saves)

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)
